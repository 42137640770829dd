"""Stage 0: plain data parallelism, the baseline every ZeRO stage is measured against.

Every rank holds the whole model. Gradients are packed into buckets (about ``bucket_mb`` each,
in reverse registration order, which is roughly the order backward produces them) and each
bucket is all-reduced asynchronously as soon as all of its gradients exist, overlapping the
rest of backward. Launch order is fixed ([Note: ordered reductions]). After the reduction
each parameter's ``.grad`` is a view into its bucket, so the next step accumulates in place
and no copy-out is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.mesh import ShardGroups
from shardwise.shard.engine_state import ParamRows, ZeroPolicy
from shardwise.shard.hooks import OrderedLauncher, queue_end_of_backward, register_output_hooks
from shardwise.shard.memory import MemoryTracker
from shardwise.shard.param import ParamEntry
from shardwise.sizes import nbytes

__all__ = ["Bucket", "ReplicateState"]


class Bucket:
    """Gradients of a few parameters reduced by one all-reduce."""

    def __init__(self, index: int, params: list[nn.Parameter], groups: ShardGroups,
                 tracker: MemoryTracker) -> None:
        self.index, self.params, self.groups = index, params, groups
        numel = sum(p.numel() for p in params)
        self.buf = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        tracker.add("grads", nbytes(self.buf))
        self.views, off = [], 0
        for p in params:
            self.views.append(self.buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.pending = len(params)
        self.work = None

    def pack(self) -> None:
        """Bring every gradient into the bucket (zeros for parameters that got none)."""
        grads = [p.grad for p in self.params]
        if all(g is not None and g.data_ptr() != v.data_ptr() for g, v in zip(grads, self.views)):
            torch.cat([g.reshape(-1) for g in grads], out=self.buf)
            return
        for g, v in zip(grads, self.views):
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)

    def launch_reduce(self) -> None:
        self.work = comm.all_reduce(self.buf, self.groups.shard, async_op=True,
                                    label=f"bucket{self.index}.all_reduce")

    def finish_reduce(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.groups.replicate is not None:
            comm.all_reduce(self.buf, self.groups.replicate,
                            label=f"bucket{self.index}.all_reduce_replicate")
        self.buf.div_(self.groups.grad_divisor)  # [Note: expert placement]
        for p, v in zip(self.params, self.views):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                p.grad = v


class ReplicateState:
    """Hooks and buckets of one ``replicate`` (``shard(..., stage=0)``) call; an
    :class:`~shardwise.shard.engine_state.EngineState` whose parameters stay whole.

    Args:
        module: the module replicated.
        entries: its parameters and their names.
        groups: its data-parallel groups.
        bucket_mb: bucket size in MiB.
        tracker: its memory accounting.
        groups_of: the groups of each parameter (by ``id``) whose gradient is reduced over
            other ranks than ``groups`` (experts: their ``edp`` axis); default: none.
        after_reduce: callbacks after every reduction ([Note: partial gradients]).
    """

    def __init__(self, module: nn.Module, entries: list[ParamEntry], groups: ShardGroups,
                 bucket_mb: float, tracker: MemoryTracker,
                 groups_of: dict[int, ShardGroups] | None = None,
                 after_reduce: list[Callable[[], None]] | None = None) -> None:
        self.module, self.groups, self.tracker = module, groups, tracker
        self.entries = entries
        self.policy = ZeroPolicy.from_stage(0)
        self.offload = None  # offload needs sharded masters (stages 1-3)
        self.after_reduce = list(after_reduce or [])
        self._groups_of = groups_of or {}
        self.units: list = []
        self.sync = True
        self.paused = False  # controls.paused_backward_hooks
        self.reshard_after_forward = self.reshard_after_backward = False  # nothing gathered
        self.meshes: dict = {}  # state_dict's DTensor meshes
        params = [e.param for e in entries]
        self.launcher = OrderedLauncher(max_inflight=1 << 30)
        trainable = [p for p in reversed(params) if p.requires_grad]
        self.buckets = self._build_buckets(trainable, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._backward_started = False
        self._handles = [module.register_forward_hook(self._post_forward)]
        for p in trainable:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        tracker.add("params", sum(nbytes(p) for p in params))

    def _build_buckets(self, params: list[nn.Parameter], bucket_mb: float) -> list[Bucket]:
        # Like DDP, a small first bucket starts communication early in backward.
        caps = [min(1.0, bucket_mb), bucket_mb]
        groups, cur, size = [], [], 0

        def group_of(p: nn.Parameter) -> ShardGroups:
            return self._groups_of.get(id(p), self.groups)
        for p in params:
            cap = caps[min(len(groups), 1)] * 2**20
            pbytes = nbytes(p)
            if cur and (size + pbytes > cap or p.dtype != cur[0].dtype
                        or group_of(p) is not group_of(cur[0])):
                groups.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += pbytes
        if cur:
            groups.append(cur)
        return [Bucket(i, g, group_of(g[0]), self.tracker) for i, g in enumerate(groups)]

    def _post_forward(self, module, args, output):
        if torch.is_grad_enabled():
            register_output_hooks(output, self._start_backward)
        return None

    def _start_backward(self) -> None:
        if self._backward_started or self.paused:
            return
        self._backward_started = True
        # Counted per backward pass, not per forward: forwards and backward passes may
        # interleave ([Note: micro-batch passes] in state.py).
        for b in self.buckets:
            b.pending = len(b.params)
        queue_end_of_backward(self._end_backward)
        self.launcher.start(list(self.buckets))

    def _on_grad(self, param: nn.Parameter) -> None:
        self._start_backward()
        b = self._bucket_of[id(param)]
        b.pending -= 1
        if b.pending == 0 and self.sync:
            b.pack()
            self.launcher.mark_ready(b)

    def _end_backward(self) -> None:
        if self.sync:
            for b in self.buckets:
                if b.pending > 0:
                    b.pack()
                    b.pending = 0
                    self.launcher.mark_ready(b)
            self.launcher.flush()
            for fn in self.after_reduce:  # [Note: partial gradients]
                fn()
        self._backward_started = False

    def mark_stale(self) -> None:
        """Nothing is cached at stage 0."""

    def unshard_all(self) -> None:
        """Parameters are whole: nothing to gather."""

    def reshard_all(self) -> None:
        """Parameters are whole: nothing to free."""

    def graph_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters themselves (autograd's leaves)."""
        return [p for b in self.buckets for p in b.params]

    def param_rows(self) -> list[ParamRows]:
        """Every parameter, whole on this rank (no shard group)."""
        return [ParamRows(e.fqns, e.param, 0, e.param.shape[0] if e.param.dim() else 1, None,
                          whole=True) for e in self.entries]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
