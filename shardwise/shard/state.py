"""The runtime of one ``shard(..., stage=1|2|3)`` call: when units gather, compute, free and
reduce.

Per step, for each unit ``u`` (forward order recorded on the fly, see [Note: prefetch order]):

forward pre-hook   gather u (wait), issue the gathers of the next ``prefetch`` units that
                   have not run in this forward yet, register u's full parameters in its
                   modules;
forward post-hook  register the sharded parameters again; stage 3 frees u's gathered
                   parameters (except the root unit, which backward needs at once);
                   hooks on u's outputs wait for backward. The root's post-hook ends the
                   forward pass ([Note: prefetch safety]);
pre-backward       (first gradient reaching u's outputs) gather u again, prefetch the units
                   backward reaches next, register the full parameters;
post-backward      (every trainable full parameter of u has its gradient) pack the gradients,
                   free them and u's gathered parameters, mark u ready for reduction
                   ([Note: ordered reductions]);
end of backward    units that saw no gradient contribute zeros, all reductions finish, gathers
                   still in flight are completed and discarded, the sharded parameters get
                   their averaged ``.grad``.

A skippable unit this rank's data did not run is run *virtually* (its gathers, prefetches,
place in the orders and zero reduction, without compute) where it would have run, so every
rank issues the same collectives ([Note: skipped units] in skippable.py).

[Note: stage 1 vs 2] Both keep each rank's gradient shard after the step and reduce-scatter
the rest away. Stage 2 reduces a unit as soon as backward is done with it (overlapping
communication with the rest of backward, freeing its whole gradients at once); stage 1, as
DeepSpeed's ZeRO-1, reduces every unit once backward has finished, so whole gradients live
until then. Neither keeps whole gradients between steps (keeping them zeroed, stage 1
peaked above DeepSpeed's ZeRO-1: docs/engine.md, "Measurements behind the notes").

[Note: prefetch order] Forward prefetch follows the order in which units started their
forward in the previous step; backward prefetch follows the reverse of the order in which
they finished it in this step (the order in which backward is expected to reach them). Both
are the same on every rank for the same model code, which keeps the gather sequence
identical across ranks; [Note: gather identity] in identity.py checks it on every gather.

[Note: prefetch safety] A prefetch is a bet that a unit will compute soon. Two rules keep a
lost bet from changing any number:

* only units that can still compute in the current pass are prefetched: in forward, units
  that have not run yet in it; in backward, units that ran forward in this step and whose
  backward has not begun (so a unit is never gathered again after its backward, however
  many of its outputs' gradients arrive later -- the root's outputs typically receive
  gradients throughout backward);
* a gather still in flight when its pass ends (a prefetched unit that did not run: a skipped
  branch, an order that changed) is completed and discarded at the end of the forward pass
  (the root's post-hook) and of backward, so no gather survives into an optimizer step.

Behind both, a unit uses gathered data only if the shards have not changed since it was
gathered ([Note: unit gather state] in unit.py). The bug these rules close: the root's
later output gradients re-issued the prefetch of a unit whose backward had finished; that
gather, still in flight at the end of backward, survived the optimizer step and the next
forward used the pre-step weights of that unit on every rank (issue 15).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.distributed.compiled import refuse_in_compiled_region
from shardwise.distributed.mesh import ShardGroups
from shardwise.shard.hooks import (OrderedLauncher, in_backward, queue_end_of_backward,
                                   register_output_hooks, tensors_in)
from shardwise.shard.engine_state import ParamRows, ZeroPolicy
from shardwise.shard.memory import MemoryTracker
from shardwise.shard.offload.config import Offload
from shardwise.shard.skippable import SkipPlan
from shardwise.shard.unit import Phase, Unit

__all__ = ["ShardState"]


class ShardState:
    """Hooks and bookkeeping for the units of one sharded module (stages 1 to 3, and stage 0
    with a compute dtype); an :class:`~shardwise.shard.engine_state.EngineState`.

    Args:
        module: the module passed to ``shard``.
        units: its units, the root first.
        groups: its data-parallel groups.
        policy: what it shards.
        reshard_after_forward: free gathered parameters after forward (with
            ``policy.shard_params``).
        prefetch: units gathered ahead of use.
        tracker: its memory accounting.
        offload: the offload policy of its optimizer state, if any.
        after_reduce: callbacks after every reduction ([Note: partial gradients]).
        skippable: the modules some ranks may not run ([Note: skipped units] in
            skippable.py); default: none.
    """

    def __init__(self, module: nn.Module, units: list[Unit], groups: ShardGroups,
                 policy: ZeroPolicy, reshard_after_forward: bool, prefetch: int,
                 tracker: MemoryTracker, offload: Offload | None = None,
                 after_reduce: list[Callable[[], None]] | None = None,
                 skippable: list[nn.Module] | None = None) -> None:
        self.module, self.units, self.root, self.groups = module, units, units[0], groups
        self.policy, self.prefetch, self.tracker = policy, prefetch, tracker
        self.offload, self.after_reduce = offload, list(after_reduce or [])
        self.reshard_after_forward = reshard_after_forward and policy.shard_params
        # [Note: per-micro-batch controls]
        self.reshard_after_backward = policy.shard_params
        self.sync = True
        self.paused = False  # controls.paused_backward_hooks
        self.meshes: dict = {}  # state_dict's DTensor meshes
        self.launcher = OrderedLauncher()
        self.fwd_order: list[Unit] = []       # previous step's pre-forward order
        self.bwd_order: list[Unit] = []       # this step's reversed post-forward order
        self._pre_order: list[Unit] = []
        self._post_order: list[Unit] = []
        self._seen: set[int] = set()          # units run in the current forward pass
        self.skips = SkipPlan(module, units, skippable or [])  # [Note: skipped units]
        self._virtual: set[int] = set()       # units run virtually in the latest forward
        self._bwd_virtual: list[Unit] = []    # ... expected in this backward
        self._bwd_index: dict[int, int] = {}
        self._in_forward = False              # between the root's pre- and post-hooks
        self._backward_started = False
        self._handles = []
        for u in units:
            self._handles.append(u.module.register_forward_pre_hook(
                self._make_pre_forward(u), prepend=True))
            self._handles.append(u.module.register_forward_hook(self._make_post_forward(u)))
            if u is self.root:  # runs even when the forward raises: modules get shards back
                self._handles.append(u.module.register_forward_hook(
                    self._finish_forward, always_call=True))
            for sp in u.trainable:
                self._handles.append(sp.full.register_post_accumulate_grad_hook(
                    self._make_on_grad(u)))

    # ---------------------------------------------------------------- forward
    def _make_pre_forward(self, u: Unit):
        def hook(module, args):
            # [Note: collectives outside compiled regions]: the hooks below gather.
            refuse_in_compiled_region(f"the sharding hooks of unit {u.label!r}")
            if in_backward():  # activation-checkpoint recompute: u is (being) gathered
                u.unshard()
                u.swap_in()
                return None
            grad = torch.is_grad_enabled()
            if u is self.root:
                self._begin_forward(grad)
                for other in self.units:  # [Note: ungathered placeholders]
                    if other is not u:
                        other.swap_out(placeholders=True)
                self._in_forward = True
            elif self._in_forward and self.skips:  # [Note: skipped units]
                self.skips.check_forward(u, self._seen)
                self._run_virtual(self.skips.due_before(u, self._seen), grad)
            self._enter(u, grad)
            u.swap_in()
            return None
        return hook

    def _enter(self, u: Unit, grad: bool) -> None:
        """A unit's forward begins (really or virtually): gather it, prefetch the next."""
        self._seen.add(id(u))
        if grad:
            if u not in self._pre_order:
                self._pre_order.append(u)
            u.phase = Phase.FORWARD
        u.unshard(keep_secondary=self.reshard_after_forward and u is not self.root and grad)
        self._prefetch(u, self.fwd_order, lambda v: id(v) not in self._seen)

    def _make_post_forward(self, u: Unit):
        def hook(module, args, output):
            if in_backward():
                return None
            grad = torch.is_grad_enabled()
            if u is self.root and self._in_forward and self.skips:  # [Note: skipped units]
                self._run_virtual(self.skips.due_at_end(self._seen), grad)
            u.swap_out(placeholders=self._in_forward and u is not self.root)
            self._leave(u, output, grad)
            return None
        return hook

    def _leave(self, u: Unit, output, grad: bool) -> None:
        """A unit's forward ended (really, with ``output``, or virtually: None)."""
        if grad:
            if u in self._post_order:
                self._post_order.remove(u)
            self._post_order.append(u)
            u.phase = Phase.FORWARD_DONE
            if output is not None:
                register_output_hooks(output, lambda: self._pre_backward(u))
            if self.reshard_after_forward and u is not self.root and not (
                    self.skips.kept(u) and output is not None
                    and any(t.requires_grad for t in tensors_in(output))):
                u.reshard()  # [Note: skipped units]: kept for its backward
        elif self.policy.shard_params:
            u.reshard()

    def _run_virtual(self, todo: list[Unit], grad: bool) -> None:
        """[Note: skipped units]: the engine side of calls this rank's data skipped."""
        for is_pre, v in self.skips.nested(todo):
            if is_pre:
                self._enter(v, grad)
            else:
                self._leave(v, None, grad)
                if grad:
                    self._virtual.add(id(v))

    def _finish_forward(self, module, args, output) -> None:
        """The root's forward ended (returned or raised): shards back in every module, and
        gathers of prefetched units that did not run are discarded."""
        if in_backward():
            return
        self._in_forward = False
        for u in self.units:
            u.swap_out()
        self._end_forward()

    def _begin_forward(self, grad: bool) -> None:
        self._seen = set()
        if not grad:
            return
        # [Note: step identity]: which step and micro-batch this forward's gathers belong to
        self.root.tag.count.forward(sum(u.shard_version() for u in self.units))
        if self._pre_order:
            self.fwd_order = self._pre_order
        self._pre_order, self._post_order, self._virtual = [], [], set()

    def _end_forward(self) -> None:
        """[Note: prefetch safety]: discard gathers of prefetched units that did not run."""
        for u in self.units:
            if u is not self.root and id(u) not in self._seen:
                if self.policy.shard_params:
                    u.reshard()
                else:
                    u._drain()
        self._settle()

    def _settle(self) -> None:
        """[Note: held buffers are bounded]: no staging buffer outlives its pass."""
        for streams in {id(u.streams): u.streams for u in self.units}.values():
            streams.settle()

    def _prefetch(self, u: Unit, order: list[Unit], eligible) -> None:
        """Issue the gathers of the next ``prefetch`` eligible units after ``u`` in ``order``."""
        if not self.prefetch or u not in order:
            return
        left = self.prefetch
        for nxt in order[order.index(u) + 1:]:
            if left == 0:
                break
            if eligible(nxt):
                nxt.gather_async()
                left -= 1

    # ---------------------------------------------------------------- backward
    def _start_backward(self) -> None:
        self._backward_started = True
        queue_end_of_backward(self._end_backward)
        self.bwd_order = list(reversed(self._post_order))
        # [Note: skipped units]: a frozen skippable unit has no backward on any rank
        expected = {id(u) for u in self.bwd_order if not self.skips.no_backward(u)}
        self._bwd_virtual = [u for u in self.bwd_order
                             if id(u) in expected and self.skips.skippable(u)]
        self._bwd_index = {id(u): i for i, u in enumerate(self.bwd_order)}
        for u in self.units:  # [Note: micro-batch passes]
            u.pending = len(u.trainable)
            u.phase = Phase.FORWARD_DONE if id(u) in expected else Phase.IDLE
        order = list(reversed(self._pre_order))
        order += [u for u in reversed(self.units) if u not in order]
        self.launcher.start([u for u in order if u.trainable])

    def _pre_backward(self, u: Unit) -> None:
        if self.paused:
            return
        if not self._backward_started:
            self._start_backward()
        if self.skips.kept(u):  # gathered since its forward ([Note: skipped units])
            assert u.gathered or not u.params, u.label
            u.swap_in()
            if u.phase is Phase.FORWARD_DONE:
                u.phase = Phase.BACKWARD
            return
        if u.phase in (Phase.BACKWARD, Phase.BACKWARD_DONE):
            return  # gathered already, or done: another of its outputs' gradients arrived
        if self._bwd_virtual:
            self._virtual_backward(u)
        u.phase = Phase.BACKWARD
        u.unshard()
        self._prefetch(u, self.bwd_order, self._bwd_eligible)
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
        if u.phase is Phase.BACKWARD_DONE:
            return
        u.phase = Phase.BACKWARD_DONE
        u.swap_out()
        if self.policy.shard_params and self.reshard_after_backward:
            u.reshard()
        if self.sync and u.trainable and not self.policy.reduce_at_end:
            u.pack_grads()
            self.launcher.mark_ready(u)

    def _virtual_backward(self, upto: Unit | None) -> None:
        """[Note: skipped units]: before ``upto``'s backward gather (None: at the end of
        backward), the backward of virtually run units before it in the backward order;
        at the end also of skippable units that ran but saw no gradient, as a rank that
        skipped them does. A skippable unit's real backward after a later unit's begun
        raises: a skipping rank would have gathered them the other way round."""
        at = self._bwd_index.get(id(upto), -1) if upto is not None else len(self.bwd_order)
        if at >= 0 and upto is not None:
            self.skips.check_backward(upto, self.bwd_order[at + 1:])
        for v in self._bwd_virtual:
            if self._bwd_index[id(v)] >= at:
                break
            if v.phase is Phase.FORWARD_DONE and (upto is None or id(v) in self._virtual):
                v.phase = Phase.BACKWARD
                if not self.skips.kept(v):
                    v.unshard()
                    self._prefetch(v, self.bwd_order, self._bwd_eligible)
                self._post_backward(v)

    def _bwd_eligible(self, v: Unit) -> bool:
        """A unit backward may still gather ([Note: prefetch safety], [Note: skipped units])."""
        return v.phase is Phase.FORWARD_DONE and not self.skips.kept(v)

    def _end_backward(self) -> None:
        if self._bwd_virtual:
            self._virtual_backward(None)
        for u in self.launcher.order:
            self._post_backward(u)
        if self.sync and self.policy.reduce_at_end:  # [Note: stage 1 vs 2]
            for u in self.launcher.order:
                u.pack_grads()
                self.launcher.mark_ready(u)
        if self.sync:
            self.launcher.flush()
            for fn in self.after_reduce:  # [Note: partial gradients]
                fn()
        else:
            self.launcher.order = []
        for u in self.units:
            u.phase = Phase.BACKWARD_DONE
            u.swap_out()
            if self.policy.shard_params and self.reshard_after_backward:
                u.reshard()  # completes and discards a gather still in flight
            else:
                u._drain()
            u.drop_secondary()  # after the drain: a gather in flight may read it
        self._settle()
        self._backward_started = False

    # ---------------------------------------------------------------- misc
    def mark_stale(self) -> None:
        """Parameters changed outside the optimizer step path: re-gather before next use."""
        for u in self.units:
            u.stale = True
            if self.policy.shard_params:
                u.reshard()

    def unshard_all(self) -> None:
        """Gather every unit now (all gathers issued first, in unit order, then waited)."""
        for u in self.units:
            u.gather_async()
        for u in self.units:
            u.unshard()

    def reshard_all(self) -> None:
        """Free every unit's gathered parameters (stage 3; stages 1/2 keep them by design)."""
        if self.policy.shard_params:
            for u in self.units:
                u.reshard()

    def graph_parameters(self) -> list[nn.Parameter]:
        """The gathered parameters of every trainable parameter: what autograd graphs hold."""
        return [sp.full for u in self.units for sp in u.trainable]

    def param_rows(self) -> list[ParamRows]:
        """Every parameter's rows on this rank (a unit's own groups: experts shard over
        ``edp``)."""
        out = []
        for u in self.units:
            r = u.groups.shard_rank
            out.extend(ParamRows(sp.fqns, sp.param, sp.layout.row_offset(r),
                                 sp.layout.local_rows(r), u.groups.shard) for sp in u.params)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
