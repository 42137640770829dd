"""``shardwise plan --plot out.png``: the chosen layout's memory and pipeline timeline.

The timeline is the schedule the executor would run (``shardwise.parallel.build_schedule``)
replayed by the pipeline simulator with the cost model's per-stage seconds: the same data
that priced the layout ([Note: pipeline profile] in pipeline.py). Long steps are drawn for
their first micro-batches only (the title says how many).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.parallel.pipeline import Costs, build_schedule, simulate
from shardwise.planner.pipeline import min_microbatches, stage_costs
from shardwise.planner.stage_cost import fbw_seconds

__all__ = ["plot_estimate"]

_GIB = 2 ** 30
_MAX_DRAWN = 48  # micro-batches drawn
_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}


def _memory_panel(ax, est, hbm: float) -> None:
    mem = est.memory
    bottom = 0.0
    for k in ("params", "grads", "optimizer", "unsharded", "full_grads", "comm",
              "activations", "logits", "reserved", "fragmentation"):
        v = getattr(mem, k) / _GIB
        if v > 0:
            ax.bar([0], [v], bottom=bottom, label=f"{k} {v:.1f}")
            bottom += v
    ax.axhline(hbm / _GIB, color="k", ls="--", lw=1)
    ax.set_xticks([])
    ax.set_ylabel("GiB per GPU (largest rank)")
    ax.set_title(f"memory: {bottom:.1f} of {hbm / _GIB:.0f} GiB", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _timeline_panel(ax, est, cost_model) -> str:
    L = est.layout
    if L.pp == 1:
        ax.text(0.5, 0.5, "no pipeline (pp = 1)", ha="center", va="center")
        ax.set_axis_off()
        return ""
    ranks = cost_model.all_ranks(L)
    costs = [fbw_seconds(rt) for _, rt, _ in ranks]
    m = max(min_microbatches(L.pp_schedule, L.pp), min(L.pp_microbatches, _MAX_DRAWN))
    f, b, i, w = stage_costs(L.pp_schedule, L.pp, L.pp_virtual, costs)
    sim = simulate(build_schedule(L.pp_schedule, L.pp, m, L.pp_virtual),
                   Costs(f=list(f), b=list(b), i=list(i), w=list(w)))
    for row in sim.timeline:
        for t in row:
            if t.action.is_compute:
                ax.barh(t.rank, float(t.end - t.start), left=float(t.start),
                        color=_COLOURS[t.action.kind.value], edgecolor="white", lw=0.2)
    ax.set_yticks(range(L.pp), [f"pp {r}" for r in range(L.pp)],
                  fontsize=7 if L.pp <= 16 else 4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds: forward blue, backward (+ recompute) orange, weight gradient green")
    more = "" if m == L.pp_microbatches else f", first {m} of {L.pp_microbatches} micro-batches"
    return f"{L.pp_schedule} x{L.pp_virtual}{more}"


def plot_estimate(est, cost_model, path: str | Path) -> Path:
    """Draw ``est``'s memory breakdown and pipeline timeline into ``path`` (PNG).

    Args:
        est: an :class:`~shardwise.planner.cost_model.Estimate`.
        cost_model: the :class:`~shardwise.planner.cost_model.CostModel` that priced it.
        path: the PNG to write.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1, 3]})
    _memory_panel(ax1, est, cost_model.hw.hbm_bytes)
    what = _timeline_panel(ax2, est, cost_model)
    ax2.set_title(f"pipeline {what}\nstep {est.step_time:.3g} s, MFU {est.mfu:.1%}, "
                  f"bottleneck {est.bottleneck}", fontsize=10)
    fig.suptitle(est.layout.key(), fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
