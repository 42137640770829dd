"""The pipeline term of the cost model, behind one function: :func:`schedule_profile`.

[Note: pipeline profile] The cost model needs two things from a pipeline schedule: how long
the slowest rank's step exceeds its own compute (the bubble) and how many micro-batches'
activations each rank holds at its peak. Principle 4: they come from the schedule the
executor runs. With ``exact=True`` this module builds that very schedule
(``shardwise.parallel.build_schedule``) and replays it in the pipeline simulator
(``shardwise.parallel.simulate``) with the cost model's per-stage forward, backward and
weight-gradient seconds and the send latency. The search prices tens of thousands of
layouts, too many to simulate each, so it ranks them with the closed forms the schedule
registry carries (``ScheduleSpec.bubble_time`` and ``peak_inflight``, [Note: pipeline
closed forms] in shardwise/parallel/pipeline/formulas.py) and re-prices its best ones
exactly.

Beyond ``m >= 2p`` the bubble depends on ``m`` only through ``m mod p`` (interleaved 1F1B
runs whole rounds of ``p`` micro-batches), so the exact profile simulates
``2p + (m mod p)`` micro-batches when ``m >= 3p`` and keeps the bubble and the peaks; a
64-stage pipeline of 512 micro-batches is then simulated with 128.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.parallel.pipeline import Costs, build_schedule, simulate
from shardwise.parallel.pipeline.actions import Kind
from shardwise.parallel.pipeline.action_lists import gather_rounds as stage_gather_rounds
from shardwise.parallel.pipeline.schedules import schedule_spec

__all__ = ["PipelineProfile", "schedule_profile", "min_microbatches", "stage_costs",
           "placement", "simulated_microbatches", "rounded", "gather_rounds", "weighted_peaks"]


@dataclass(frozen=True)
class PipelineProfile:
    """Bubble seconds per step and peak in-flight micro-batches (in units of one micro-
    batch over all of a rank's layers): the maximum, and per rank when simulated."""

    bubble_time: float
    peak_inflight: float
    per_rank: tuple[float, ...] = ()
    source: str = "closed form"


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches the schedule's generator accepts at ``pp`` ranks."""
    return 1 if schedule == "none" else schedule_spec(schedule).min_microbatches(pp)


@lru_cache(maxsize=8)
def _built(schedule: str, pp: int, m: int, v: int):
    """The built and validated schedule, shared by every pricing of its shape: the search
    re-prices its best layouts with their own stage costs, often of one schedule shape, and
    building and validating a deep one (pp 256, 512 micro-batches) costs more than its
    simulation."""
    return build_schedule(schedule, pp, m, v)


@lru_cache(maxsize=512)
def _simulated(schedule: str, pp: int, v: int, m: int, stages: tuple, comm: float
               ) -> tuple[float, tuple[float, ...]]:
    """(bubble seconds, per-rank peak micro-batches) of the simulated schedule."""
    sched = _built(schedule, pp, m, v)
    f, b, i, w = (tuple(s[k] for s in stages) for k in range(4))
    sim = simulate(sched, Costs(f=list(f), b=list(b), i=list(i), w=list(w), comm=comm))
    peaks = tuple(float(x) / v for x in sim.peak_activations)
    return float(sim.step_time) - float(max(sim.busy)), peaks


def schedule_profile(schedule: str, pp: int, virtual: int, microbatches: int, f: float,
                     b: float, w: float = 0.0, *, exact: bool = False,
                     rank_costs: list[tuple[float, float, float]] | None = None,
                     comm: float = 0.0) -> PipelineProfile:
    """Bubble and peak activations of a schedule (see [Note: pipeline profile]).

    Args:
        schedule: ``none`` or a name ``shardwise.parallel.build_schedule`` accepts.
        pp: pipeline ranks; virtual: stages per rank; microbatches: per step.
        f, b, w: seconds of one micro-batch's forward / backward / weight-gradient over the
            slowest rank's layers (used by the closed forms).
        exact: build the schedule and simulate it.
        rank_costs: (f, b, w) of every rank (exact only; default: ``(f, b, w)`` for all).
        comm: seconds of one send between stages (exact only).

    Raises:
        ValueError: for an unknown schedule.
    """
    p, m, v = pp, microbatches, max(1, virtual)
    if p == 1 or schedule == "none":
        return PipelineProfile(0.0, 1.0, (1.0,))
    if not exact:
        spec = schedule_spec(schedule)
        return PipelineProfile(spec.bubble_time(p, v, m, f, b, w), spec.peak_inflight(p, v, m))
    per_stage = stage_costs(schedule, p, v, rank_costs or [(f, b, w)] * p)
    stages = tuple(zip(*per_stage, strict=True))
    m_sim = simulated_microbatches(schedule, p, m)
    bubble, peaks = _simulated(schedule, p, v, m_sim, rounded(stages), round(comm, 9))
    if schedule == "gpipe":  # GPipe holds every micro-batch: its peak grows with m
        peaks = tuple(float(m) for _ in peaks)
    return PipelineProfile(bubble, max(peaks), peaks, "simulator")


def simulated_microbatches(schedule: str, pp: int, microbatches: int) -> int:
    """How many micro-batches the exact profile replays for ``microbatches``: all of them
    below ``3 pp``, else ``2 pp + m mod p``, which has the same bubble ([Note: pipeline
    profile]); at least the schedule's minimum."""
    m = microbatches
    return max(min_microbatches(schedule, pp), m if m < 3 * pp else 2 * pp + m % pp)


def placement(schedule: str, pp: int, virtual: int) -> tuple[int, ...]:
    """The rank holding each stage, as the schedule places them (looped, or a V for zbv and
    dualpipev: rank 0 then holds both the first and the last stage)."""
    if schedule == "none" or pp == 1:
        return (0,) * max(1, virtual)
    return schedule_spec(schedule).placement(pp, max(1, virtual))


def stage_costs(schedule: str, pp: int, virtual: int,
                rank_costs: list[tuple[float, float, float]]) -> tuple[tuple[float, ...], ...]:
    """Per-stage (f, b, i, w) simulator costs from each rank's (f, b, w) over all of its
    layers: a rank's stages share its costs equally, placed as the schedule places them."""
    v = max(1, virtual)
    place = placement(schedule, pp, v)
    rows = [(rank_costs[r][0] / v, rank_costs[r][1] / v,
             (rank_costs[r][1] - rank_costs[r][2]) / v, rank_costs[r][2] / v) for r in place]
    return tuple(tuple(x[k] for x in rows) for k in range(4))


def rounded(stages: tuple) -> tuple:
    """Stage costs rounded to 4 significant digits so near-equal layouts share a cached
    replay."""
    def r(x: float) -> float:
        return float(f"{x:.4g}")
    return tuple(tuple(r(x) for x in s) for s in stages)


def gather_rounds(L, wl) -> int:
    """How many times a step gathers a ZeRO-3 rank's parameters for its forwards (each unit
    again for its backward when ``wl.reshard_after_forward``): once per step when the
    stack keeps them gathered between micro-batches (``dp_sync_after_backward``), in a
    pipeline the count of the schedule's engine actions ([Note: engine actions] in
    shardwise/parallel/pipeline/action_lists.py: the trainer keeps a stage gathered exactly
    when it does not reshard after forward), else once per micro-batch."""
    if wl.dp_sync_after_backward:
        return 1
    if L.pp > 1:
        return stage_gather_rounds(not wl.reshard_after_forward, L.pp_microbatches)
    return L.pp_microbatches


@lru_cache(maxsize=256)
def weighted_peaks(schedule: str, pp: int, virtual: int, microbatches: int,
                   weights: tuple[float, ...]) -> tuple[float, ...]:
    """Per rank, the peak bytes of saved activations when stage ``s`` keeps ``weights[s]``
    bytes per micro-batch from its forward until its backward (B, or W of a split one),
    replaying the schedule the executor runs.

    [Note: stages of unequal weight] ``PipelineProfile.per_rank`` counts in-flight
    micro-batches in units of a rank's whole set of layers, which assumes the stages a rank
    holds keep equal bytes. They do not: the last stage also keeps the head's fp32
    log-probabilities (and a multi-token-prediction module), the first the embedding's
    output, and a rank's stages are in flight for different counts. A V placement (zbv,
    dualpipev) puts the first stage (in flight for about ``2 pp`` micro-batches) and the
    last (about one) on rank 0: averaging them overstated DeepSeek-V3's rank 0 by the
    head's bytes times ``pp``; an interleaved schedule's last rank holds the last stage (in
    flight for about one) beside an earlier one. Weighting each stage's forward by its own
    bytes gives the peak the schedule really reaches. The exact pricing weighs the stages
    of every schedule with more than one stage per rank (the V placements, where the
    average is off by a factor near ``pp`` on the head's bytes, and interleaved 1F1B,
    whose rank 0 keeps its first chunk, with the embedding, in flight longest); the
    search's closed forms keep the average. Weighed, an interleaved rank 0 is only as
    heavy as the stages are split: Llama 3 405B's 126 layers split evenly over 16 x 6
    stages give its first chunk twice the layers of its later ones and its 8K rows no
    selective layout that fits, while the split the paper ran (Section 3.3.2: one layer
    fewer on the first and the last stage, ``Workload.pp_split = "ends"``, [Note: stage
    splits] in stage_cost.py) fits; see docs/planner.md.
    """
    m = simulated_microbatches(schedule, pp, microbatches)
    sched = _built(schedule, pp, m, virtual)
    out = []
    for acts in sched.ranks:
        live = peak = 0.0
        for a in acts:
            if a.kind is Kind.F:
                live += weights[a.stage]
                peak = max(peak, live)
            elif a.kind in (Kind.B, Kind.W):
                live -= weights[a.stage]
        out.append(peak)
    return tuple(out)
