"""The gradient side of a unit: pack full gradients, reduce-scatter them (optionally
quantised), average, and hand each sharded parameter its ``.grad``.

:class:`GradientReduction` is composed into a :class:`~shardwise.shard.unit.Unit`: it is
given the parameters, layout, groups, dtypes and buffers it works on, and reads nothing else
of the unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from shardwise.distributed import comm
from shardwise.distributed.mesh import ShardGroups
from shardwise.distributed.pool import POOL
from shardwise.distributed.comm.quantized import reduce_scatter_quantized
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.layout import UnitLayout
from shardwise.shard.memory import MemoryTracker
from shardwise.shard.param import ShardedParam
from shardwise.shard.streams import CommStreams
from shardwise.sizes import nbytes

__all__ = ["GradientReduction"]

_CHUNK_CAT = hasattr(torch, "_chunk_cat")  # torch >= 2.4


class GradientReduction:
    """One unit's gradient reduction (see the module docstring).

    Args:
        label: the unit's name, for collective labels.
        layout: the unit's flat layout (trainable parameters first).
        params: the unit's trainable parameters, in layout order.
        groups: the unit's process groups.
        dtype: the parameters' (and gradients') dtype.
        compute_dtype: the gathered parameters' dtype (their gradients come in it).
        reduce_dtype: the dtype the reduction sums in.
        device: where the buffers live.
        quant: quantised gradient communication, if any.
        streams: where collectives run ([Note: CUDA streams]).
        tracker: where buffer bytes are reported.
    """

    def __init__(self, label: str, layout: UnitLayout, params: Sequence[ShardedParam],
                 groups: ShardGroups, dtype: torch.dtype, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, quant: CommQuant,
                 streams: CommStreams, tracker: MemoryTracker) -> None:
        self.label, self.layout, self.params, self.groups = label, layout, params, groups
        self.dtype, self.compute_dtype, self.reduce_dtype = dtype, compute_dtype, reduce_dtype
        self.device, self.quant, self.streams, self.tracker = device, quant, streams, tracker
        self.grad_buf: torch.Tensor | None = None
        self.work = None
        self.inp: torch.Tensor | None = None       # the packed input (rank-major)
        self.out: torch.Tensor | None = None       # this rank's summed rows
        self.scratch: torch.Tensor | None = None   # [Note: reduce-scatter on Gloo]
        self.direct = False  # the output is the gradient buffer itself (nothing to add)

    @property
    def packed(self) -> bool:
        """Whether gradients are packed and not yet reduced."""
        return self.inp is not None

    def pack(self) -> None:
        """Copy the full gradients into a rank-major reduce-scatter input, then drop them.

        Parameters that received no gradient contribute zeros. The input is a pooled buffer
        filled in one ``torch._chunk_cat`` (chunk, pad, cast and concatenate: no temporary),
        as FSDP2 packs its reduce-scatter input.
        """
        lay, n = self.layout, self.layout.world
        if not self.params:
            return
        self.inp = POOL.take(n * lay.grad_numel, self.reduce_dtype, self.device)
        packed = self.inp.view(n, lay.grad_numel)
        grads = [sp.full_grad(self.compute_dtype, self.device) for sp in self.params]
        if _CHUNK_CAT:
            torch._chunk_cat(grads, dim=0, num_chunks=n, out=packed)  # casts too
        else:
            for g, sp in zip(grads, self.params):
                p = sp.layout
                flat = F.pad(g.reshape(-1), (0, n * p.padded_numel - p.numel))
                packed[:, p.offset:p.offset + p.padded_numel].copy_(flat.view(n, -1))
        self.tracker.add("comm", nbytes(self.inp))
        for sp in self.params:
            sp.full.grad = None

    def _ensure_grad_buf(self) -> None:
        if self.grad_buf is None:
            self.grad_buf = torch.empty(self.layout.grad_numel, dtype=self.dtype,
                                        device=self.device)
            self.tracker.add("grads", nbytes(self.grad_buf))
            for sp in self.params:
                sp.grad_view = sp.rows_of(self.grad_buf)

    def launch(self) -> None:
        """Issue the reduce-scatter of the packed gradients (async; on CUDA on the reduce
        stream, [Note: CUDA streams])."""
        if self.inp is None:
            return
        # Direct: nobody holds gradients, so the result can become them without an add.
        self.direct = all(sp.param.grad is None for sp in self.params)
        self._ensure_grad_buf()
        if self.layout.world == 1:  # nothing to scatter (stage 0 as units, one-rank groups)
            self.out = self._output()
            self.out.copy_(self.inp)
            return
        with self.streams.side("reduce"):
            self.out = self._output()
            if not self.quant.grads and comm.reduce_scatter_needs_scratch(self.groups.shard):
                # [Note: reduce-scatter on Gloo]
                self.scratch = POOL.take(self.inp.numel(), self.inp.dtype, self.device)
                self.tracker.add("comm", nbytes(self.scratch))
            label = f"{self.label}.reduce_scatter"
            if self.quant.grads:  # quantised pieces exchanged, summed in fp32 (no re-quantising)
                self.work = reduce_scatter_quantized(
                    self.out, self.inp, self.groups.shard, self.quant.grads,
                    self.quant.block_size, label=label, async_op=True)
            else:
                self.work = comm.reduce_scatter_tensor(
                    self.out, self.inp, self.groups.shard, label=label, async_op=True,
                    scratch=self.scratch)

    def _output(self) -> torch.Tensor:
        if self.direct and self.reduce_dtype == self.dtype:
            return self.grad_buf
        out = POOL.take(self.layout.grad_numel, self.reduce_dtype, self.device)
        self.tracker.add("comm", nbytes(out))
        return out

    def finish(self) -> bool:
        """Wait for the reduction, average, and expose the result as the shards' ``.grad``.

        Returns:
            Whether a reduction finished (False: nothing was packed).
        """
        if self.inp is None:
            return False
        if self.work is not None:
            self.work.wait()
        out = self.out
        if self.groups.replicate is not None:
            comm.all_reduce(out, self.groups.replicate, label=f"{self.label}.all_reduce")
        out.div_(self.groups.grad_divisor)  # [Note: expert placement]
        staged_out = None
        if out is not self.grad_buf:
            if self.direct:
                self.grad_buf.copy_(out)
            else:
                for sp in self.params:
                    v = sp.rows_of(out)
                    if sp.param.grad is None:
                        sp.param.grad = v.to(self.dtype, copy=True)
                    else:
                        sp.param.grad.add_(v)
            staged_out = out
        if self.direct:
            for sp in self.params:
                sp.param.grad = sp.grad_view
        self.tracker.sub("comm", nbytes(self.inp) + nbytes(self.scratch) + nbytes(staged_out))
        # [Note: buffer pool] / [Note: CUDA streams]: the collective has completed and its
        # results are consumed (queued on the compute stream).
        # One rank: the packing and the copy ran on the compute stream only.
        self.streams.release("reduce", self.inp, self.scratch, staged_out, self.work,
                             on_side=self.layout.world > 1)
        self.scratch = None
        self.work, self.inp, self.out = None, None, None
        return True
