"""A pipeline schedule on CPU cores that compute slower the more of them compute at once.

[Note: contention follows the schedule] The calibration's ``busy`` is how much slower each
core computes while every core computes (``CpuCosts.contention``). A data-parallel or
tensor-parallel step computes on every rank at once from its first kernel to its last, so
the slowdown applies to all of its compute. A pipeline does not: in a 2-stage 1F1B step of
2 micro-batches with a backward twice its forward, both ranks compute at once for 3 of the 9
forward-lengths of the step, and one rank computes alone (at the lone core's speed) for the
other 6. Slowing the whole step by ``busy`` over-predicted both 2-rank pipeline rows of the
committed bench (run 7: +16% to +30% median, +12% to +20% fastest, with ``busy`` 1.39),
while the data-parallel rows beside them were over-predicted by that run's ``busy`` alone.

So the pipeline is replayed (the executor's own schedule, under the executor's
communication semantics as replay.py runs them: compute actions one after another per rank,
consecutive sends and receives as one batch, sends posted on arrival) as processor sharing:
from one event to the next (an action starting or ending), each of the ``n`` pipeline ranks
computing works at ``1 / slowdown[n - 1]`` of its lone speed. Ranks that each keep a core
are priced this way; ranks beyond the cores are time-shared and priced by
``cpu_stage.time_shared`` instead. Messages are free here: the cost model adds the sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from shardwise.parallel.pipeline import Costs, build_schedule
from shardwise.parallel.pipeline.actions import Kind
from shardwise.parallel.pipeline.p2p import batch_end, message_key

__all__ = ["ContendedPipeline", "contended_pipeline"]

_SENDS = (Kind.SEND_F, Kind.SEND_B)


class ContendedPipeline(NamedTuple):
    """One replayed schedule under contention."""

    step: float
    """Seconds from the first compute action's start to the last one's end."""
    busy: tuple[float, ...]
    """Per rank: its compute seconds, stretched by the ranks computing beside it."""
    alone: tuple[float, ...]
    """Per rank: the same compute at the lone core's speed."""


@dataclass
class _Rank:
    actions: tuple
    pos: int = 0
    work: float | None = None  # lone-speed seconds left of the compute action at ``pos``
    start: float = 0.0  # when that action started
    busy: float = 0.0

    @property
    def computing(self) -> bool:
        return self.work is not None

    def advance(self, posted: set, costs: Costs, now: float) -> bool:
        """Move an idle rank through its communication batches (its sends posted on arrival,
        a batch done once each of its receives has been sent) to its next compute action,
        which starts ``now``. Returns whether anything moved."""
        moved = False
        while self.work is None and self.pos < len(self.actions):
            action = self.actions[self.pos]
            if action.is_compute:
                self.work, self.start = float(costs.of(action)), now
                return True
            end = batch_end(self.actions, self.pos)
            batch = self.actions[self.pos:end]
            for op in batch:
                if op.kind in _SENDS and message_key(op) not in posted:
                    posted.add(message_key(op))
                    moved = True
            if not all(message_key(op) in posted for op in batch if op.kind not in _SENDS):
                return moved
            self.pos, moved = end, True
        return moved


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
    ranks = [_Rank(tuple(acts)) for acts in sched.ranks]
    posted: set = set()
    now = 0.0
    while True:
        while any([r.advance(posted, costs, now) for r in ranks if not r.computing]):
            pass  # a send may let a rank already passed over move on
        running = [r for r in ranks if r.computing]
        if not running:
            break
        slow = slowdown[min(len(running), len(slowdown)) - 1]
        dt = min(r.work for r in running) * slow  # until the next action ends
        now += dt
        for r in running:
            r.work -= dt / slow
            if r.work <= 1e-12 * max(1.0, now):
                r.busy += now - r.start
                r.pos, r.work = r.pos + 1, None
    stuck = [k for k, r in enumerate(ranks) if r.pos < len(r.actions)]
    if stuck:  # build_schedule validates its schedules: a stall is a bug here, not bad input
        raise AssertionError(f"the contended replay of {schedule} stalled on ranks {stuck}")
    alone = tuple(float(sum(costs.of(a) for a in r.actions if a.is_compute)) for r in ranks)
    return ContendedPipeline(now, tuple(r.busy for r in ranks), alone)
