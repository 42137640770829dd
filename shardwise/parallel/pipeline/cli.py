"""``shardwise schedule show | list`` (plugged into shardwise.train.cli).

    shardwise schedule list
    shardwise schedule show 1f1b --pp 4 --microbatches 8 --out 1f1b.png
    shardwise schedule show zbv --pp 4 --microbatches 8 --csv zbv.csv --costs f=1,b=2,i=1,w=1,comm=0
    shardwise schedule show --from-csv my_schedule.csv --out mine.png

``show`` prints the simulated timeline (one row per rank), the step time, the bubble beside its
published formula, and the peak in-flight activations per rank; ``--actions`` prints the action
lists with their messages instead of the timeline.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from shardwise.parallel.pipeline.formulas import reference_bubble
from shardwise.parallel.pipeline.action_lists import Schedule
from shardwise.parallel.pipeline.schedules import (SCHEDULE_NAMES, build_schedule,
                                                   schedule_spec)
from shardwise.parallel.pipeline.simulate import Costs, simulate
from shardwise.parallel.pipeline.timeline import (describe_simulation, draw_timeline,
                                                  format_timeline)

__all__ = ["add_parser", "run", "parse_costs"]

_SHOW_DESCRIPTION = """\
Build (or load from CSV), validate, simulate and draw a pipeline schedule. Costs are per stage
and per micro-batch, in any unit (default F=1 B=2 I=1 W=1, free messages); integers and
fractions (1/3, 0.5) are simulated exactly. See docs/parallelism.md."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` subcommand and its actions to ``sub``."""
    parser = sub.add_parser("schedule", help="show, simulate and draw pipeline schedules",
                            description="Pipeline schedules as data (docs/parallelism.md).")
    actions = parser.add_subparsers(dest="schedule_action", metavar="ACTION", required=True)
    actions.add_parser("list", help="the schedule names, their stages per rank and needs")
    show = actions.add_parser("show", help="print, simulate and draw one schedule",
                              description=_SHOW_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("name", nargs="?", metavar="NAME",
                      help=f"one of {', '.join(SCHEDULE_NAMES)} (not with --from-csv)")
    show.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    show.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    show.add_argument("--virtual", type=int, default=0, metavar="V",
                      help="stages per rank (default 0: the schedule's own)")
    show.add_argument("--out", metavar="FILE.png", help="write the timeline PNG here")
    show.add_argument("--csv", metavar="FILE", help="write the schedule as CSV here")
    show.add_argument("--from-csv", metavar="FILE",
                      help="load, validate and show this CSV schedule instead of NAME")
    show.add_argument("--costs", metavar="K=V,...", default="",
                      help="f, b, i, w, comm costs, e.g. f=1,b=2,i=1,w=1,comm=0 (defaults)")
    show.add_argument("--actions", action="store_true",
                      help="print the action lists (with messages) instead of the timeline")


def parse_costs(text: str) -> Costs:
    """``"f=1,b=2,comm=1/10"`` -> :class:`Costs` (unnamed keys keep their defaults).

    Raises:
        ValueError: naming an unknown key or a value that is not a number.
    """
    values: dict[str, Fraction] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("f", "b", "i", "w", "comm"):
            raise ValueError(f"--costs item {item!r}: expected KEY=NUMBER with KEY one of f, b, "
                             f"i, w, comm (e.g. f=1,b=2,i=1,w=1,comm=0)")
        try:
            values[key] = Fraction(value.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--costs {key}={value!r}: expected a number such as 2, 0.5 or "
                             f"1/3") from None
    return Costs(**{k: (int(v) if v.denominator == 1 else v) for k, v in values.items()})


def _load(args: argparse.Namespace) -> Schedule:
    if args.from_csv:
        if args.name:
            raise ValueError(f"give either a schedule NAME ({args.name!r}) or --from-csv, "
                             f"not both")
        path = Path(args.from_csv)
        if not path.is_file():
            raise ValueError(f"--from-csv {path}: no such file")
        schedule = Schedule.from_csv(path.read_text(), name=path.stem)
        for flag, value, have in (("--pp", args.pp, schedule.pp),
                                  ("--microbatches", args.microbatches, schedule.microbatches)):
            if value is not None and value != have:
                raise ValueError(f"{flag} {value} disagrees with {path}, which has {have}")
        return schedule
    if not args.name:
        raise ValueError("schedule show needs a NAME (e.g. 1f1b) or --from-csv FILE")
    missing = [f for f, v in (("--pp", args.pp), ("--microbatches", args.microbatches))
               if v is None]
    if missing:
        raise ValueError(f"schedule show {args.name} needs {' and '.join(missing)}")
    return build_schedule(args.name, args.pp, args.microbatches, args.virtual)


def _show(args: argparse.Namespace) -> None:
    costs = parse_costs(args.costs)
    schedule = _load(args)
    sim = simulate(schedule, costs)
    print(schedule.to_text() if args.actions else
          f"{schedule.name}: pp={schedule.pp} microbatches={schedule.microbatches} "
          f"virtual={schedule.virtual}\n" + format_timeline(sim))
    print(describe_simulation(sim))
    known = (reference_bubble(schedule.name, schedule.pp, schedule.microbatches,
                              schedule.virtual) if costs == Costs() else None)
    if known is not None:
        text, value = known
        verdict = "equal" if value == sim.bubble else "differs"
        print(f"published bubble {text} = {value} ({verdict})")
    if args.csv:
        Path(args.csv).write_text(schedule.to_csv())
        print(f"wrote {args.csv}")
    if args.out:
        print(f"wrote {draw_timeline(sim, args.out)}")


def _list() -> None:
    for name in SCHEDULE_NAMES:
        spec = schedule_spec(name)
        top = spec.max_virtual if spec.max_virtual is not None else "any"
        span = (f"{spec.min_virtual}" if spec.min_virtual == spec.max_virtual
                else f"{spec.min_virtual}..{top}")
        need = f"{spec.microbatches_per_pp} x pp" if spec.microbatches_per_pp else "1"
        print(f"{name:17s} virtual {span} (default {spec.default_virtual}), microbatches >= "
              f"{need}: {spec.summary}")


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed ``schedule`` command; print its result.

    Returns:
        0 on success (bad input raises ``ValueError`` -> exit 2 in shardwise.train.cli).
    """
    if args.schedule_action == "list":
        _list()
    else:
        _show(args)
    return 0
