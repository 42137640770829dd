"""``build_schedule(name, pp, microbatches, virtual)``: the named schedules and their refusals.

    from shardwise.parallel import build_schedule
    s = build_schedule("1f1b", pp=4, microbatches=8)
    print(s)                      # one line of actions per rank
    open("1f1b.csv", "w").write(s.to_csv())

| name             | stages per rank (virtual)   | placement | backward | micro-batches   |
|------------------|-----------------------------|-----------|----------|-----------------|
| gpipe            | 1                           | -         | B        | >= 1            |
| 1f1b             | 1                           | -         | B        | >= 1            |
| interleaved_1f1b | >= 2 (default 2)            | looped    | B        | >= 1            |
| looped_bfs       | >= 1 (default 2)            | looped    | B        | >= 1            |
| zb1              | 1                           | -         | I + W    | >= 1            |
| zbv              | 2                           | V         | I + W    | >= 1            |
| dualpipev        | 2                           | V         | B, I + W | >= 2 pp         |
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from shardwise.parallel.pipeline import formulas, gen_classic, gen_dualpipe, gen_zero_bubble
from shardwise.parallel.pipeline.action_lists import Schedule, looped_placement, v_placement

__all__ = ["build_schedule", "SCHEDULE_NAMES", "ScheduleSpec", "schedule_spec",
           "expected_bubble", "default_microbatches", "TARGET_BUBBLE"]

TARGET_BUBBLE = 0.25
"""The idle share :func:`default_microbatches` aims under (a quarter of the ranks' time)."""


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything known of a named schedule: what it accepts, where its stages sit, and its
    closed forms (formulas.py).

    Attributes:
        name: the name build_schedule takes.
        summary: one line for help texts.
        generate: ``(pp, microbatches, virtual) -> per-rank action lists``.
        default_virtual: stages per rank when ``virtual=0``.
        min_virtual / max_virtual: accepted stages per rank (max None = no limit).
        bubble_time: ``(p, v, m, f, b, w) -> seconds`` the busiest rank idles in a step,
            from its per-micro-batch forward, backward and weight-gradient seconds over all
            of its layers ([Note: pipeline closed forms] in formulas.py).
        peak_inflight: ``(p, v, m) -> micro-batches`` of activations a rank holds at its
            peak, in units of one micro-batch over all of its layers.
        v_shape: stages placed in a V (else looped).
        with_comm: the generator places its own messages (else they are inserted).
        microbatches_per_pp: the schedule needs m >= this x pp (0: any m >= 1).
    """

    name: str
    summary: str
    generate: Callable
    default_virtual: int
    min_virtual: int
    max_virtual: int | None
    bubble_time: Callable[[int, int, int, float, float, float], float]
    peak_inflight: Callable[[int, int, int], float]
    v_shape: bool = False
    with_comm: bool = False
    microbatches_per_pp: int = 0

    def min_microbatches(self, pp: int) -> int:
        """The fewest micro-batches the schedule runs with at ``pp`` ranks."""
        return max(1, self.microbatches_per_pp * pp)

    def placement(self, pp: int, virtual: int) -> tuple[int, ...]:
        """The rank holding each of the ``pp x virtual`` stages (a V, or looped)."""
        return v_placement(pp) if self.v_shape else looped_placement(pp, virtual)

    def reference_bubble(self, pp: int, microbatches: int, virtual: int):
        """The published bubble share under unit costs, ``(formula, value)``, or None
        ([Note: published bubbles] in formulas.py)."""
        return formulas.reference_bubble(self.name, pp, microbatches, virtual)


_SPECS = (
    ScheduleSpec("gpipe", "all forwards, then all backwards", gen_classic.gpipe, 1, 1, 1,
                 formulas.one_pass_bubble, lambda p, v, m: float(m)),
    ScheduleSpec("1f1b", "one forward, one backward (PipeDream-flush)", gen_classic.one_f_one_b,
                 1, 1, 1, formulas.one_pass_bubble, lambda p, v, m: float(min(m, p))),
    ScheduleSpec("interleaved_1f1b", "1F1B over several looped stages per rank (Megatron-LM)",
                 gen_classic.interleaved_1f1b, 2, 2, None, formulas.looped_bubble,
                 lambda p, v, m: min(m, p) + (p - 1) / v),
    ScheduleSpec("zb1", "zero bubble ZB-H1: split backward, 1F1B memory (Qi et al. 2024)",
                 gen_zero_bubble.zb1, 1, 1, 1, formulas.zero_bubble,
                 lambda p, v, m: float(min(m, p))),
    ScheduleSpec("zbv", "zero bubble ZB-V: split backward over a V of 2 stages per rank",
                 gen_zero_bubble.zbv, 2, 2, 2, formulas.zero_bubble, lambda p, v, m: float(p),
                 v_shape=True),
    ScheduleSpec("dualpipev", "DualPipeV (DeepSeek): V of 2 stages per rank, paired F&B",
                 gen_dualpipe.dualpipev, 2, 2, 2, formulas.dualpipev_bubble,
                 lambda p, v, m: p + 0.5, v_shape=True, with_comm=True, microbatches_per_pp=2),
    ScheduleSpec("looped_bfs", "breadth-first over looped stages: each chunk for all "
                 "micro-batches in turn", gen_classic.looped_bfs, 2, 1, None,
                 formulas.looped_bubble, lambda p, v, m: float(m)),
)
_BY_NAME = {spec.name: spec for spec in _SPECS}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def schedule_spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``name``.

    Raises:
        ValueError: for an unknown name, suggesting the closest known one.
    """
    if name in _BY_NAME:
        return _BY_NAME[name]
    close = difflib.get_close_matches(str(name).lower(), SCHEDULE_NAMES, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown pipeline schedule {name!r}{hint} (known: "
                     f"{', '.join(SCHEDULE_NAMES)})")


def _check_int(what: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what}={value!r}: expected an integer >= {least}")


def resolve_virtual(spec: ScheduleSpec, virtual: int) -> int:
    """``virtual`` with 0 replaced by the schedule's default; refuses what it cannot run."""
    _check_int("virtual", virtual, 0)
    if virtual == 0:
        return spec.default_virtual
    if spec.min_virtual == spec.max_virtual and virtual != spec.min_virtual:
        other = {1: "; for several stages per rank use interleaved_1f1b, looped_bfs, zbv or "
                    "dualpipev", 2: ""}[spec.min_virtual]
        stages = "1 stage" if spec.min_virtual == 1 else f"{spec.min_virtual} stages"
        raise ValueError(f"schedule {spec.name!r} runs exactly {stages} per rank; got "
                         f"virtual={virtual} (use 0 for the default){other}")
    if virtual < spec.min_virtual:
        raise ValueError(f"schedule {spec.name!r} needs virtual >= {spec.min_virtual} stages "
                         f"per rank; got virtual={virtual} (for one stage per rank use 1f1b)")
    return virtual


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 0) -> Schedule:
    """Generate, and validate, the named schedule.

    Args:
        name: one of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb1`` (ZB-H1), ``zbv``,
            ``dualpipev``, ``looped_bfs``.
        pp: pipeline ranks (>= 1).
        microbatches: micro-batches per step (>= the schedule's minimum; dualpipev needs
            2 pp).
        virtual: stages per rank; 0 (default) = the schedule's own: 1 for gpipe, 1f1b and
            zb1, 2 for interleaved_1f1b, looped_bfs, zbv and dualpipev. zbv and dualpipev run
            exactly 2; gpipe, 1f1b and zb1 exactly 1.

    Returns:
        The :class:`Schedule`, with its send / receive actions, already validated.

    Raises:
        ValueError: unknown name (with the closest known one), pp or microbatches not a positive
            integer, microbatches below what the schedule needs (naming the need), or a virtual
            the schedule cannot run.
    """
    spec = schedule_spec(name)
    _check_int("pp", pp, 1)
    _check_int("microbatches", microbatches, 1)
    v = resolve_virtual(spec, virtual)
    need = spec.min_microbatches(pp)
    if microbatches < need:
        raise ValueError(f"schedule {name!r} with pp={pp} needs microbatches >= {need}; got "
                         f"microbatches={microbatches}")
    placement = spec.placement(pp, v)
    ranks = spec.generate(pp, microbatches, v)
    if spec.with_comm:
        schedule = Schedule(name, pp, microbatches, v, placement, tuple(map(tuple, ranks)))
    else:
        schedule = Schedule.from_compute(name, pp, microbatches, v, placement, ranks)
    return schedule.validate()


def expected_bubble(name: str, pp: int, microbatches: int, virtual: int = 0) -> float:
    """The share of the ranks' time a schedule leaves idle, simulated with unit costs
    (forward 1, backward 2, its input and weight halves 1 each, messages free): what the
    schedule's shape costs, before any device's numbers.

    Raises:
        ValueError: as :func:`build_schedule`.
    """
    from shardwise.parallel.pipeline.simulate import Costs, simulate

    sim = simulate(build_schedule(name, pp, microbatches, virtual), Costs(f=1, b=2, i=1, w=1))
    return float(sim.bubble)


def default_microbatches(name: str, pp: int, batch: int, virtual: int = 0) -> int:
    """How many micro-batches a step of ``batch`` sequences is split into when the user
    does not say: the fewest that divide ``batch``, are at least ``pp x virtual`` (one per
    stage, so every stage has work in the steady state) and at least the schedule's own
    minimum, and leave at most :data:`TARGET_BUBBLE` of the ranks idle
    (:func:`expected_bubble`); when no count does, as many as the batch allows (micro-batches
    of one sequence). Fewer micro-batches keep each one's matrices larger; more shrink the
    bubble: this is the fewest that overlap the stages well.

    [Note: default micro-batches] The schedule's minimum (1, or 2 pp for dualpipev) runs,
    but at pp 2 it leaves half of every step idle (1F1B with one micro-batch: each stage
    waits for the other's whole forward and backward); 4 micro-batches bring ZB-V at pp 2 to
    4% and 1F1B to 20%.

    Raises:
        ValueError: as :func:`build_schedule`, or ``batch`` not a positive integer.
    """
    _check_int("batch", batch, 1)
    spec = schedule_spec(name)
    v = resolve_virtual(spec, virtual)
    least = max(spec.min_microbatches(pp), pp * v)
    fits = [m for m in range(1, batch + 1) if batch % m == 0 and m >= spec.min_microbatches(pp)]
    if not fits:
        return spec.min_microbatches(pp)  # too small a batch: build_schedule's check names it
    for m in fits:
        if m >= least and expected_bubble(name, pp, m, v) <= TARGET_BUBBLE:
            return m
    return fits[-1]
