"""Draw a simulated schedule: a text grid for terminals and a timeline PNG (matplotlib, Agg).

    from shardwise.parallel import build_schedule, simulate, draw_timeline, format_timeline
    sim = simulate(build_schedule("zbv", pp=4, microbatches=8))
    print(format_timeline(sim))
    draw_timeline(sim, "zbv.png")

In both, a label is the action kind and micro-batch (``F3``, ``B0``, ``I2``, ``W2``); with
several stages per rank a letter tells them apart (``F3a`` = the rank's first stage, ``F3b``
its second, in increasing stage order). Idle time is ``.`` in the text grid and blank in the
PNG, where the label is the micro-batch, the colour the kind and hatching a rank's second
(fourth, ...) stage.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

from shardwise.parallel.pipeline.actions import Kind
from shardwise.parallel.pipeline.simulate import Simulation, TimedAction

__all__ = ["format_timeline", "draw_timeline", "describe_simulation"]

_COLOURS = {Kind.F: "#4878d0", Kind.B: "#ee854a", Kind.I: "#6acc64", Kind.W: "#956cb4"}
_NAMES = {Kind.F: "forward F", Kind.B: "backward B", Kind.I: "input grad I",
          Kind.W: "weight grad W"}


def _label(sim: Simulation, t: TimedAction) -> str:
    label = f"{t.action.kind.value}{t.action.microbatch}"
    if sim.schedule.virtual > 1:
        chunk = sim.schedule.stages_of(t.rank).index(t.action.stage)
        label += "abcdefghijklmnopqrstuvwxyz"[chunk % 26]
    return label


def _unit(sim: Simulation) -> Fraction | None:
    """The largest time step that every start and end is a multiple of (None if inexact)."""
    times = [x for row in sim.timeline for t in row if t.action.is_compute
             for x in (t.start, t.end)]
    if not all(isinstance(x, (int, Fraction)) for x in times):
        return None
    fracs = [Fraction(x) for x in times]
    denominator = math.lcm(*(f.denominator for f in fracs)) if fracs else 1
    numerator = math.gcd(*(int(f * denominator) for f in fracs)) if fracs else 1
    return Fraction(numerator or 1, denominator)


def format_timeline(sim: Simulation, max_columns: int = 240) -> str:
    """The simulated timeline as a text grid: one row per rank, one column per time unit.

    Args:
        sim: a simulation (see :func:`simulate`).
        max_columns: widest grid drawn; longer schedules (or float costs) are listed instead.

    Returns:
        The grid (or the per-rank action lists when it would not fit), without a final newline.
    """
    unit = _unit(sim)
    columns = int(Fraction(sim.step_time) / unit) if unit and sim.step_time else 0
    if unit is None or columns > max_columns:
        return sim.schedule.to_text(comm=False)
    computes = [[t for t in row if t.action.is_compute] for row in sim.timeline]
    width = 1 + max((len(_label(sim, t)) for row in computes for t in row), default=2)
    lines = []
    for rank, row in enumerate(computes):
        cells = ["." * (width - 1)] * columns
        for t in row:
            first = int(Fraction(t.start) / unit)
            last = int(Fraction(t.end) / unit)
            for c in range(first, last):
                cells[c] = _label(sim, t).ljust(width - 1) if c == first else "-" * (width - 1)
        lines.append(f"rank {rank:<2d}| " + " ".join(cells))
    return "\n".join(lines)


def describe_simulation(sim: Simulation) -> str:
    """Step time, bubble and peak in-flight activations of ``sim`` in a few lines."""
    c = sim.costs
    bubble = (f"{sim.bubble} = {float(sim.bubble):.1%}" if isinstance(sim.bubble, Fraction)
              else f"{float(sim.bubble):.1%}")
    lines = [
        f"costs: F={c.f} B={c.b} I={c.i} W={c.w} message={c.comm}",
        f"step time {sim.step_time} (critical path {sim.critical_path}); bubble {bubble} "
        f"(idle rank-time / (pp x step time))",
        "idle per rank: " + " ".join(str(x) for x in sim.idle),
        "peak in-flight activations per rank (stage micro-batches, released by B or W): "
        + " ".join(map(str, sim.peak_activations)),
    ]
    if sim.schedule.split_backward:
        lines.append("  released at I instead: " + " ".join(map(str,
                                                               sim.peak_activations_until_i)))
    return "\n".join(lines)


def draw_timeline(sim: Simulation, path: str | Path, title: str | None = None) -> Path:
    """Write the simulated timeline as a PNG (one row per rank, time to the right).

    Args:
        sim: a simulation (see :func:`simulate`).
        path: the PNG to write (its folder must exist).
        title: the figure title (default: name, sizes, step time and bubble).

    Returns:
        The path written.
    """
    # Imported here: matplotlib is slow to import and only drawing needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = sim.schedule
    step = float(sim.step_time) or 1.0
    fig, ax = plt.subplots(figsize=(min(24.0, max(8.0, 0.16 * step)), 0.55 * s.pp + 1.6))
    for rank, row in enumerate(sim.timeline):
        for t in row:
            if not t.action.is_compute:
                continue
            start, length = float(t.start), float(t.end - t.start)
            second = s.virtual > 1 and s.stages_of(rank).index(t.action.stage) % 2 == 1
            ax.broken_barh([(start, length)], (rank - 0.4, 0.8),
                           facecolors=_COLOURS[t.action.kind], edgecolor="black", linewidth=0.4,
                           hatch="//" if second else None)
            if length >= step / 120:  # colour and hatch give kind and stage: label the batch
                ax.text(start + length / 2, rank, str(t.action.microbatch), ha="center",
                        va="center", fontsize=7)
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.set_ylim(s.pp - 0.5, -0.5)
    ax.set_xlim(0, step)
    ax.set_xlabel("time (cost units)")
    used = sorted({t.action.kind for row in sim.timeline for t in row if t.action.is_compute},
                  key=list(_COLOURS).index)
    handles = [Patch(facecolor=_COLOURS[k], edgecolor="black", label=_NAMES[k]) for k in used]
    if s.virtual > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                             label="odd local stage (b, d, ...)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.55 * s.pp)),
              ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title(title or (f"{s.name}: pp={s.pp}, microbatches={s.microbatches}, "
                           f"virtual={s.virtual}; step {sim.step_time}, "
                           f"bubble {float(sim.bubble):.1%}"), fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
