"""Seconds of a layer's and the head's kernels, the optimizer update, the engine's copies
and the ranks' time-sharing on CPU ranks, priced with the calibration's fits ([Note: CPU
kernels] in cpu_costs.py).

[Note: CPU ranks share the cores] ``shardwise train`` on CPUs runs one thread per rank, and
the calibration measures one rank's kernels on one core. With more ranks than cores
(4 ranks on this 2-core machine) the ranks time-share the cores, so a step lasts at least
the ranks' total busy seconds over the cores: ``max(critical path, sum of busy / cores)``.
In a data-parallel step every rank is equally busy, which makes compute ``ranks / cores``
times longer; in a pipeline a rank waiting in the bubble frees its core for the others, so
the bubble is filled rather than added. Collectives are not hidden behind compute once the
cores are saturated (as many ranks as cores, or more): Gloo's threads copy and reduce on
the same cores the compute threads are using, so the engine's asynchronous gathers and
reductions only overlap when a core is idle. Under time-sharing a collective's seconds are
of two kinds, which the calibration measures apart (process CPU time beside wall time,
``CpuCosts.comm_cpu``): its own CPU (copies, the reduction, Gloo's threads: about half of
a 2-rank collective's seconds here), which competes for the cores like compute and joins
the busy seconds; and waiting (for a peer still computing, or descheduled), during which
another rank runs on the core, so only ``cores / ranks`` of it is exposed (the rounds of
the cores' round robin in which no other rank is runnable). The calibrated 4-rank
collectives are mostly such waiting (CPU 0.25 of their seconds): adding them whole to the
busy seconds over the cores counted the other ranks' compute twice (the 4-rank
data-parallel step predicted +5-18%), and leaving their CPU out of the busy seconds left
out 0.04-0.10 s of CPU a rank spends per step on its collectives (tensor-parallel and
pipeline steps at 4 ranks predicted 6-32% fast).

Cores are not independent either: they share the clock budget (a lone busy core runs at a
higher boost frequency), the last-level cache and the memory bandwidth. The calibration
times a Llama block's forward and backward on one process alone and on as many processes
as cores (measured here, every core busy: 1.03-1.18x the CPU time, depending on what else
the machine ran; the debug model's multiplies took 1.32x longer at 2 ranks than at 1 in a
profile); that ratio (``CpuCosts.busy``) slows every rank's compute once every core is
busy (interpolated below). A pipeline whose ranks each keep a core is slowed only while
its ranks compute at once ([Note: contention follows the schedule] in cpu_pipeline.py).

[Note: crowded collectives] With more ranks than cores, a collective over a group smaller
than the world meets peers that are descheduled: pp 2 x dp 2 on 4 ranks reduces over
pairs while the other stage's ranks compute on the same cores. Measured here on 2 cores,
a 2-rank all-gather or reduce-scatter of 4 KB-1 MB takes 0.9-2.2 ms on 2 processes and
3.2-7.9 ms when 4 processes run two such pairs at once. ``--calibrate`` therefore also
times, for a world beyond the cores, every smaller group that divides it, all groups at
once (``measure_gloo(world, sizes, group=g)`` in cpu_gloo.py, ``CpuCosts.crowded``). Those
seconds are one rank's timeline amid the others: their waiting is mostly the other
ranks' compute, which the time-shared bound above already counts over the cores. So a
layout of that many ranks is priced twice and the longer wins: its critical path with the
crowded fits (``CostModel.timeline_only``: no time-sharing bound), and the time-shared
bound with the lone groups' fits, as before. The world's own group was always measured
with every rank running, so pure data parallelism is unchanged.

How long a crowded call waits depends on how long the peers' turns on the cores last, so
the crowd is measured twice, after about 1.4 ms and about 4 ms of compute per call
(``CROWD_GAPS`` in cpu_bench.py; the 2-rank pairs' extra wait was 2.4 ms and 3.8 ms on
average here, and 4.5 ms after 8.5 ms). The data-parallel gathers and reductions (one
of each per unit, a layer apart) and the pipeline's sends take the longer gap's fits;
the tensor-parallel collectives, ten to a layer with sequence parallelism, take the
crowd interpolated at their own gap, the busiest rank's compute per micro-batch over
its tensor-parallel calls (``CostModel._tp_gap``), clamped to the measured gaps. Priced
at the long gap, tp 2 x dp 2 on 4 ranks came out +18% to +36%.
"""

from __future__ import annotations

from shardwise.planner import comm_model
from shardwise.planner.cpu_pipeline import contended_pipeline
from shardwise.planner.rank_memory import unit_state
from shardwise.planner.pipeline import (gather_rounds, rounded, simulated_microbatches,
                                        stage_costs)
from shardwise.planner.recompute import layer_ac

__all__ = ["cpu_pricable", "layer_kernels", "head_kernels", "optimizer_seconds",
           "engine_copy_seconds", "saturated", "time_shared", "cpu_step", "tp_layer_comm",
           "tp_head_comm", "tp_collectives_per_layer", "tp_head_collectives",
           "engine_calls", "collective_overhead_seconds"]


def cpu_pricable(hw, spec, moe: bool = False) -> bool:
    """Whether a layer of ``spec`` is priced by the CPU kernels: a CPU device with a
    calibration, and the trainer's dense Llama block (RMSNorm, RoPE, SwiGLU, grouped-query
    attention). Other shapes keep the bandwidth model of work.py."""
    return (hw.cpu is not None and not moe and spec.norm == "rmsnorm"
            and spec.mlp == "swiglu" and spec.position == "rope" and not spec.is_mla)


def _calls(spec, tokens: float, seq: int, tp: int, sp: bool, exec_flops: float):
    rep = tokens / (tp if sp else 1)  # outside the tensor-parallel regions
    d, h, kv, hd = spec.dim, spec.n_heads // tp, max(1, spec.kv_heads // tp), spec.hd
    calls = [("rmsnorm", rep * d, 2), ("residual", rep * d, 2), ("rope", tokens * h * hd, 1),
             ("rope", tokens * kv * hd, 1), ("swiglu", tokens * spec.ffn_dim // tp, 1),
             # the flash kernel: its multiplies (FLOPs) and its softmax (causal scores)
             ("attention", exec_flops, 1), ("softmax", tokens * seq * h / 2, 1)]
    if kv < h:  # k and v expanded to every query head before the kernel
        calls.append(("repeat_kv", tokens * h * hd, 2))
    return calls


def layer_kernels(hw, spec, tokens: float, seq: int, tp: int, sp: bool, exec_flops: float
                  ) -> tuple[float, float]:
    """(forward, backward) seconds of one dense layer's kernels other than its linears'
    multiplies on one CPU rank, for ``tokens`` tokens (divided by ``memory_efficiency``,
    the constant a refit corrects them with)."""
    c = hw.cpu
    calls = _calls(spec, tokens, seq, tp, sp, exec_flops)
    fwd = sum(c.kernel(name, n, calls=k) for name, n, k in calls)
    bwd = sum(c.kernel(name, n, backward=True, calls=k) for name, n, k in calls)
    return fwd / hw.memory_efficiency, bwd / hw.memory_efficiency


def head_kernels(hw, spec, tokens: float, tp: int, sp: bool, first: bool, last: bool
                 ) -> tuple[float, float]:
    """(forward, backward) seconds of the embedding (``first``), and of the final norm and
    the fp32 cross-entropy (``last``), on one CPU rank."""
    c, d = hw.cpu, spec.dim
    v = -(-spec.vocab_size // tp)
    fwd = bwd = 0.0
    if first:
        fwd += c.kernel("embedding", tokens * d)
        bwd += c.kernel("embedding", spec.vocab_size * d + tokens * d, backward=True)
    if last:
        rep = tokens / (tp if sp else 1)
        fwd += c.kernel("rmsnorm", rep * d) + c.kernel("cross_entropy", tokens * v)
        bwd += c.kernel("rmsnorm", rep * d, True) + c.kernel("cross_entropy", tokens * v, True)
    return fwd / hw.memory_efficiency, bwd / hw.memory_efficiency


def _tp_times(hw, tokens: float, dim: int, act_bytes: int, tp: int) -> tuple[float, ...]:
    """(all-gather of a sequence piece, reduce-scatter to one, all-reduce of the whole
    activation) seconds on the tensor-parallel group."""
    grp = comm_model.place(tp, 1, hw.gpus_per_node)
    act = tokens * dim * act_bytes
    return (comm_model.all_gather_time(act / tp, grp, hw),
            comm_model.reduce_scatter_time(act / tp, grp, hw),
            comm_model.all_reduce_time(act, grp, hw))


def tp_collectives_per_layer(sp: bool, recompute: bool) -> int:
    """The tensor-parallel collectives one layer issues per micro-batch (see
    :func:`tp_layer_comm`)."""
    fwd, bwd = (2, 3) if sp else (1, 1)
    return 2 * (fwd * (2 if recompute else 1) + bwd)


def tp_layer_comm(hw, tokens: float, dim: int, act_bytes: int, tp: int, sp: bool,
                  recompute: bool) -> float:
    """Tensor-parallel seconds of one layer per micro-batch, the collectives apply_tp
    issues (comm_stats counts them): two regions (attention, feed-forward). With sequence
    parallelism each gathers its input and reduce-scatters its output in forward, the
    reverse in backward, and gathers its input again for the weight gradients (the
    forward keeps only its piece); without, one all-reduce forward (leaving) and one
    backward (entering). A full recomputation replays the forward's."""
    if tp <= 1:
        return 0.0
    ag, rs, ar = _tp_times(hw, tokens, dim, act_bytes, tp)
    fwd, bwd = (ag + rs, ag + rs + ag) if sp else (ar, ar)
    return 2 * (fwd * (2 if recompute else 1) + bwd)


def tp_head_collectives(sp: bool, first: bool, last: bool) -> int:
    """The tensor-parallel collectives of the embedding (``first``) and the head and loss
    (``last``) per micro-batch (see :func:`tp_head_comm`)."""
    return (first * (2 if sp else 1)) + last * ((3 if sp else 1) + 2)


def _tp_calls(cm, L, layers, first: bool, last: bool) -> int:
    """Tensor-parallel collectives per micro-batch on a rank holding ``layers``."""
    if L.tp <= 1:
        return 0
    return sum(tp_collectives_per_layer(L.sp, layer_ac(L.ac, cm.wl.selective_ac, i) == "full")
               for i in layers) + tp_head_collectives(L.sp, first, last)


def engine_calls(cm, L, layers, first: bool, last: bool) -> int:
    """The engine's data-parallel collectives per step on a rank holding ``layers``, by the
    rules ``comm_model.step_bytes`` prices: stage 0 one all-reduce per bucket
    (``comm_model.stage0_buckets``); stages 1-2 one reduce-scatter and one gather per unit;
    stage 3 every unit gathered for each micro-batch's forward and the non-root units again
    for its backward (with ``reshard_after_forward``), one reduce-scatter per unit; over
    replicas, each reduction also all-reduced."""
    world = L.dp_shard * L.cp
    if world * L.dp_replicate <= 1:
        return 0
    states = [unit_state(tuple(u), world) for u in _rank_units(cm, L, layers, first, last)]
    units = [st for st in states if st.n_params]
    if L.zero == 0:
        sizes = comm_model.registration_sizes(cm.spec, cm.wl.param_bytes, L.tp, layers,
                                              first, last)
        return len(comm_model.stage0_buckets(sizes))
    n, root = len(units), int(bool(states and states[0].n_params))
    gathers = n if L.zero < 3 else gather_rounds(L, cm.wl) * (
        n + (n - root if cm.wl.reshard_after_forward else 0))
    return gathers + n * (2 if L.dp_replicate > 1 else 1)


def collective_overhead_seconds(cm, L, layers, first: bool, last: bool
                                ) -> dict[str, float]:
    """What a rank holding ``layers`` pays per step beyond its collectives' fits, by
    component: ``CpuCosts.collective_overhead`` for each tensor-parallel collective, each
    of the engine's gathers and reductions and each pipeline send or receive ([Note:
    collectives between operators] in cpu_blocks.py), while the ranks keep a core each;
    nothing beyond the cores, where the crowded collectives price what a call meets."""
    hw, each = cm.hw, cm.hw.cpu.collective_overhead
    if not each or (hw.cores and L.gpus > hw.cores):
        return {}
    sends = 2 * max(1, L.pp_virtual) * L.pp_microbatches if L.pp > 1 else 0
    return {"tp_comm": each * L.pp_microbatches * _tp_calls(cm, L, layers, first, last),
            "dp_comm": each * engine_calls(cm, L, layers, first, last),
            "pp_comm": each * sends}


def tp_head_comm(hw, tokens: float, dim: int, act_bytes: int, tp: int, sp: bool,
                 first: bool, last: bool) -> float:
    """The embedding's and the head's tensor-parallel collectives per micro-batch: the
    vocabulary-parallel embedding's sum (a reduce-scatter to the sequence pieces, or an
    all-reduce) and its backward; the head's input gathered (forward, again for its
    weight gradient) and its gradient reduced; the vocabulary-parallel loss's max and sum
    all-reduces of one value per token."""
    if tp <= 1:
        return 0.0
    ag, rs, ar = _tp_times(hw, tokens, dim, act_bytes, tp)
    total = 0.0
    if first:
        total += rs + ag if sp else ar
    if last:
        grp = comm_model.place(tp, 1, hw.gpus_per_node)
        total += (ag + rs + ag if sp else ar)
        total += 2 * comm_model.all_reduce_time(tokens * 4, grp, hw)
    return total


def optimizer_seconds(hw, units, world: int) -> float:
    """The update of the rank's shards (foreach norm, clip, ``AdamW.step``): per tensor and
    per element of the shard each parameter keeps."""
    n_tensors = sum(unit_state(tuple(u), world).n_params for u in units)
    numel = sum(unit_state(tuple(u), world).local_numel for u in units)
    return (n_tensors * hw.cpu.optimizer.latency + numel * hw.cpu.optimizer.per_unit) \
        / hw.memory_efficiency


def engine_copy_seconds(hw, units, world: int, zero: int, gathers: float, act_bytes: int,
                        param_bytes: int) -> float:
    """The engine's own copies on the compute thread in one step: each gather's copy-out
    into the full parameters (``gathers`` per unit), the gradient packing and the
    averaging; stage 0: the packing into buckets and their averaging. (The Gloo
    reduce-scatter's local sum is part of its calibrated time.)"""
    c, total = hw.cpu, 0.0
    for u in units:
        s = unit_state(tuple(u), world if zero else 1)
        if not s.n_params:
            continue
        if zero == 0:  # packed into the buckets, then averaged
            total += 2 * c.kernel("copy", s.numel * param_bytes)
            continue
        full = s.full_numel * act_bytes
        total += gathers * c.kernel("copy", full) + c.kernel("copy", full)
        total += c.kernel("copy", s.shard_numel * param_bytes)
    return total / hw.memory_efficiency


def saturated(hw, ranks: int) -> bool:
    """Whether ``ranks`` ranks on one CPU node keep every core busy ([Note: CPU ranks share
    the cores]): then collectives do not overlap compute."""
    return bool(hw.cores) and ranks >= hw.cores


def time_shared(hw, ranks: int, critical: float, busy_total: float, waiting: float
                ) -> float:
    """The step time of ``ranks`` ranks on ``hw.cores`` cores ([Note: CPU ranks share the
    cores]): the critical path, or the ranks' busy seconds (compute and the collectives'
    own CPU) over the cores plus the share of a rank's collective waiting no other rank
    fills (``cores / ranks`` of it), whichever is longer."""
    if not hw.cores or ranks <= hw.cores:
        return critical
    return max(critical, busy_total / hw.cores + waiting * hw.cores / ranks)


def _step_collectives(cm, L) -> float:
    """The trainer's per-step collectives outside the layers: the gradient norm's
    all-reduce and the all-gather of every rank's loss and memory (``gather_stats``), and
    under sequence parallelism the all-reduce of the replicated norms' gradients over
    the tensor-parallel group."""
    hw, total = cm.hw, 0.0
    if L.gpus > 1:
        world = comm_model.place(L.gpus, 1, hw.gpus_per_node)
        total += comm_model.all_reduce_time(4, world, hw) + comm_model.all_gather_time(
            16, world, hw)
    if L.tp > 1 and L.sp:
        norms = (2 * cm.spec.n_layers + 1) * cm.spec.dim * 4 / L.pp
        total += comm_model.all_reduce_time(norms, comm_model.place(L.tp, 1, hw.gpus_per_node),
                                            hw)
    return total


def _rank_units(cm, L, layers, first: bool, last: bool) -> list:
    root, dense, experts = cm._units(L, layers, first, last)
    return ([root] + [u for u, n in dense.items() for _ in range(n)]
            + [u for u, n in experts.items() for _ in range(n)])


def _contended(cm, L) -> tuple[float, float]:
    """(the busiest pipeline rank's compute stretch, the step's bubble) when the pipeline's
    ranks slow each other only while they compute at once ([Note: contention follows the
    schedule] in cpu_pipeline.py). Every pipeline rank's data and tensor replicas compute
    beside it, so ``n`` pipeline ranks computing are ``n * gpus / pp`` ranks."""
    hw, v = cm.hw, max(1, L.pp_virtual)
    ranks = cm._all_ranks(L)
    r_star = max(range(len(ranks)), key=lambda k: ranks[k][1].busy)
    stages = stage_costs(L.pp_schedule, L.pp, v, [cm._fbw(x[1]) for x in ranks])
    per_pp = L.gpus // L.pp
    slowdown = tuple(hw.cpu.contention(n * per_pp, hw.cores) for n in range(1, L.pp + 1))
    m_sim = simulated_microbatches(L.pp_schedule, L.pp, L.pp_microbatches)
    run = contended_pipeline(L.pp_schedule, L.pp, v, m_sim, rounded(stages), slowdown)
    alone = run.alone[r_star]
    stretch = run.busy[r_star] / alone if alone else 1.0
    return stretch, run.step - run.busy[r_star]


def cpu_step(cm, L, breakdown: dict[str, float], layers, first: bool, last: bool) -> None:
    """CPU ranks: slow the compute by the cores' contention, add the engine's copies to
    ``dp_comm`` and the cores' time-sharing to ``compute``, in place ([Note: CPU ranks
    share the cores]).

    Args:
        cm: the :class:`~shardwise.planner.cost_model.CostModel` pricing ``L``.
        breakdown: the step's components on the busiest rank (holding ``layers``).
    """
    hw, wl = cm.hw, cm.wl
    world = L.dp_shard * L.cp
    gathers = gather_rounds(L, wl) * (2 if wl.reshard_after_forward else 1) if L.zero == 3 else 1

    def copies(lay, f: bool, la: bool) -> float:
        return engine_copy_seconds(hw, _rank_units(cm, L, lay, f, la), world, L.zero, gathers,
                                   wl.act_bytes, wl.param_bytes)

    slow = hw.cpu.contention(L.gpus, hw.cores or 1)  # busy cores compute slower
    if hw.cores and L.pp > 1 and L.gpus <= hw.cores:  # [Note: contention follows the schedule]
        stretch, bubble = _contended(cm, L)
        breakdown["compute"] *= stretch
        breakdown["pp_bubble"] = bubble
        breakdown["optimizer"] *= slow
    else:
        for k in ("compute", "optimizer", "pp_bubble"):
            breakdown[k] *= slow
    own = slow * copies(layers, first, last)
    breakdown["dp_comm"] += own + _step_collectives(cm, L)
    for k, v in collective_overhead_seconds(cm, L, layers, first, last).items():
        breakdown[k] += v
    if not hw.cores or L.gpus <= hw.cores or cm.timeline_only:
        return
    busy = 0.0
    for r, rt, lay in cm._all_ranks(L):
        _, f, la = cm._rank_plan(L, r)
        busy += (L.pp_microbatches * (rt.fwd + rt.bwd) + cm._optimizer(L, lay, f, la)[0]
                 + copies(lay, f, la))
    busy *= slow * L.gpus / L.pp  # every pipeline rank's data and tensor replicas
    groups = {"tp_comm": L.tp, "cp_comm": L.cp, "ep_all_to_all": L.ep,
              "pp_comm": 2, "dp_comm": world}  # a pipeline send pairs two ranks
    comm = {k: breakdown[k] - (own if k == "dp_comm" else 0.0) for k in groups}
    on_core = sum(hw.cpu.comm_cpu_fraction(groups[k]) * v for k, v in comm.items())
    busy += on_core * L.gpus  # every rank's collectives occupy its core that long
    critical = sum(breakdown.values())
    waiting = sum(comm.values()) - on_core
    breakdown["compute"] += time_shared(hw, L.gpus, critical, busy, waiting) - critical
