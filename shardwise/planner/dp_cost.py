"""The data-parallel collectives of one pipeline rank: what the engine's gathers and
reductions take, and what of them is exposed ([Note: step time] in cost_model.py).

    gather, first_gather, reduce, last_reduce = dp_times(cm, L, layers, first, last)
    exposed = dp_exposed(cm, L, rank_times, layers, first, last)

Each unit (the rank's blocks, its root, its experts over their own group) is priced by the
device model's collectives from the bytes the engine sends: stage 0 all-reduces whole
gradients; stages 1-3 reduce-scatter them (then all-reduce over replicas) and gather the
parameters, in the quantised payloads of ``comm_weights`` / ``comm_grads`` when set
(``shardwise.quant.packed_nbytes``); a stack whose ZeRO-1 all-reduces whole gradients
(``zero1_all_reduce``, DeepSpeed's BF16_Optimizer) pays the all-reduce. They hide behind
compute as the engine schedules them: stage-3 gathers behind the computing unit, stage-1/2
gathers behind the next forward, reductions behind the last micro-batch's backward; the
first gather and the last reduction are always exposed.

[Note: pricing fp8 weight gathers] With fp8_tensorwise and ``comm_weights=fp8`` at stage 3,
each rank casts its shard of every converted weight with a per-tensor scale agreed over the
gather group and the gathered codes go straight into the multiplies
(``shardwise.parallel.lowbit``, [Note: offered weights]): a unit's gather moves its
converted weights' shards at a byte an element, exactly half of a bf16 gather's, and every
other parameter (norms, a router, the embedding and head units) unquantised in the compute
dtype, as the engine sends them then ([Note: scaled gathers in the engine]: what the recipe
keeps in high precision is gathered exactly). Once a step, before the first gather, each
rank reads its converted shards for their amax and one all-reduce per gather group agrees
the scales (4 bytes a converted weight): exposed, like the first gather
(:func:`scale_sync_seconds`).
"""

from __future__ import annotations

from shardwise.planner import comm_model
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.rank_memory import unit_state
from shardwise.planner.pipeline import gather_rounds
from shardwise.planner.recipe_work import unit_split
from shardwise.planner.stage_cost import RankTimes
from shardwise.quant import packed_nbytes

__all__ = ["dp_times", "dp_exposed", "shard_numel", "reduce_element_bytes", "gather_bytes",
           "fp8_split", "scale_sync_seconds"]


def shard_numel(shapes, world: int) -> int:
    """Elements of one rank's shard of a unit of parameter ``shapes`` over ``world``."""
    return unit_state(tuple(shapes), world).shard_numel


def reduce_element_bytes(wl, zero: int) -> int:
    """Bytes of a gradient element as the engine reduces it: fp32 where the stack reduces
    in fp32, else the compute dtype, or the parameters' dtype at stage 0."""
    return 4 if wl.reduce_fp32 else wl.act_bytes if zero > 0 else wl.param_bytes


def fp8_split(cm, L: Layout, layers) -> dict:
    """Each unit's (converted, other) shapes of the rank holding ``layers`` when ``L``
    gathers the recipe's weights as fp8 codes ([Note: pricing fp8 weight gathers]); empty
    otherwise."""
    if not cm.stages.offered(L):
        return {}
    key = ("fp8 split", L.tp, L.ep, tuple(layers))
    return cm.cached(key, lambda: unit_split(cm.spec, layers, L.tp, L.ep,
                                             cm.wl.matmul_recipe))


def gather_bytes(cm, L: Layout, shapes, world: int, split: dict) -> float:
    """Bytes one rank's shard of a unit of ``shapes`` sends in one all-gather over ``world``
    ranks: the compute dtype, ``comm_weights``' codes, or with ``split`` (:func:`fp8_split`)
    the converted weights as fp8 codes ([Note: pricing fp8 weight gathers])."""
    n = shard_numel(shapes, world)
    if tuple(shapes) in split:
        conv, rest = split[tuple(shapes)]
        return shard_numel(conv, world) + shard_numel(rest, world) * cm.wl.act_bytes
    if split:  # a unit with nothing converted, in a run that gathers codes: unquantised
        return n * cm.wl.act_bytes
    if L.comm_weights != "fp":
        return packed_nbytes(n, L.comm_weights, 256)
    return n * cm.wl.act_bytes


def scale_sync_seconds(cm, L: Layout, layers, first: bool, last: bool) -> float:
    """Seconds of a step's scale agreement for fp8 weight gathers on the rank holding
    ``layers``: the amax pass over its converted shards and one all-reduce of 4 bytes a
    converted weight per gather group ([Note: pricing fp8 weight gathers]); 0 without them."""
    split = fp8_split(cm, L, layers)
    if not split:
        return 0.0
    _, dense, experts = cm.units(L, layers, first, last)
    g, seconds = cm.hw.gpus_per_node, 0.0
    groups = ((comm_model.place(L.dp_shard * L.cp, L.tp, g), dense),
              (comm_model.place(max(1, L.dp_shard * L.cp // L.ep), L.tp * L.ep, g), experts))
    for grp, units in groups:
        tensors = sum(c * len(split[u][0]) for u, c in units.items() if u in split)
        numel = sum(c * shard_numel(split[u][0], grp.size) for u, c in units.items()
                    if u in split)
        if tensors:
            seconds += cm.device.all_reduce(4 * tensors, grp)
            seconds += cm.hw.memory_time(numel * cm.wl.param_bytes)
    return seconds


def dp_times(cm, L: Layout, layers, first: bool, last: bool) -> tuple[float, ...]:
    """(gather per step, first-unit gather, reduction per step, last-unit reduction) of a
    rank holding ``layers``, priced by ``cm`` (a CostModel; cached on it)."""
    key = ("dp", L.tp, L.ep, L.dp_shard, L.cp, L.dp_replicate, L.zero, L.comm_weights,
           L.comm_grads, tuple(layers), first, last)
    return cm.cached(key, lambda: _price(cm, L, layers, first, last))


def _price(cm, L: Layout, layers, first: bool, last: bool) -> tuple[float, ...]:
    wl, dev, g = cm.wl, cm.device, cm.hw.gpus_per_node
    root, dense, experts = cm.units(L, layers, first, last)
    groups = [(comm_model.place(L.dp_shard * L.cp, L.tp, g), [(root, 1), *dense.items()])]
    if experts:
        groups.append((comm_model.place(max(1, L.dp_shard * L.cp // L.ep), L.tp * L.ep, g),
                       list(experts.items())))
    rep = comm_model.place(L.dp_replicate, L.dp_shard * L.cp * L.tp, g)
    gather = first_g = red = last_r = 0.0
    rb = reduce_element_bytes(wl, L.zero)
    split = fp8_split(cm, L, layers)
    for grp, units in groups:
        for shapes, count in units:
            if not shapes:
                continue
            n = shard_numel(shapes, grp.size if L.zero > 0 else 1)
            if L.zero == 0:
                full = comm_model.place(grp.size * L.dp_replicate, L.tp, g)
                t_red = dev.all_reduce(n * rb, full)
                t_gat = 0.0
            else:
                gb = gather_bytes(cm, L, shapes, grp.size, split)
                qb = packed_nbytes(n, L.comm_grads, 256) if L.comm_grads != "fp" \
                    else n * rb
                t_gat = dev.all_gather(gb, grp)
                if L.zero == 1 and wl.zero1_all_reduce:  # whole gradients, every rank
                    whole = comm_model.place(grp.size * L.dp_replicate, L.tp, g)
                    t_red = dev.all_reduce(shard_numel(shapes, 1) * rb, whole)
                else:
                    t_red = dev.reduce_scatter(qb, grp) + dev.all_reduce(n * rb, rep)
            gather += count * t_gat
            red += count * t_red
            first_g, last_r = max(first_g, t_gat), max(last_r, t_red)
    return gather, first_g, red, last_r


def dp_exposed(cm, L: Layout, rt: RankTimes, layers, first: bool, last: bool,
               overlap: bool = True) -> float:
    """Seconds of the rank's data-parallel collectives left on its step: all of them
    without ``overlap`` (the device's ``overlaps``) or without the workload's ``overlap_dp``,
    else what compute does not hide.

    When the stack synchronises gradients once, after the step's last backward ([Note:
    step time] in cost_model.py), the reductions run then, behind no compute, and stage 3
    gathers once per step (twice when it reshards after forward), behind the first
    micro-batch's compute, since nothing reshards between micro-batches."""
    gather, first_g, red, last_r = dp_times(cm, L, layers, first, last)
    sync = scale_sync_seconds(cm, L, layers, first, last)  # before the first gather
    rounds = gather_rounds(L, cm.wl)
    if cm.wl.dp_sync_after_backward:
        return _gathers(cm, L, rt, gather, first_g, rounds)[1] + red + sync
    total_gather, hidden = _gathers(cm, L, rt, gather, first_g, rounds)
    if not (cm.wl.overlap_dp and overlap):
        return total_gather + red + sync
    return hidden + max(0.0, red - rt.bwd) + last_r + sync


def _gathers(cm, L: Layout, rt: RankTimes, gather: float, first_g: float, rounds: int
             ) -> tuple[float, float]:
    """(all the gathers' seconds, what of them compute leaves exposed) when stage 3
    gathers ``rounds`` times a step (``pipeline.gather_rounds``; stages 1-2 once, behind
    the next forward)."""
    if L.zero == 3:
        per_round = (2 if cm.wl.reshard_after_forward else 1) * gather
        return rounds * per_round, rounds * max(0.0, per_round - rt.busy) + first_g
    return gather, max(0.0, gather - rt.fwd) + first_g if gather else 0.0
