"""A pipeline schedule on CPU cores that compute slower the more of them compute at once.

[Note: contention follows the schedule] The calibration's ``busy`` is how much slower each
core computes while every core computes (``CpuCosts.contention``). A data-parallel or
tensor-parallel step computes on every rank at once from its first kernel to its last, so
the slowdown applies to all of its compute. A pipeline does not: in a 2-stage 1F1B step of
2 micro-batches with a backward twice its forward, both ranks compute at once for 3 of the 9
forward-lengths of the step, and one rank computes alone (at the lone core's speed) for the
other 6: slowing the whole step by ``busy`` over-predicts a pipeline.

So the pipeline is replayed (the executor's own schedule, under the executor's
communication semantics: ``shardwise.parallel.pipeline.replay.replay_shared``) as processor
sharing: from one event to the next (an action starting or ending), each of the ``n``
pipeline ranks computing works at ``1 / slowdown[n - 1]`` of its lone speed. Ranks that
each keep a core are priced this way; ranks beyond the cores are time-shared and priced by
``step.time_shared`` instead. Messages are free here: the cost model adds the sends.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardwise.parallel.pipeline import Costs, build_schedule
from shardwise.parallel.pipeline.replay import replay_shared

__all__ = ["ContendedPipeline", "contended_pipeline"]


class ContendedPipeline(NamedTuple):
    """One replayed schedule under contention."""

    step: float
    """Seconds from the first compute action's start to the last one's end."""
    busy: tuple[float, ...]
    """Per rank: its compute seconds, stretched by the ranks computing beside it."""
    alone: tuple[float, ...]
    """Per rank: the same compute at the lone core's speed."""


@lru_cache(maxsize=512)
def contended_pipeline(schedule: str, pp: int, virtual: int, microbatches: int,
                       stages: tuple, slowdown: tuple[float, ...]) -> ContendedPipeline:
    """Replay a schedule with compute that slows while other ranks compute ([Note:
    contention follows the schedule]).

    Args:
        schedule, pp, virtual, microbatches: as ``shardwise.parallel.build_schedule``.
        stages: per-stage ``(f, b, i, w)`` seconds alone, as four tuples (pipeline.py's
            ``stage_costs``).
        slowdown: ``slowdown[n - 1]`` is each computing rank's slowdown while ``n``
            pipeline ranks compute (>= 1; ``slowdown[0]`` is usually 1); the last one
            holds for more.

    Raises:
        ValueError: for an unknown schedule or a slowdown below 1.
    """
    if not slowdown or min(slowdown) < 1.0:
        raise ValueError(f"slowdown={slowdown!r}: expected one factor >= 1 per count of "
                         f"ranks computing at once")
    sched = build_schedule(schedule, pp, microbatches, virtual)
    f, b, i, w = (list(x) for x in stages)
    costs = Costs(f=f, b=b, i=i, w=w)
    step, busy = replay_shared(sched.ranks, sched.placement, costs.of, slowdown)
    alone = tuple(float(sum(costs.of(a) for a in acts if a.is_compute)) for acts in sched.ranks)
    return ContendedPipeline(step, busy, alone)
