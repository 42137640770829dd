"""Megatron's conjugate operators as autograd functions, and the sequence-parallel linear.

[Note: f and g] (Shoeybi et al. 2019, "Megatron-LM", section 3.) A column-parallel layer
reads an input every tensor rank holds whole and writes a piece of its output features; a
row-parallel layer reads such pieces and writes partial sums of the full output. Two
operators glue them, each the other's transpose:

* ``f`` (entering a column-parallel region): identity forward, all-reduce of the input's
  gradient backward (each rank's gradient covers only its output features);
* ``g`` (leaving a row-parallel region): all-reduce forward (sum the partial outputs),
  identity backward.

[Note: sequence parallel] (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models".) Between tensor-parallel regions (norms, residual adds) each rank
holds only its ``1/tp`` of the sequence, so those activations cost ``1/tp`` of the memory.
``f`` becomes an all-gather along the sequence dim (backward: reduce-scatter) and ``g`` a
reduce-scatter along it (backward: all-gather). The column-parallel linears of a region do
not keep the gathered input for backward: they keep the sequence piece and all-gather it
again in backward (one gather per region, shared by its linears), as Megatron does, so the
saved activations too are ``1/tp`` of tp 1's. Activations are ``(B, T, ...)``: the
sequence dim is 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.distributed.comm import dims as comm_dims

__all__ = ["copy_to_region", "reduce_from_region", "gather_sequence", "scatter_sequence",
           "gather_last_dim", "SequenceInput", "sequence_linear"]

SEQ_DIM = 1


class _CopyToRegion(torch.autograd.Function):
    """``f`` ([Note: f and g])."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm_dims.all_reduce_sum(grad, ctx.group, label=ctx.label), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """``g`` ([Note: f and g])."""

    @staticmethod
    def forward(ctx, x, group, label):
        return comm_dims.all_reduce_sum(x, group, label=label)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, label, back_label):
        ctx.group, ctx.label = group, back_label
        return comm_dims.all_gather_dim(x, SEQ_DIM, group, label=label)

    @staticmethod
    def backward(ctx, grad):
        out = comm_dims.reduce_scatter_dim(grad, SEQ_DIM, ctx.group, label=ctx.label)
        return out, None, None, None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence dim; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group, label, back_label):
        ctx.group, ctx.label = group, back_label
        return comm_dims.reduce_scatter_dim(x, SEQ_DIM, group, label=label)

    @staticmethod
    def backward(ctx, grad):
        out = comm_dims.all_gather_dim(grad, SEQ_DIM, ctx.group, label=ctx.label)
        return out, None, None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim (a column-parallel output made whole); backward keeps
    this rank's piece of the gradient (no communication)."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group = group
        return comm_dims.all_gather_dim(x, -1, group, label=label)

    @staticmethod
    def backward(ctx, grad):
        return comm_dims.split_dim(grad, -1, ctx.group), None, None


def copy_to_region(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """``f``: identity forward, gradient all-reduced over ``group`` backward."""
    return _CopyToRegion.apply(x, group, label)


def reduce_from_region(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """``g``: ``x`` summed over ``group`` forward, identity backward."""
    return _ReduceFromRegion.apply(x, group, label)


def gather_sequence(x: torch.Tensor, group, label: str, back_label: str) -> torch.Tensor:
    """``(B, T/n, ...) -> (B, T, ...)``; backward reduce-scatters (sequence-parallel ``f``)."""
    return _GatherSequence.apply(x, group, label, back_label)


def scatter_sequence(x: torch.Tensor, group, label: str, back_label: str) -> torch.Tensor:
    """``(B, T, ...)`` partial sums -> this rank's ``(B, T/n, ...)`` of their sum; backward
    all-gathers (sequence-parallel ``g``)."""
    return _ScatterSequence.apply(x, group, label, back_label)


def gather_last_dim(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """``(..., F/n) -> (..., F)`` in rank order; backward keeps this rank's piece."""
    return _GatherLastDim.apply(x, group, label)


class SequenceInput:
    """The input of one sequence-parallel region: gathered once in forward and once in
    backward, whatever the number of linears reading it ([Note: sequence parallel]).

    Holds no tensor of the forward: ``full`` (the gathered input) is handed to the readers
    by whoever built this (and dropped when the region is left), and each reader saves
    only ``piece`` for backward.

    Args:
        group: the tensor-parallel group.
        label: prefix of the collectives' labels (the first reading module's path).
        tracker: a MemoryTracker told about the re-gathered input (kind ``tp_comm``).
    """

    def __init__(self, group, label: str, tracker=None) -> None:
        self.group, self.label, self.tracker = group, label, tracker
        self._regathered: torch.Tensor | None = None
        self.readers = 0  # linears whose backward is still to run

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The forward all-gather (its backward reduce-scatters the summed gradient)."""
        return gather_sequence(piece, self.group, f"{self.label}.sp_all_gather",
                               f"{self.label}.sp_reduce_scatter")

    def regathered(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole input again, for a weight gradient in backward (gathered on the first
        call, dropped after the region's last linear)."""
        if self._regathered is None:
            self._regathered = comm_dims.all_gather_dim(
                piece.detach(), SEQ_DIM, self.group, label=f"{self.label}.sp_regather")
            if self.tracker is not None and comm_dims.comm.group_size(self.group) > 1:
                self.tracker.add("tp_comm", self._nbytes())
        return self._regathered

    def _nbytes(self) -> int:
        return self._regathered.numel() * self._regathered.element_size()

    def release(self) -> None:
        """One reader's backward is done; the last one drops the re-gathered input."""
        self.readers -= 1
        if self.readers <= 0 and self._regathered is not None:
            if self.tracker is not None and comm_dims.comm.group_size(self.group) > 1:
                self.tracker.sub("tp_comm", self._nbytes())
            self._regathered = None


class _SequenceLinear(torch.autograd.Function):
    """``F.linear`` of a region's gathered input that keeps only the sequence piece for
    backward ([Note: sequence parallel])."""

    @staticmethod
    def forward(ctx, full, piece, weight, bias, source):
        ctx.source = source
        ctx.has_bias = bias is not None
        ctx.save_for_backward(piece, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        piece, weight = ctx.saved_tensors
        src = ctx.source
        grad_in = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_in = grad.matmul(weight)
        if ctx.needs_input_grad[2]:
            full = src.regathered(piece)
            grad_w = grad.flatten(0, -2).t().matmul(full.flatten(0, -2).to(grad.dtype))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = grad.flatten(0, -2).sum(0)
        src.release()
        return grad_in, None, grad_w, grad_b, None


def sequence_linear(full: torch.Tensor, piece: torch.Tensor, source: SequenceInput,
                    weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(full, weight, bias)`` where ``full`` is ``source``'s gathered ``piece``,
    saving ``piece`` rather than ``full`` for backward."""
    if torch.is_grad_enabled() and (weight.requires_grad or full.requires_grad):
        source.readers += 1
        return _SequenceLinear.apply(full, piece, weight, bias, source)
    return F.linear(full, weight, bias)
