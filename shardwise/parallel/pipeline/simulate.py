"""Simulate a schedule with per-action costs: step time, bubble, peak in-flight activations.

Reads the very :class:`Schedule` the executor runs and replays it under the executor's
communication semantics (replay.py; [Note: communication semantics] in messages.py). With integer
or ``fractions.Fraction`` costs every time and the bubble are exact rationals.

    from fractions import Fraction
    from shardwise.parallel import Costs, build_schedule, simulate
    sim = simulate(build_schedule("1f1b", 4, 8), Costs(f=1, b=2))
    sim.step_time, sim.bubble          # 33, Fraction(3, 11) = (p-1)/(m+p-1)

Definitions:
- step time: from the first action's start to the last action's end, over all ranks.
- bubble: idle rank-time / (p x step time); a rank is idle whenever it does not compute
  (waiting on a message counts as idle).
- span bubble of a rank: (its last end - its first start) - its compute time: the idle time
  inside its own busy span. Qi et al. 2024 measure bubbles this way (a "parallelogram"
  schedule whose ranks start late and finish late has zero span bubble).
- in-flight activations: (stage, micro-batch) pairs of a rank whose F has run and whose
  activations are not released yet. ``peak_activations`` releases them at B, or at W for a
  split backward (W still reads the stage's inputs); ``peak_activations_until_i`` releases them
  at B or I (the part of the memory that I frees). Counted in stage micro-batches: with v stages
  per rank, one counts 1/v of the rank's layers.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Union

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.replay import replay
from shardwise.parallel.pipeline.action_lists import Schedule

__all__ = ["Costs", "Simulation", "TimedAction", "simulate", "critical_path"]

Cost = Union[numbers.Real, Sequence[numbers.Real]]


@dataclass(frozen=True)
class Costs:
    """Duration of each kind of action, one number or one per stage.

    Attributes:
        f: forward (default 1).
        b: full backward (default 2).
        i: input-gradient backward of a split backward (default 1).
        w: weight-gradient backward of a split backward (default 1).
        comm: latency of one message, from its send to its receive (default 0: free).
    """

    f: Cost = 1
    b: Cost = 2
    i: Cost = 1
    w: Cost = 1
    comm: numbers.Real = 0

    def __post_init__(self) -> None:
        for name in ("f", "b", "i", "w", "comm"):
            value = getattr(self, name)
            values = value if isinstance(value, Sequence) and name != "comm" else [value]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0:
                    raise ValueError(f"Costs.{name}={value!r}: expected a number >= 0 (or, for "
                                     f"f/b/i/w, one per stage)")

    def of(self, action: Action) -> numbers.Real:
        """The duration of compute ``action``.

        Raises:
            ValueError: if a per-stage list has no entry for the action's stage.
        """
        value = {Kind.F: self.f, Kind.B: self.b, Kind.I: self.i, Kind.W: self.w}[action.kind]
        if isinstance(value, Sequence):
            if action.stage >= len(value):
                raise ValueError(f"Costs.{action.kind.value.lower()} lists {len(value)} stages; "
                                 f"action {action} needs stage {action.stage}")
            return value[action.stage]
        return value

    def exact(self) -> bool:
        """Whether every cost is an integer or a Fraction (exact rational arithmetic)."""
        flat = []
        for value in (self.f, self.b, self.i, self.w, self.comm):
            flat += list(value) if isinstance(value, Sequence) else [value]
        return all(isinstance(v, numbers.Rational) for v in flat)


@dataclass(frozen=True)
class TimedAction:
    """One action of the simulated timeline (communication: posted -> batch completed)."""

    rank: int
    action: Action
    start: Any
    end: Any


@dataclass(frozen=True)
class Simulation:
    """The outcome of :func:`simulate` (times in the unit of the costs)."""

    schedule: Schedule
    costs: Costs
    step_time: Any
    bubble: Any
    busy: tuple
    idle: tuple
    span_bubble: tuple
    peak_activations: tuple[int, ...]
    peak_activations_until_i: tuple[int, ...]
    critical_path: Any
    timeline: tuple[tuple[TimedAction, ...], ...]


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Replay ``schedule`` with ``costs``.

    Args:
        schedule: a validated schedule (``build_schedule`` and ``from_csv`` validate).
        costs: per-action durations (default ``Costs()``: F=1, B=2, I=W=1, free messages).

    Returns:
        A :class:`Simulation`; ``bubble`` is a ``Fraction`` when all costs are rational.

    Raises:
        ValueError: on a deadlock (naming the blocked ranks) or a per-stage cost list too short.
    """
    costs = costs or Costs()
    times = replay(schedule.ranks, schedule.placement, costs.of, costs.comm)
    timeline = tuple(tuple(TimedAction(r, a, *t) for a, t in zip(acts, times[r], strict=True))
                     for r, acts in enumerate(schedule.ranks))
    computes = [[t for t in row if t.action.is_compute] for row in timeline]
    start = min((row[0].start for row in computes if row), default=0)
    end = max((row[-1].end for row in computes if row), default=0)
    step = end - start
    busy = tuple(sum((t.end - t.start for t in row), 0) for row in computes)
    idle = tuple(step - b for b in busy)
    span = tuple((row[-1].end - row[0].start - b) if row else 0
                 for row, b in zip(computes, busy, strict=True))
    total_idle = sum(idle, 0)
    if step == 0:
        bubble: Any = 0
    elif costs.exact():
        bubble = Fraction(total_idle) / (schedule.pp * Fraction(step))
    else:
        bubble = total_idle / (schedule.pp * step)
    return Simulation(
        schedule=schedule, costs=costs, step_time=step, bubble=bubble, busy=busy, idle=idle,
        span_bubble=span,
        peak_activations=tuple(_peak(acts, (Kind.B, Kind.W)) for acts in schedule.ranks),
        peak_activations_until_i=tuple(_peak(acts, (Kind.B, Kind.I)) for acts in schedule.ranks),
        critical_path=critical_path(schedule, costs), timeline=timeline)


def _peak(actions: Sequence[Action], releases: tuple[Kind, ...]) -> int:
    live = peak = 0
    for a in actions:
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in releases:
            live -= 1
    return peak


def critical_path(schedule: Schedule, costs: Costs | None = None) -> Any:
    """Longest chain of data dependencies, ignoring that a rank runs one action at a time.

    F of stage s follows F of s-1; a stage's backward (B or I) follows its F and the next
    stage's backward; W follows its I; a message between ranks adds ``costs.comm``. Any
    schedule's step time is at least this (and at least each rank's compute time).

    Args:
        schedule: the schedule (its compute actions are used).
        costs: per-action durations (default ``Costs()``).

    Returns:
        The length of the longest chain, in the unit of the costs.
    """
    costs = costs or Costs()
    kinds: dict[tuple[int, int], Action] = {}
    split: dict[tuple[int, int], Action] = {}
    for acts in schedule.ranks:
        for a in acts:
            if a.kind in (Kind.B, Kind.I):
                kinds[(a.stage, a.microbatch)] = a
            elif a.kind is Kind.W:
                split[(a.stage, a.microbatch)] = a
    last, place = schedule.num_stages - 1, schedule.placement

    def hop(s: int, t: int) -> Any:
        return costs.comm if place[s] != place[t] else 0

    longest: Any = 0
    for mb in range(schedule.microbatches):
        t: Any = 0
        fwd_end = []
        for s in range(last + 1):
            t = t + (hop(s - 1, s) if s else 0) + costs.of(Action(s, Kind.F, mb))
            fwd_end.append(t)
        for s in range(last, -1, -1):
            ready = fwd_end[s] if s == last else max(fwd_end[s], t + hop(s + 1, s))
            t = ready + costs.of(kinds[(s, mb)])
            w = split.get((s, mb))
            longest = max(longest, t + costs.of(w) if w else t)
    return longest
