"""Markdown tables of bench/moe_bench.py's results (timing rows and the balance study)."""

from __future__ import annotations

import statistics

__all__ = ["to_markdown", "balance_summary", "LM_TOLERANCE", "TAIL"]

MIB = 2 ** 20
TAIL = 50
"""Steps at the end of the balance study that the summary averages over."""
LM_TOLERANCE = 0.01
"""Nats of LM loss by which bias may exceed aux and still count as "not raised"."""
LABELS = {"dense": "dense `debug` (shardwise)", "sw-ep1": "shardwise, experts replicated",
          "sw-ep2": "shardwise EP 2", "sw-ep4": "shardwise EP 4",
          "ds-ep4": "DeepSpeed-MoE EP 4"}
JOB_EP = {"dense": 1, "sw-ep1": 1, "sw-ep2": 2, "sw-ep4": 4, "ds-ep4": 4}


def _mean(xs) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def balance_summary(run: dict) -> dict:
    """CV and load figures of one balance mode: means over the last :data:`TAIL` steps and
    over all steps (each step's value averaged over the MoE layers)."""
    cv = [_mean(step) for step in run["cv"]]
    load = [_mean(step) for step in run["maxload"]]
    lm = run["lm_loss"]
    return {"cv_tail": _mean(cv[-TAIL:]), "cv_all": _mean(cv), "cv_first": cv[0],
            "maxload_tail": _mean(load[-TAIL:]), "lm_tail": _mean(lm[-TAIL:]),
            "lm_last": lm[-1], "steps": len(lm)}


def _timing_lines(saved: dict) -> list[str]:
    rows = saved["rows"]
    dense = [r["step_s"] for r in rows.get("dense", {}).get("rounds", [])]
    lines = ["| row | step ms, median (per-round range) | vs dense | peak RSS MiB | "
             "all-to-all MiB/step/rank | = formula | all comm MiB/step/rank |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        rounds = row.get("rounds", [])
        if not rounds:
            lines.append(f"| {LABELS.get(name, name)} | did not run: "
                         f"{row.get('error', '?').splitlines()[-1][:120]} | | | | | |")
            continue
        ms = [r["step_s"] * 1e3 for r in rounds]
        vs = (f"{statistics.median(ms) / (statistics.median(dense) * 1e3):.2f}x"
              if dense else "")
        a2a = statistics.median(r["a2a_sent_per_step"] for r in rounds) / MIB
        checked = "yes (asserted)" if rounds[0].get("bytes_checked") else (
            "n/a" if name.startswith("ds") or JOB_EP.get(name, 1) == 1 else "")
        comm = rounds[0].get("comm_sent_per_step")
        lines.append(f"| {LABELS.get(name, name)} | {statistics.median(ms):.0f} "
                     f"({min(ms):.0f}-{max(ms):.0f}) | {vs} | "
                     f"{max(r['rss_peak'] for r in rounds) / MIB:.0f} | {a2a:.2f} | "
                     f"{checked} | {'' if comm is None else f'{comm / MIB:.2f}'} |")
    if any("error" in r for r in rows.values()):
        lines += [""] + [f"* {n} failed in a round: {r['error'].splitlines()[-1][:200]}"
                         for n, r in rows.items() if "error" in r]
    return lines


def _balance_lines(saved: dict) -> list[str]:
    meta, runs = saved["meta"], saved["balance"]
    if not runs:
        return []
    small = meta["small"]
    lines = ["", f"## Load balance over {meta['balance_steps']} steps", "",
             f"`debug-moe` shrunk to dim {small['dim']}, {small['n_layers']} blocks, 8 experts "
             f"of {small['moe_ffn_dim']}, top-2, at ep 4 (4 ranks, ZeRO-1), AdamW lr 1e-3, "
             f"4 x 64 byte tokens per rank and step (2,048 assignments per layer and step); "
             f"aux coefficient 0.01, z-loss 0.001 in every mode; the bias moves by at most "
             f"rate x steps (0.2 at DeepSeek-V3's 0.001 over 200 steps). CV: population "
             f"std / mean of the per-expert counts of the "
             f"global batch, averaged over the layers; 'last {TAIL}': mean over the last "
             f"{TAIL} steps.", "",
             f"| balance | CV step 1 | CV mean, all steps | CV mean, last {TAIL} | "
             f"max / mean load, last {TAIL} | LM loss, last {TAIL} | LM loss, last step |",
             "|---|---|---|---|---|---|---|"]
    summ = {m: balance_summary(r) for m, r in runs.items()}
    for m, s in summ.items():
        lines.append(f"| {m} | {s['cv_first']:.3f} | {s['cv_all']:.3f} | {s['cv_tail']:.3f} "
                     f"| {s['maxload_tail']:.2f} | {s['lm_tail']:.4f} | {s['lm_last']:.4f} |")
    biased = [m for m, r in runs.items() if r.get("mode", m) == "bias"]
    if "aux" in summ and biased:
        a = summ["aux"]
        lines += ["", "Target (issue 13): bias balancing reaches a CV no worse than the aux "
                  f"loss (last {TAIL} steps) without raising the LM loss (last {TAIL} steps, "
                  f"tolerance {LM_TOLERANCE} nats):", ""]
        for m in biased:
            b = summ[m]
            cv_ok = b["cv_tail"] <= a["cv_tail"]
            lm_ok = b["lm_tail"] <= a["lm_tail"] + LM_TOLERANCE
            lines += [f"* {m}: CV {b['cv_tail']:.3f} vs aux {a['cv_tail']:.3f}: "
                      f"{'met' if cv_ok else 'NOT met'}; LM loss {b['lm_tail']:.4f} vs aux "
                      f"{a['lm_tail']:.4f} ({b['lm_tail'] - a['lm_tail']:+.4f}): "
                      f"{'met' if lm_ok else 'NOT met'}"]
    return lines


def to_markdown(saved: dict) -> str:
    """The whole report of one run (``{"meta", "rows", "balance"}`` as moe_bench saves)."""
    meta = saved["meta"]
    sizes = meta["sizes"]
    head = [f"# Mixture of experts on 4 CPU ranks ({meta['date']})", "",
            f"`debug-moe` ({sizes['debug-moe']['params'] / 1e6:.2f}M parameters, "
            f"{sizes['debug-moe']['active'] / 1e6:.2f}M active: 4 blocks, dim 256, 8 experts "
            f"of width 384, top-2) against `debug` ({sizes['debug']['params'] / 1e6:.2f}M, "
            f"feed-forward 768 = the active expert width); {meta['batch']} x {meta['seq']} "
            f"byte tokens per rank, AdamW, ZeRO-1, 4 Gloo ranks of 1 thread on "
            f"{meta['cpus']} shared CPUs (load average {meta['load']} at the end); "
            f"{meta['rounds']} rounds of {meta['steps']} timed steps after {meta['warmup']}. "
            f"Step time: slowest rank, median over steps; peak RSS: largest rank, during the "
            f"timed steps. All-to-all: token bytes each rank sent per step (dispatch and "
            f"combine, forward and backward); for shardwise `comm_stats` under the `ep_*` "
            f"labels, asserted equal to `dispatch_bytes` from every rank's token counts "
            f"(docs/moe.md), the counts exchange excluded; for DeepSpeed counted at "
            f"`all_to_all_single` (every expert padded to the step's largest load).", ""]
    return "\n".join(head + _timing_lines(saved) + _balance_lines(saved)) + "\n"
