"""The gradient side of a unit: pack full gradients, reduce-scatter them (optionally
quantised), average, and hand each sharded parameter its ``.grad``.

Mixed into :class:`~shardwise.shard.unit.Unit`, which provides the layout, buffers, groups
and dtypes this code reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.distributed import comm
from shardwise.distributed.quant_comm import reduce_scatter_quantized
from shardwise.distributed.pool import POOL
from shardwise.sizes import nbytes

__all__ = ["GradientReducer"]

_CHUNK_CAT = hasattr(torch, "_chunk_cat")  # torch >= 2.4


class GradientReducer:
    """Gradient reduction of one unit (see the module docstring)."""

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        r = self.groups.shard_rank
        return [flat[p.offset:p.offset + p.local_rows(r) * p.row_numel].view(p.local_shape(r))
                for p in self.layout.params[:len(self.trainable)]]

    def pack_grads(self) -> None:
        """Copy the full gradients into a rank-major reduce-scatter input, then drop them.

        Parameters that received no gradient contribute zeros. The input is a pooled buffer
        filled in one ``torch._chunk_cat`` (chunk, pad, cast and concatenate: no temporary),
        as FSDP2 packs its reduce-scatter input.
        """
        lay, n = self.layout, self.layout.world
        if not self.trainable:
            return
        self.reduce_in = POOL.take(n * lay.grad_numel, self.reduce_dtype, self.device)
        packed = self.reduce_in.view(n, lay.grad_numel)
        grads = []
        for full, p in zip(self.full_params, lay.params[:len(self.trainable)]):
            g = full.grad
            if g is None:  # zeros without allocating them
                g = torch.zeros((), dtype=self.compute_dtype, device=self.device).expand(p.shape)
            grads.append(g.reshape(1) if g.dim() == 0 else g)
        if _CHUNK_CAT:
            torch._chunk_cat(grads, dim=0, num_chunks=n, out=packed)  # casts too
        else:
            for g, p in zip(grads, lay.params):
                flat = F.pad(g.reshape(-1), (0, n * p.padded_numel - p.numel))
                packed[:, p.offset:p.offset + p.padded_numel].copy_(flat.view(n, -1))
        self.tracker.add("comm", nbytes(self.reduce_in))
        for full in self.full_params[:len(self.trainable)]:
            full.grad = None

    def _ensure_grad_buf(self) -> None:
        if self.grad_buf is None:
            self.grad_buf = torch.empty(self.layout.grad_numel, dtype=self.dtype,
                                        device=self.device)
            self.tracker.add("grads", nbytes(self.grad_buf))
            self.grad_views = self._views_of(self.grad_buf)

    def launch_reduce(self) -> None:
        """Issue the reduce-scatter of the packed gradients (async; on CUDA on the reduce
        stream, [Note: CUDA streams])."""
        if self.reduce_in is None:
            return
        # Direct: nobody holds gradients, so the result can become them without an add.
        self._direct = all(e.param.grad is None for e in self.trainable)
        self._ensure_grad_buf()
        if self.layout.world == 1:  # nothing to scatter (stage 0 as units, one-rank groups)
            self.reduce_out = self._reduce_output()
            self.reduce_out.copy_(self.reduce_in)
            return
        with self.streams.side("reduce"):
            self.reduce_out = self._reduce_output()
            if not self.quant.grads and comm.reduce_scatter_needs_scratch(self.groups.shard):
                # [Note: reduce-scatter on Gloo]
                self.reduce_scratch = POOL.take(self.reduce_in.numel(), self.reduce_in.dtype,
                                                self.device)
                self.tracker.add("comm", nbytes(self.reduce_scratch))
            label = f"{self.label}.reduce_scatter"
            if self.quant.grads:  # quantised pieces exchanged, summed in fp32 (no re-quantising)
                self.reduce_work = reduce_scatter_quantized(
                    self.reduce_out, self.reduce_in, self.groups.shard, self.quant.grads,
                    self.quant.block_size, label=label, async_op=True)
            else:
                self.reduce_work = comm.reduce_scatter_tensor(
                    self.reduce_out, self.reduce_in, self.groups.shard, label=label,
                    async_op=True, scratch=self.reduce_scratch)

    def _reduce_output(self) -> torch.Tensor:
        if self._direct and self.reduce_dtype == self.dtype:
            return self.grad_buf
        out = POOL.take(self.layout.grad_numel, self.reduce_dtype, self.device)
        self.tracker.add("comm", nbytes(out))
        return out

    def finish_reduce(self) -> None:
        """Wait for the reduction, average, and expose the result as the shards' ``.grad``."""
        if self.reduce_in is None:
            return
        if self.reduce_work is not None:
            self.reduce_work.wait()
        out = self.reduce_out
        if self.groups.replicate is not None:
            comm.all_reduce(out, self.groups.replicate, label=f"{self.label}.all_reduce")
        out.div_(self.groups.grad_divisor)  # [Note: expert placement]
        staged_out = None
        if out is not self.grad_buf:
            if self._direct:
                self.grad_buf.copy_(out)
            else:
                for e, v in zip(self.trainable, self._views_of(out)):
                    if e.param.grad is None:
                        e.param.grad = v.to(self.dtype, copy=True)
                    else:
                        e.param.grad.add_(v)
            staged_out = out
        if self._direct:
            for e, v in zip(self.trainable, self.grad_views):
                e.param.grad = v
        self.tracker.sub("comm", nbytes(self.reduce_in) + nbytes(self.reduce_scratch)
                         + nbytes(staged_out))
        # [Note: buffer pool] / [Note: CUDA streams]: the collective has completed and its
        # results are consumed (queued on the compute stream).
        self.streams.release("reduce", self.reduce_in, self.reduce_scratch, staged_out,
                             self.reduce_work)
        self.reduce_scratch = None
        self.reduce_work, self.reduce_in, self.reduce_out = None, None, None
        self.stale = True
