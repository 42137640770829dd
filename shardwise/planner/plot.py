"""``shardwise plan --plot out.png``: the chosen layout's memory and pipeline timeline.

The timeline is drawn from per-rank action orders of GPipe (all forwards, then all
backwards) or 1F1B (warm-up forwards, alternating, cool-down backwards) with each action
starting once its input is ready and its rank is free, using the cost model's per-rank
forward and backward seconds. Interleaved and zero-bubble schedules are drawn as 1F1B with
their chunks (the title says so); the pipeline simulator draws them exactly once it is
wired in (see [Note: pipeline profile] in pipeline.py).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_estimate", "timeline"]

_GIB = 2 ** 30
_MAX_RANKS = 16


def timeline(pp: int, m: int, f: float, b: float, schedule: str) -> list[list[tuple]]:
    """Per rank, (kind, micro-batch, start, end) of each action."""
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(pp - r - 1, m)
        order = [("F", i) for i in range(warm)]
        nf, nb = warm, 0
        while nb < m:
            if nf < m:
                order.append(("F", nf))
                nf += 1
            order.append(("B", nb))
            nb += 1
        orders.append(order)
    done: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    out: list[list[tuple]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, i = orders[r][pos[r]]
            dep = ("F", r - 1, i) if kind == "F" else (("B", r + 1, i) if r < pp - 1
                                                          else ("F", r, i))
            if kind == "F" and r == 0:
                ready = 0.0
            elif dep in done:
                ready = done[dep]
            else:
                continue
            start = max(ready, free[r])
            end = start + (f if kind == "F" else b)
            done[(kind, r, i)] = end
            free[r] = end
            out[r].append((kind, i, start, end))
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # cannot happen for these orders; guard against a bad edit
            raise RuntimeError("pipeline timeline deadlocked")
    return out


def plot_estimate(est, cost_model, path: str | Path) -> Path:
    """Draw ``est``'s memory breakdown and pipeline timeline into ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = est.layout
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8),
                                   gridspec_kw={"width_ratios": [1, 3]})
    mem = est.memory.as_dict()
    kinds = ["params", "grads", "optimizer", "unsharded", "full_grads", "comm",
             "activations", "logits", "reserved", "fragmentation"]
    bottom = 0.0
    for k in kinds:
        v = mem[k] / _GIB
        if v > 0:
            ax1.bar([0], [v], bottom=bottom, label=f"{k} {v:.1f}")
            bottom += v
    ax1.axhline(cost_model.hw.hbm_bytes / _GIB, color="k", ls="--", lw=1)
    ax1.set_xticks([])
    ax1.set_ylabel("GiB per GPU (largest rank)")
    ax1.set_title(f"memory: {bottom:.1f} GiB of {cost_model.hw.hbm_bytes / _GIB:.0f}")
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ranks = cost_model._sample_ranks(L)
    rt = max(ranks, key=lambda x: x[1].busy)[1]
    comm = rt.tp_comm + rt.cp_comm + rt.ep_comm
    share = rt.fwd / (rt.fwd + rt.bwd) if rt.fwd + rt.bwd else 0.5
    f, b = rt.fwd + comm * share, rt.bwd + comm * (1 - share)
    m = min(L.pp_microbatches, 48)
    sched = L.pp_schedule if L.pp_schedule in ("gpipe",) else "1f1b"
    drawn = list(range(L.pp)) if L.pp <= _MAX_RANKS else \
        sorted({round(i * (L.pp - 1) / (_MAX_RANKS - 1)) for i in range(_MAX_RANKS)})
    lines = timeline(L.pp, m, f, b, sched)
    for row, r in enumerate(drawn):
        for kind, _, start, end in lines[r]:
            ax2.barh(row, end - start, left=start, color="tab:blue" if kind == "F"
                     else "tab:orange", edgecolor="white", lw=0.3)
    ax2.set_yticks(range(len(drawn)), [f"pp {r}" for r in drawn])
    ax2.invert_yaxis()
    ax2.set_xlabel("seconds (forward blue, backward + recompute orange)")
    note = "" if L.pp_schedule in ("none", "gpipe", "1f1b") else \
        f" ({L.pp_schedule} drawn as 1f1b)"
    more = "" if m == L.pp_microbatches else f", first {m} of {L.pp_microbatches} micro-batches"
    ax2.set_title(f"pipeline{note}{more}; step {est.step_time:.3g} s, MFU {est.mfu:.1%}, "
                  f"bottleneck {est.bottleneck}")
    fig.suptitle(L.key(), fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
