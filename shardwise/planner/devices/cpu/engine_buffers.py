"""The ZeRO engine's gathered parameters and staging buffers over one step on CPU ranks,
replayed: the peak that ``memory_report().peak_transient_bytes`` reports.

    bufs = [unit_buffers(shapes, world=2, compute_bytes=4, param_bytes=4, gloo=True)
            for shapes in spec.unit_shapes()]
    unsharded, comm = replay_peak(bufs, zero=3)   # bytes at the transient peak

[Note: buffer replay] Which buffers are alive together is decided by the engine's schedule
(shard/state.py), not by any one unit: at stage 3 the peak typically falls in backward,
when a unit's reduction is launched while the ``max_inflight`` reductions before it still
hold their packed gradients (and, on Gloo, the full-size reduce-scatter scratch:
[Note: reduce-scatter on Gloo] in comm.py) and the next unit is being gathered; at stages
1 and 2 every unit is gathered beside those reductions. A per-unit formula misses both.
So the planner replays the schedule instead: the units in
forward order (root first, as its pre-forward hook runs first), the gathers, prefetches
and frees of forward, then backward in reverse (root, last block, ..., first block, each
unit's gather and the prefetch of the next, its free and its gradient packing, reductions
launched in the launcher's order, root last, and completed oldest first once more than
``OrderedLauncher.max_inflight`` are outstanding), counting bytes as ``MemoryTracker``
does. Buffer sizes are the engine's: ``build_layout`` (shard and gradient rows, padding),
``TAG_BYTES`` trailers on the wire, the compute and reduce dtypes.

This is the engine's CPU path: pooled buffers go back to the pool as soon as their
collective completes (``CommStreams.release``). On CUDA they are held until the side
stream's next use, which this replay does not model, so GPU devices keep the per-unit
formula of rank_memory.py. ``tests/test_planner_engine_buffers.py`` checks the replay
against ``memory_report`` on real Gloo ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.rank_memory import TAG_BYTES, unit_state
from shardwise.shard.hooks import OrderedLauncher

__all__ = ["UnitBuffers", "unit_buffers", "replay_peak", "shard_calls", "rank_transient",
           "MAX_INFLIGHT"]

MAX_INFLIGHT = OrderedLauncher().max_inflight
"""Reductions the engine keeps outstanding (the launcher's own default)."""


@dataclass(frozen=True)
class UnitBuffers:
    """Bytes of one unit's buffers on one rank (0 where the unit has none).

    Attributes:
        full: gathered parameters (compute dtype, padded rows of every rank).
        gather: the all-gather's output (every rank's wire row: shard + identity trailer).
        staged: the shard cast to the compute dtype before the gather (mixed precision).
        reduce_in: packed gradients (every rank's gradient rows, reduce dtype).
        scratch: the Gloo reduce-scatter's all-to-all scratch (same size as reduce_in).
        reduce_out: the reduction's own output when the reduce dtype is not the shards'.
    """

    full: int
    gather: int
    staged: int
    reduce_in: int
    scratch: int
    reduce_out: int


def unit_buffers(shapes: tuple[tuple[int, ...], ...], world: int, *, compute_bytes: int,
                 param_bytes: int, reduce_bytes: int | None = None, gloo: bool = True,
                 quant_weights: bool = False, quant_grads: bool = False) -> UnitBuffers:
    """The buffers ``Unit`` allocates for a unit of these parameter shapes (unit.py,
    unit_grads.py), sharded over ``world`` ranks.

    Args:
        shapes: the unit's (trainable) parameter shapes.
        world: ranks of the shard group.
        compute_bytes, param_bytes, reduce_bytes: element sizes of the compute dtype, the
            shards' dtype and the gradient-reduction dtype (default: the compute dtype).
        gloo: the reduce-scatter stages through a scratch buffer (Gloo, more than one rank).
        quant_weights, quant_grads: quantised gathers (decoded into a full-size buffer, no
            cast copy) / reductions (no scratch).
    """
    s = unit_state(tuple(shapes), world)
    if not s.n_params:
        return UnitBuffers(0, 0, 0, 0, 0, 0)
    rb = reduce_bytes or compute_bytes
    wire = s.shard_numel + TAG_BYTES // compute_bytes  # elements of one rank's wire row
    full = s.full_numel * compute_bytes
    if world == 1:
        gather = staged = 0  # a one-rank unit copies its shard into the full buffer
    elif quant_weights:
        gather, staged = full, 0
    else:
        gather = world * wire * compute_bytes
        staged = wire * compute_bytes if compute_bytes != param_bytes else 0
    reduce_in = world * s.shard_numel * rb  # grad_numel == shard_numel (all trainable)
    scratch = reduce_in if gloo and world > 1 and not quant_grads else 0
    reduce_out = s.shard_numel * rb if rb != param_bytes else 0
    return UnitBuffers(full, gather, staged, reduce_in, scratch, reduce_out)


class _Tracker:
    """``MemoryTracker``'s transient arithmetic: the peak of unsharded + comm, and both
    kinds at that moment."""

    def __init__(self) -> None:
        self.unsharded = self.comm = 0
        self.peak = (0, 0)

    def add(self, unsharded: int = 0, comm: int = 0) -> None:
        self.unsharded += unsharded
        self.comm += comm
        if self.unsharded + self.comm > sum(self.peak):
            self.peak = (self.unsharded, self.comm)


def replay_peak(units: list[UnitBuffers], *, zero: int, prefetch: int = 1,
                reshard_after_forward: bool = True, max_inflight: int = MAX_INFLIGHT
                ) -> tuple[int, int]:
    """(unsharded, comm) bytes at the transient peak of a steady-state step
    ([Note: buffer replay]).

    Args:
        units: every unit's buffers, root first, then the blocks in forward order.
        zero: ZeRO stage 1-3 (0: no units, nothing transient).
        prefetch: units gathered ahead of the computing one.
        reshard_after_forward: stage 3 frees a unit's gathered parameters after its
            forward (True) or keeps them until its backward.
        max_inflight: reductions kept outstanding.
    """
    if zero == 0 or not units:
        return 0, 0
    tr = _Tracker()
    gathered = {i for i, u in enumerate(units) if zero < 3 and u.full}
    tr.add(unsharded=sum(units[i].full for i in gathered))  # stages 1/2 keep them
    pending: set[int] = set()  # gathers in flight

    def issue(i: int) -> None:
        if i in pending or (i in gathered and not stale[i]):
            return  # in flight, or gathered and current
        if i not in gathered:
            gathered.add(i)
            tr.add(unsharded=units[i].full)
        pending.add(i)
        stale[i] = False
        tr.add(comm=units[i].staged + units[i].gather)

    def wait(i: int) -> None:
        issue(i)
        if i in pending:
            pending.discard(i)
            tr.add(comm=-(units[i].staged + units[i].gather))

    def free(i: int) -> None:
        if zero == 3 and i in gathered:
            gathered.discard(i)
            tr.add(unsharded=-units[i].full)

    stale = {i: True for i in range(len(units))}  # after the optimizer step
    order = list(range(len(units)))
    _forward(order, prefetch, zero == 3 and reshard_after_forward, issue, wait, free)
    _backward(units, order, prefetch, zero, max_inflight, tr, issue, wait, free)
    return tr.peak


def _forward(order, prefetch, reshard, issue, wait, free) -> None:
    for k, i in enumerate(order):
        wait(i)
        for j in order[k + 1:k + 1 + prefetch]:
            issue(j)
        if reshard and k > 0:  # the root stays gathered for backward
            free(i)


def _backward(units, order, prefetch, zero, max_inflight, tr, issue, wait, free) -> None:
    bwd = [order[0]] + order[:0:-1]  # root, then the blocks from the last
    launch_order = order[:0:-1] + [order[0]]  # blocks from the last, root at the end
    inflight: list[int] = []
    done = []

    def launch(i: int) -> None:
        u = units[i]
        tr.add(comm=u.scratch + u.reduce_out)
        inflight.append(i)
        while len(inflight) > max_inflight:
            o = units[inflight.pop(0)]
            tr.add(comm=-(o.reduce_in + o.scratch + o.reduce_out))

    def finish(i: int) -> None:  # post-backward: free, pack, launch what the order allows
        free(i)
        if units[i].reduce_in:
            if zero == 1:  # [Note: stage 1 vs 2]: everything is packed at the end
                done.append(i)
                return
            tr.add(comm=units[i].reduce_in)
            launch(i)

    for k, i in enumerate(bwd):
        wait(i)
        for j in bwd[k + 1:k + 1 + prefetch]:
            issue(j)
        if i != order[0]:  # the root's embedding gradient arrives last
            finish(i)
    finish(order[0])
    for i in (launch_order if zero == 1 else []):
        if units[i].reduce_in:
            tr.add(comm=units[i].reduce_in)
            launch(i)


def shard_calls(spec, tp: int, ep: int, layers: list[int], first: bool, last: bool,
                pipeline: bool) -> list[list[tuple[tuple[int, ...], ...]]]:
    """The ``shard`` calls the trainer makes on a rank holding ``layers``, each its units'
    parameter shapes, root first. Without a pipeline: one call, the root (embedding, norm,
    head) and one unit per block (``build_parallel_model``); in a pipeline stage every
    piece is its own call (``shard_stages``): the embedding, each block (its norms as the
    root, then attention and feed-forward units), the final norm, the head."""
    def block(i: int) -> list[tuple[tuple[int, ...], ...]]:
        return [tuple(spec._norm(tp) * 2), tuple(spec.attention_shapes(tp)),
                tuple(spec.ffn_shapes(i, tp, ep))]

    if not pipeline:
        return [[tuple(spec.root_shapes(tp, first, last))]
                + [tuple(spec.block_shapes(i, tp, ep)) for i in layers]]
    calls = [[tuple(spec.root_shapes(tp, True, False))]] if first else []
    calls += [block(i) for i in layers]
    if last:
        v = -(-spec.vocab_size // tp)
        calls += [[tuple(spec._norm(tp))], [((v, spec.dim),)]]
    return calls


def rank_transient(spec, wl, L, layers: list[int], first: bool, last: bool
                   ) -> tuple[float, float, float]:
    """(gathered parameters, communication buffers, whole gradients) bytes one CPU rank
    holds at its transient peak, summed over its ``shard`` calls as ``memory_report`` sums
    their trackers ([Note: buffer replay]).

    Whole gradients are autograd's gradients of the full parameters before the engine
    packs them: every unit's at stage 1 or when micro-batches accumulate; else, when a
    block packs, its own plus those of the root's parameters backward reached first (the
    final norm and head: the root packs last, once the embedding's gradient arrives).
    """
    world = L.dp_shard * L.cp
    calls = shard_calls(spec, L.tp, L.ep, layers, first, last, L.pp > 1)
    unsharded = comm = whole = 0
    for call in calls:
        bufs = [unit_buffers(u, world, compute_bytes=wl.act_bytes, param_bytes=wl.param_bytes,
                             quant_weights=L.comm_weights != "fp",
                             quant_grads=L.comm_grads != "fp") for u in call]
        if L.zero:
            u, c = replay_peak(bufs, zero=L.zero, prefetch=wl.prefetch,
                               reshard_after_forward=wl.reshard_after_forward)
            unsharded, comm = unsharded + u, comm + c
        whole += sum(unit_state(u, world).numel for u in call) * wl.act_bytes
    if L.zero == 0:
        return 0.0, 0.0, 0.0
    if L.zero == 1 or L.pp_microbatches > 1:
        return float(unsharded), float(comm), float(whole)
    root = calls[0][0]
    early = root[1:] if first else root  # the embedding's gradient comes last
    held = sum(unit_state((s,), 1).numel for s in early) * wl.act_bytes
    block = max((unit_state(u, world).numel for call in calls for u in call[1:]), default=0)
    peak = max(block * wl.act_bytes + held,
               sum(unit_state((s,), 1).numel for s in root) * wl.act_bytes)
    return float(unsharded), float(comm), float(peak)
