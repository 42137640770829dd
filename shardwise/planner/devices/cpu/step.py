"""How a CPU rank's step parts combine: the cores' contention and time-sharing, the engine's
copies on the compute thread, and the cost of each collective met between operators.

    breakdown = combine(hw, cost_model, L, breakdown, layers, first, last)

[Note: CPU ranks share the cores] ``shardwise train`` on CPUs runs one thread per rank, and
the calibration measures one rank's kernels on one core. With more ranks than cores the
ranks time-share the cores, so a step lasts at least the ranks' total busy seconds over
the cores: ``max(critical path, sum of busy / cores)``. In a data-parallel step every rank
is equally busy, which makes compute ``ranks / cores`` times longer; in a pipeline a rank
waiting in the bubble frees its core for the others, so the bubble is filled rather than
added. Collectives are not hidden behind compute once the cores are saturated (as many
ranks as cores, or more): Gloo's threads copy and reduce on the same cores the compute
threads are using, so the engine's asynchronous gathers and reductions only overlap when a
core is idle. Under time-sharing a collective's seconds are of two kinds, which the
calibration measures apart (process CPU time beside wall time, ``CpuCosts.comm_cpu``): its
own CPU (copies, the reduction, Gloo's threads), which competes for the cores like compute
and joins the busy seconds; and waiting (for a peer still computing, or descheduled),
during which another rank runs on the core ([Note: waiting beyond the cores]). Adding the
waiting to the busy seconds would count the other ranks' compute twice; leaving the
collectives' own CPU out would miss what a rank spends on them. Each collective's CPU
fraction is the one measured for its group: a pipeline send's pair, the engine's shards
or replicas (the larger), and every rank for the step's loss and statistics.

[Note: waiting beyond the cores] Beyond the cores, a collective's waiting is not on the
step at all. The calibration times each collective after a few milliseconds of compute on
every rank (calibrate/gloo.py), so on 4 ranks over 2 cores its waiting is the time its
peers take to finish that compute while time-sharing the cores (a 4-rank collective there
is 0.2-0.25 CPU and the rest waiting): other ranks' compute, which the busy seconds
already count. The steps measure the same: ZeRO-3 over 4 ranks on 2 cores, every rank
equally busy, ran in the ranks' CPU seconds over the cores (the fastest step over twice
the slowest rank's median CPU seconds a step: 0.97-1.03 in the 12 rounds of
bench/results/planner_choice.json, debug and small, and 0.93-1.01 in the 20 of
planner_bench's last run and runs 23-25), so no core idled that a rank's waiting could
be charged for. Exposing ``cores / ranks`` of the waiting, as this model once did, priced
the collective-heavy layouts too high against the others: planner_choice's debug x4
default (ZeRO-3, a collective per unit) over its top (2 pipelines of 2 stages) was
predicted 1.33 and measured 1.09-1.14; re-predicted from the same calibration, 1.12
(``bench/planner_choice_refit.py``).

Cores are not independent either: they share the clock budget (a lone busy core runs at a
higher boost frequency), the last-level cache and the memory bandwidth. The calibration
times a Llama block's forward and backward on one process alone and on as many processes
as cores; that ratio (``CpuCosts.busy``) slows every rank's compute once every core is
busy (interpolated below). A pipeline whose ranks each keep a core is slowed only while
its ranks compute at once ([Note: contention follows the schedule] in pipeline.py).

[Note: crowded collectives] With more ranks than cores, a collective over a group smaller
than the world meets peers that are descheduled: pp 2 x dp 2 on 4 ranks reduces over
pairs while the other stage's ranks compute on the same cores, and such a call takes
several times what the same pair takes alone. ``--calibrate`` therefore also times, for a
world beyond the cores, every smaller group that divides it, all groups at once
(``measure_gloo(world, sizes, group=g)`` in calibrate/gloo.py, ``CpuCosts.crowded``).
Those seconds are one rank's timeline amid the others: their waiting is mostly the other
ranks' compute, which the time-shared bound above already counts over the cores. So a
layout of that many ranks is priced twice and the longer wins: its critical path with the
crowded fits (``CostModel.timeline_only``: no time-sharing bound), and the time-shared
bound with the lone groups' fits. The world's own group was always measured with every
rank running, so pure data parallelism is unchanged.

How long a crowded call waits depends on how long the peers' turns on the cores last, so
the crowd is measured after two gaps of compute per call (``CROWD_GAPS`` in
calibrate/kernels.py). The data-parallel gathers and reductions (one of each per unit, a
layer apart) and the pipeline's sends take the longer gap's fits; the tensor-parallel
collectives, ten to a layer with sequence parallelism, take the crowd interpolated at
their own gap, the busiest rank's compute per micro-batch over its tensor-parallel calls
(``CostModel.tp_gap``), clamped to the measured gaps.
"""

from __future__ import annotations

from shardwise.planner import comm_model
from shardwise.planner.devices.cpu.kernels import engine_copy_seconds
from shardwise.planner.devices.cpu.pipeline import contended_pipeline
from shardwise.planner.pipeline import (gather_rounds, rounded, simulated_microbatches,
                                        stage_costs)
from shardwise.planner.recompute import layer_ac
from shardwise.planner.sends import (context_sends, cp_calls_per_layer, engine_calls,
                                     pipeline_sends, tp_calls_per_layer, tp_edge_calls)
from shardwise.planner.stage_cost import fbw_seconds

__all__ = ["saturated", "time_shared", "combine", "collective_overhead_seconds"]


def saturated(hw, ranks: int) -> bool:
    """Whether ``ranks`` ranks on one CPU node keep every core busy ([Note: CPU ranks share
    the cores]): then collectives do not overlap compute."""
    return bool(hw.cores) and ranks >= hw.cores


def time_shared(hw, ranks: int, critical: float, busy_total: float) -> float:
    """The step time of ``ranks`` ranks on ``hw.cores`` cores ([Note: CPU ranks share the
    cores]): the critical path, or the ranks' busy seconds (compute and the collectives'
    own CPU) over the cores, whichever is longer (a collective's waiting is other ranks'
    turns on the cores: [Note: waiting beyond the cores])."""
    if not hw.cores or ranks <= hw.cores:
        return critical
    return max(critical, busy_total / hw.cores)


def _step_collectives(cm, L) -> float:
    """The trainer's per-step collectives outside the layers: the gradient norm's
    all-reduce and the all-gather of every rank's loss and memory (``gather_stats``), and
    under sequence parallelism the all-reduce of the replicated norms' gradients over
    the tensor-parallel group."""
    dev, total = cm.device, 0.0
    if L.gpus > 1:
        world = comm_model.place(L.gpus, 1, dev.hw.gpus_per_node)
        total += dev.all_reduce(4, world) + dev.all_gather(16, world)
    if L.tp > 1 and L.sp:
        norms = (2 * cm.spec.n_layers + 1) * cm.spec.dim * 4 / L.pp
        total += dev.all_reduce(norms, comm_model.place(L.tp, 1, dev.hw.gpus_per_node))
    return total


def _collectives(L, out: dict[str, float], own: float, stats: float
                 ) -> list[tuple[int, float]]:
    """(group size, seconds) of a step's collectives by kind ([Note: CPU ranks share the
    cores]): a pipeline send pairs two ranks; the engine's gathers and reductions run over
    the shards and over the replicas (the larger group), the step's loss and statistics
    over every rank; ``own``, the engine's copies, are compute."""
    return [(L.tp, out["tp_comm"]), (L.cp, out["cp_comm"]), (L.ep, out["ep_all_to_all"]),
            (2, out["pp_comm"]), (L.gpus, stats),
            (max(L.dp_shard * L.cp, L.dp_replicate), out["dp_comm"] - own - stats)]


def _tp_calls(cm, L, layers, first: bool, last: bool) -> int:
    """Tensor-parallel collectives per micro-batch on a rank holding ``layers``."""
    if L.tp <= 1:
        return 0
    return sum(tp_calls_per_layer(L.sp, layer_ac(L.ac, cm.wl.selective_ac, i) == "full")
               for i in layers) + tp_edge_calls(L.sp, first, last)


def _cp_calls(cm, L, layers) -> int:
    """Context-parallel calls per micro-batch on a rank holding ``layers``."""
    if L.cp <= 1:
        return 0
    sends = context_sends(cm.spec, L.cp_impl, L.cp, L.tp, L.microbatch, cm.wl.seq_len,
                          cm.wl.act_bytes)
    return sum(cp_calls_per_layer(sends, layer_ac(L.ac, cm.wl.selective_ac, i) == "full")
               for i in layers)


def collective_overhead_seconds(hw, cm, L, layers, first: bool, last: bool
                                ) -> dict[str, float]:
    """What a rank holding ``layers`` pays per step beyond its collectives' fits, by
    component: ``CpuCosts.collective_overhead`` for each tensor-parallel collective, each
    context-parallel all-to-all and ring exchange, each of the engine's gathers and
    reductions and each pipeline send or receive ([Note: collectives between operators] in
    calibrate/blocks.py), while the ranks keep a core each; nothing beyond the cores, where
    the crowded collectives price what a call meets."""
    each = hw.cpu.collective_overhead
    if not each or (hw.cores and L.gpus > hw.cores):
        return {}
    units = cm.rank_units(L, layers, first, last)
    out = {"tp_comm": each * L.pp_microbatches * _tp_calls(cm, L, layers, first, last),
           "dp_comm": each * engine_calls(cm.spec, cm.wl, L, units, layers, first, last),
           "pp_comm": each * pipeline_sends(L)}
    if L.cp > 1:
        out["cp_comm"] = each * L.pp_microbatches * _cp_calls(cm, L, layers)
    return out


def _contended(hw, cm, L) -> tuple[float, float]:
    """(the busiest pipeline rank's compute stretch, the step's bubble) when the pipeline's
    ranks slow each other only while they compute at once ([Note: contention follows the
    schedule] in pipeline.py). Every pipeline rank's data and tensor replicas compute
    beside it, so ``n`` pipeline ranks computing are ``n * gpus / pp`` ranks."""
    v = max(1, L.pp_virtual)
    ranks = cm.all_ranks(L)
    r_star = max(range(len(ranks)), key=lambda k: ranks[k][1].busy)
    stages = stage_costs(L.pp_schedule, L.pp, v, [fbw_seconds(x[1]) for x in ranks])
    per_pp = L.gpus // L.pp
    slowdown = tuple(hw.cpu.contention(n * per_pp, hw.cores) for n in range(1, L.pp + 1))
    m_sim = simulated_microbatches(L.pp_schedule, L.pp, L.pp_microbatches)
    run = contended_pipeline(L.pp_schedule, L.pp, v, m_sim, rounded(stages), slowdown)
    alone = run.alone[r_star]
    stretch = run.busy[r_star] / alone if alone else 1.0
    return stretch, run.step - run.busy[r_star]


def combine(hw, cm, L, breakdown: dict[str, float], layers, first: bool, last: bool
            ) -> dict[str, float]:
    """The busiest rank's step components (holding ``layers``) with the compute slowed by
    the cores' contention, the engine's copies on ``dp_comm``, each collective's overhead
    and the cores' time-sharing on ``compute`` ([Note: CPU ranks share the cores]).

    Args:
        hw: the CPU device's hardware entry (its calibration in ``hw.cpu``).
        cm: the :class:`~shardwise.planner.cost_model.CostModel` pricing ``L``.
        breakdown: the step's components before the cores are accounted.

    Returns:
        A new breakdown with the same keys.
    """
    out, wl = dict(breakdown), cm.wl
    world = L.dp_shard * L.cp
    gathers = gather_rounds(L, wl) * (2 if wl.reshard_after_forward else 1) if L.zero == 3 else 1

    def copies(lay, f: bool, la: bool) -> float:
        return engine_copy_seconds(hw, cm.rank_units(L, lay, f, la), world, L.zero, gathers,
                                   wl.act_bytes, wl.param_bytes)

    slow = hw.cpu.contention(L.gpus, hw.cores or 1)  # busy cores compute slower
    if hw.cores and L.pp > 1 and L.gpus <= hw.cores:  # [Note: contention follows the schedule]
        stretch, bubble = _contended(hw, cm, L)
        out["compute"] *= stretch
        out["pp_bubble"] = bubble
        out["optimizer"] *= slow
    else:
        for k in ("compute", "optimizer", "pp_bubble"):
            out[k] *= slow
    own, stats = slow * copies(layers, first, last), _step_collectives(cm, L)
    out["dp_comm"] += own + stats
    for k, v in collective_overhead_seconds(hw, cm, L, layers, first, last).items():
        out[k] += v
    if not hw.cores or L.gpus <= hw.cores or cm.timeline_only:
        return out
    busy = 0.0
    for r, rt, lay in cm.all_ranks(L):
        _, f, la = cm.rank_plan(L, r)
        busy += (L.pp_microbatches * (rt.fwd + rt.bwd) + cm.optimizer_seconds(L, lay, f, la)[0]
                 + copies(lay, f, la))
    busy *= slow * L.gpus / L.pp  # every pipeline rank's data and tensor replicas
    on_core = sum(hw.cpu.comm_cpu_fraction(group) * seconds
                  for group, seconds in _collectives(L, out, own, stats))
    busy += on_core * L.gpus  # every rank's collectives occupy its core that long
    critical = sum(out.values())
    out["compute"] += time_shared(hw, L.gpus, critical, busy) - critical
    return out
