"""The pipeline term of the cost model, behind one function: :func:`schedule_profile`.

[Note: pipeline profile] The cost model needs two numbers from a pipeline schedule: how
long the busiest rank is idle per step (the bubble) and how many micro-batches' activations
a rank holds at its peak. Principle 4 says they must come from the schedule the executor
runs; until the schedule generators and their simulator (shardwise.parallel.pipeline)
are on this branch they come from the closed forms the simulator is tested against, with per-rank
costs ``f`` (forward of one micro-batch through all of a rank's layers), ``b`` (its
backward) and ``w`` (the weight-gradient part of ``b``, which zero-bubble schedules defer;
Qi et al.'s T_B is ``b - w`` here):

================  ================================  =====================================
schedule          idle time per step                peak micro-batches of activations
================  ================================  =====================================
gpipe             (p - 1)(f + b)                    m
1f1b              (p - 1)(f + b)                    min(m, p)
interleaved_1f1b  (p - 1)(f + b) / v                min(m, p) + (p - 1) / v  (Narayanan 2021)
zb1 (ZB-H1)       (p - 1)(f + b - 2w)               p                        (Qi et al. 2024)
zbv (ZB-V)        (p - 1) max(0, f + b - 3w)        p
dualpipev         (p - 1) max(0, f + b - 3w) / 2    p + 1                    (DeepSeek-V3)
================  ================================  =====================================

The simulator replaces this table by running the action lists with the same ``f``, ``b``,
``w`` (and send costs) and reading idle time and in-flight activations off the timeline;
the call below keeps its signature. The zbv and dualpipev rows are the papers' forms for
equal chunk times and are the least exact of the table (DualPipeV overlaps one chunk's
forward with another's backward, halving its exposed bubble).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineProfile", "schedule_profile"]


@dataclass(frozen=True)
class PipelineProfile:
    """Idle seconds per step of the busiest rank and its peak in-flight micro-batches."""

    bubble_time: float
    peak_inflight: float
    source: str = "closed form"


def schedule_profile(schedule: str, pp: int, virtual: int, microbatches: int, f: float,
                     b: float, w: float = 0.0) -> PipelineProfile:
    """Bubble and peak activations of a schedule (see [Note: pipeline profile]).

    Args:
        schedule: one of ``shardwise.planner.layout.SCHEDULES``.
        pp: pipeline ranks; virtual: stages per rank; microbatches: per step.
        f, b: seconds of one micro-batch's forward / backward over one rank's layers.
        w: the weight-gradient share of ``b`` (zero-bubble schedules defer it).

    Returns:
        A :class:`PipelineProfile`.

    Raises:
        ValueError: for an unknown schedule.
    """
    p, m, v = pp, microbatches, max(1, virtual)
    if p == 1 or schedule == "none":
        return PipelineProfile(0.0, 1.0)
    if schedule == "gpipe":
        return PipelineProfile((p - 1) * (f + b), float(m))
    if schedule == "1f1b":
        return PipelineProfile((p - 1) * (f + b), float(min(m, p)))
    if schedule == "interleaved_1f1b":
        return PipelineProfile((p - 1) * (f + b) / v, min(m, p) + (p - 1) / v)
    if schedule == "zb1":
        return PipelineProfile((p - 1) * max(0.0, f + b - 2 * w), float(p))
    if schedule == "zbv":
        return PipelineProfile((p - 1) * max(0.0, f + b - 3 * w), float(p))
    if schedule == "dualpipev":
        return PipelineProfile((p - 1) * max(0.0, f + b - 3 * w) / 2, float(p + 1))
    raise ValueError(f"unknown pipeline schedule {schedule!r}")
