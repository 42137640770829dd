"""The data-parallel collectives of one pipeline rank: what the engine's gathers and
reductions take, and what of them is exposed ([Note: step time] in cost_model.py).

    gather, first_gather, reduce, last_reduce = dp_times(cm, L, layers, first, last)
    exposed = dp_exposed(cm, L, rank_times, layers, first, last)

Each unit (the rank's blocks, its root, its experts over their own group) is priced with
comm_model from the bytes the engine sends: stage 0 all-reduces whole gradients; stages
1-3 reduce-scatter them (then all-reduce over replicas) and gather the parameters, in the
quantised payloads of ``comm_weights`` / ``comm_grads`` when set
(``shardwise.quant.packed_nbytes``); a stack whose ZeRO-1 all-reduces whole gradients
(``zero1_all_reduce``, DeepSpeed's BF16_Optimizer) pays the all-reduce. They hide behind
compute as the engine schedules them: stage-3 gathers behind the computing unit, stage-1/2
gathers behind the next forward, reductions behind the last micro-batch's backward; the
first gather and the last reduction are always exposed.

[Note: the engine's copies on GPUs] A gather lands in one flat buffer; shardwise's engine
and FSDP2 (``foreach_all_gather_copy_out``) then copy each parameter out of it into its own
tensor, and before a reduction they pack the gradients into the reduction's flat buffer,
cast to the reduction dtype (FSDP2's ``foreach_reduce``: ``chunk_cat``). Those are
bandwidth-bound passes over the rank's whole (unsharded) parameters: a read and a write in
the compute dtype per gather, a read in the compute dtype and a write in the reduction
dtype per step's reduction, charged at the memory bandwidth with the data-parallel time
(the copy-out runs on the compute stream; the packing, on FSDP2's reduce-scatter stream,
competes with the compute for the same bandwidth). Stage 3 gathers every unit for each
micro-batch's forward and, resharding after it, the non-root units again for the backward;
stages 1-2 gather once a step. Stacks whose parameters and gradients live in the
collectives' flat buffers (Megatron-LM's and DeepSpeed's, FSDP1's flat parameters) copy
nothing: the workload's ``dp_copies`` False. For Llama 3 8B on 64 A100 at stage 3 (one
micro-batch of 8192 tokens, fp32 reductions) it is 8.0 billion parameters x (2 gathers x 4
+ 6) bytes less the root's second gather, about 0.07 s of a 2.5 s step.
"""

from __future__ import annotations

from shardwise.planner import comm_model
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.rank_memory import unit_state
from shardwise.planner.pipeline import gather_rounds
from shardwise.planner.stage_cost import RankTimes
from shardwise.quant import packed_nbytes

__all__ = ["dp_times", "dp_exposed", "dp_copy_seconds", "shard_numel"]


def shard_numel(shapes, world: int) -> int:
    """Elements of one rank's shard of a unit of parameter ``shapes`` over ``world``."""
    return unit_state(tuple(shapes), world).shard_numel


def _reduce_bytes(wl, zero: int) -> int:
    """Bytes of a gradient element as the engine reduces it: fp32 where the stack reduces
    in fp32, else the compute dtype, or the parameters' dtype at stage 0."""
    return 4 if wl.reduce_fp32 else wl.act_bytes if zero > 0 else wl.param_bytes


def dp_times(cm, L: Layout, layers, first: bool, last: bool) -> tuple[float, ...]:
    """(gather per step, first-unit gather, reduction per step, last-unit reduction) of a
    rank holding ``layers``, priced by ``cm`` (a CostModel; cached on it)."""
    key = ("dp", L.tp, L.ep, L.dp_shard, L.cp, L.dp_replicate, L.zero, L.comm_weights,
           L.comm_grads, tuple(layers), first, last)
    return cm._cached(key, lambda: _price(cm, L, layers, first, last))


def _price(cm, L: Layout, layers, first: bool, last: bool) -> tuple[float, ...]:
    wl, hw, g = cm.wl, cm.hw, cm.hw.gpus_per_node
    root, dense, experts = cm._units(L, layers, first, last)
    groups = [(comm_model.place(L.dp_shard * L.cp, L.tp, g), [(root, 1), *dense.items()])]
    if experts:
        groups.append((comm_model.place(max(1, L.dp_shard * L.cp // L.ep), L.tp * L.ep, g),
                       list(experts.items())))
    rep = comm_model.place(L.dp_replicate, L.dp_shard * L.cp * L.tp, g)
    gather = first_g = red = last_r = 0.0
    rb = _reduce_bytes(wl, L.zero)
    for grp, units in groups:
        for shapes, count in units:
            if not shapes:
                continue
            n = shard_numel(shapes, grp.size if L.zero > 0 else 1)
            if L.zero == 0:
                full = comm_model.place(grp.size * L.dp_replicate, L.tp, g)
                t_red = comm_model.all_reduce_time(n * rb, full, hw)
                t_gat = 0.0
            else:
                gb = packed_nbytes(n, L.comm_weights, 256) if L.comm_weights != "fp" \
                    else n * wl.act_bytes
                qb = packed_nbytes(n, L.comm_grads, 256) if L.comm_grads != "fp" \
                    else n * rb
                t_gat = comm_model.all_gather_time(gb, grp, hw)
                if L.zero == 1 and wl.zero1_all_reduce:  # whole gradients, every rank
                    whole = comm_model.place(grp.size * L.dp_replicate, L.tp, g)
                    t_red = comm_model.all_reduce_time(shard_numel(shapes, 1) * rb, whole, hw)
                else:
                    t_red = comm_model.reduce_scatter_time(qb, grp, hw) + \
                        comm_model.all_reduce_time(n * rb, rep, hw)
            gather += count * t_gat
            red += count * t_red
            first_g, last_r = max(first_g, t_gat), max(last_r, t_red)
    return gather, first_g, red, last_r


def dp_exposed(cm, L: Layout, rt: RankTimes, layers, first: bool, last: bool,
               overlap: bool = True) -> float:
    """Seconds of the rank's data-parallel collectives left on its step: all of them
    without ``overlap`` (saturated CPU cores) or without the workload's ``overlap_dp``,
    else what compute does not hide.

    When the stack synchronises gradients once, after the step's last backward ([Note:
    step time] in cost_model.py), the reductions run then, behind no compute, and stage 3
    gathers once per step (twice when it reshards after forward), behind the first
    micro-batch's compute, since nothing reshards between micro-batches."""
    gather, first_g, red, last_r = dp_times(cm, L, layers, first, last)
    rounds = gather_rounds(L, cm.wl)
    if cm.wl.dp_sync_after_backward:
        return _gathers(cm, L, rt, gather, first_g, rounds)[1] + red
    total_gather, hidden = _gathers(cm, L, rt, gather, first_g, rounds)
    if not (cm.wl.overlap_dp and overlap):
        return total_gather + red
    return hidden + max(0.0, red - rt.bwd) + last_r


def _gathers(cm, L: Layout, rt: RankTimes, gather: float, first_g: float, rounds: int
             ) -> tuple[float, float]:
    """(all the gathers' seconds, what of them compute leaves exposed) when stage 3
    gathers ``rounds`` times a step (``pipeline.gather_rounds``; stages 1-2 once, behind
    the next forward)."""
    if L.zero == 3:
        per_round = (2 if cm.wl.reshard_after_forward else 1) * gather
        return rounds * per_round, rounds * max(0.0, per_round - rt.busy) + first_g
    return gather, max(0.0, gather - rt.fwd) + first_g if gather else 0.0


def dp_copy_seconds(cm, L: Layout, layers, first: bool, last: bool) -> float:
    """Seconds of the engine's copies around its gathers and reductions in one step on a
    GPU rank holding ``layers`` ([Note: the engine's copies on GPUs]); 0 at stage 0,
    without data-parallel sharding, or for stacks without them (``dp_copies`` False)."""
    wl = cm.wl
    world = L.dp_shard * L.cp
    if not wl.dp_copies or L.zero == 0 or world <= 1:
        return 0.0
    root, dense, experts = cm._units(L, layers, first, last)
    root_n = unit_state(tuple(root), world).full_numel if root else 0
    rest = sum(count * unit_state(tuple(u), world).full_numel
               for u, count in (*dense.items(), *experts.items()) if u)
    if L.zero == 3:
        gathers = gather_rounds(L, wl) * (root_n + rest * (2 if wl.reshard_after_forward else 1))
    else:
        gathers = root_n + rest
    reduce_bytes = _reduce_bytes(wl, L.zero)
    nbytes = 2 * wl.act_bytes * gathers + (wl.act_bytes + reduce_bytes) * (root_n + rest)
    return cm.hw.memory_time(nbytes)
