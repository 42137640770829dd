"""Collectives along a tensor dimension, for tensor and sequence parallelism.

Built on the counted collectives of :mod:`shardwise.distributed.comm` (so their bytes, labels,
device checks and the watchdog cover them): an all-gather that concatenates every rank's
piece along ``dim``, a reduce-scatter that sums over ranks and keeps this rank's piece along
``dim``, and the local split that is the all-gather's backward. Bytes follow [Note: byte
accounting] in comm.py: for a full tensor of ``B`` bytes over ``n`` ranks, an all-gather or
a reduce-scatter moves ``(n - 1) B / n`` per rank, an all-reduce twice that.
"""

from __future__ import annotations

import torch

from shardwise.distributed import comm

__all__ = ["all_gather_dim", "reduce_scatter_dim", "split_dim", "all_reduce_sum",
           "all_reduce_max"]


def all_gather_dim(x: torch.Tensor, dim: int, group, *, label: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order (a new tensor).

    Args:
        x: this rank's piece (same shape on every rank).
        dim: the dimension to concatenate along.
        group: the process group.
        label: the collective's label (see comm.py).
    """
    n = comm.group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out.view(-1), x.view(-1), group, label=label)
    dim = dim % x.dim()
    if dim == 0:
        return out.view(n * x.shape[0], *x.shape[1:])
    return torch.cat(out.unbind(0), dim=dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group, *, label: str) -> torch.Tensor:
    """``x`` summed over the ranks of ``group``, this rank's piece along ``dim`` kept.

    Raises:
        ValueError: when ``x.shape[dim]`` is not divisible by the group size.
    """
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"{label}: dimension {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the group size {n}")
    pieces = torch.stack(x.chunk(n, dim=dim))  # (n, ...) rank-major
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out.view(-1), pieces.view(-1), group, label=label)
    return out


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (no communication; a contiguous copy)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=dim)[comm.group_rank(group)].contiguous()


def all_reduce_sum(x: torch.Tensor, group, *, label: str) -> torch.Tensor:
    """``x`` summed over ``group`` (a new tensor; ``x`` is left alone)."""
    if comm.group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, group, label=label)
    return out


def all_reduce_max(x: torch.Tensor, group, *, label: str) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``group``, in place; returns ``x``."""
    if comm.group_size(group) > 1:
        comm.all_reduce(x, group, label=label, op=torch.distributed.ReduceOp.MAX)
    return x
