"""The runtime of one ``shard(..., stage=1|2|3)`` call: when units gather, compute, free and
reduce.

Per step, for each unit ``u`` (forward order recorded on the fly, see [Note: prefetch order]):

forward pre-hook   gather u (wait), issue the gathers of the next ``prefetch`` units,
                   register u's full parameters in its modules;
forward post-hook  register the sharded parameters again; stage 3 frees u's gathered
                   parameters (except the root unit, which backward needs at once);
                   hooks on u's outputs wait for backward;
pre-backward       (first gradient reaching u's outputs) gather u again, prefetch the units
                   backward reaches next, register the full parameters;
post-backward      (every trainable full parameter of u has its gradient) pack the gradients,
                   free them and u's gathered parameters, mark u ready for reduction
                   ([Note: ordered reductions]);
end of backward    units that saw no gradient contribute zeros, all reductions finish, the
                   sharded parameters get their averaged ``.grad``.

[Note: prefetch order] Forward prefetch follows the order in which units started their
forward in the previous step; backward prefetch follows the reverse of the order in which
they finished it (the order in which backward reaches them). Both are the same on every rank
for the same model code, which keeps the gather sequence identical across ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.distributed.mesh import ShardGroups
from shardwise.shard.hooks import (OrderedLauncher, in_backward, queue_end_of_backward,
                                   register_output_hooks)
from shardwise.shard.memory import MemoryTracker
from shardwise.shard.unit import Unit

__all__ = ["ShardState"]


class ShardState:
    """Hooks and bookkeeping for the units of one sharded module (stages 1 to 3)."""

    def __init__(self, module: nn.Module, units: list[Unit], root: Unit, groups: ShardGroups,
                 stage: int, reshard_after_forward: bool, prefetch: int,
                 tracker: MemoryTracker) -> None:
        self.module, self.units, self.root, self.groups = module, units, root, groups
        self.stage, self.prefetch, self.tracker = stage, prefetch, tracker
        self.reshard_after_forward = reshard_after_forward and stage == 3
        self.sync = True
        self.launcher = OrderedLauncher()
        self.fwd_order: list[Unit] = []       # previous step's pre-forward order
        self.bwd_order: list[Unit] = []       # previous step's reversed post-forward order
        self._pre_order: list[Unit] = []
        self._post_order: list[Unit] = []
        self._backward_started = False
        self._handles = []
        for u in units:
            self._handles.append(u.module.register_forward_pre_hook(
                self._make_pre_forward(u), prepend=True))
            self._handles.append(u.module.register_forward_hook(self._make_post_forward(u)))
            for full in u.full_params[:len(u.trainable)]:
                self._handles.append(full.register_post_accumulate_grad_hook(
                    self._make_on_grad(u)))

    # ---------------------------------------------------------------- forward
    def _make_pre_forward(self, u: Unit):
        def hook(module, args):
            if in_backward():  # activation-checkpoint recompute: u is (being) gathered
                u.unshard()
                u.swap_in()
                return None
            if u is self.root and torch.is_grad_enabled():
                self._begin_forward()
            if torch.is_grad_enabled() and u not in self._pre_order:
                self._pre_order.append(u)
            u.unshard(keep_secondary=self.reshard_after_forward and u is not self.root
                      and torch.is_grad_enabled())
            self._prefetch(u, self.fwd_order, forward=True)
            u.swap_in()
            return None
        return hook

    def _make_post_forward(self, u: Unit):
        def hook(module, args, output):
            if in_backward():
                return None
            u.swap_out()
            if torch.is_grad_enabled():
                if u in self._post_order:
                    self._post_order.remove(u)
                self._post_order.append(u)
                register_output_hooks(output, lambda: self._pre_backward(u))
                if self.reshard_after_forward and u is not self.root:
                    u.reshard()
            elif self.stage == 3:
                u.reshard()
            return None
        return hook

    def _begin_forward(self) -> None:
        if self._pre_order:
            self.fwd_order = self._pre_order
        self._pre_order, self._post_order = [], []
        for u in self.units:
            u.pending = len(u.trainable)
            u.backward_done = False

    def _prefetch(self, u: Unit, order: list[Unit], forward: bool) -> None:
        if not self.prefetch or u not in order:
            return
        i = order.index(u)
        for nxt in order[i + 1:i + 1 + self.prefetch]:
            nxt.gather_async()

    # ---------------------------------------------------------------- backward
    def _start_backward(self) -> None:
        self._backward_started = True
        queue_end_of_backward(self._end_backward)
        self.bwd_order = list(reversed(self._post_order))
        order = list(reversed(self._pre_order))
        order += [u for u in reversed(self.units) if u not in order]
        self.launcher.start([u for u in order if u.trainable])

    def _pre_backward(self, u: Unit) -> None:
        if not self._backward_started:
            self._start_backward()
        if u.backward_done:
            return
        u.unshard()
        self._prefetch(u, self.bwd_order, forward=False)
        u.swap_in()

    def _make_on_grad(self, u: Unit):
        def hook(param):
            if not self._backward_started:
                self._start_backward()
            u.pending -= 1
            if u.pending == 0:
                self._post_backward(u)
        return hook

    def _post_backward(self, u: Unit) -> None:
        if u.backward_done:
            return
        u.backward_done = True
        u.swap_out()
        if self.stage == 3:
            u.reshard()
        if self.sync and u.trainable:
            u.pack_grads()
            self.launcher.mark_ready(u)

    def _end_backward(self) -> None:
        for u in self.launcher.order:
            self._post_backward(u)
        if self.sync:
            self.launcher.flush()
        else:
            self.launcher.order = []
        for u in self.units:
            u.backward_done = True
            u.swap_out()
            u.drop_secondary()
            if self.stage == 3:
                u.reshard()
        self._backward_started = False

    # ---------------------------------------------------------------- misc
    def mark_stale(self) -> None:
        """Parameters changed outside the optimizer step path: re-gather before next use."""
        for u in self.units:
            u.stale = True
            if self.stage == 3:
                u.reshard()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
