"""planner_choice's tables: per job and round, the top against the default and the
brute-force best, the predicted gain against the measured one, and the targets.

A target is met only when every round holds it (the module doc of planner_choice.py).
Beside the verdicts, :func:`over_rounds` pairs the top with the default round by round, as a
noisy machine needs: the median ratio and a one-sided sign test (how likely that many rounds
"no slower" would be if the two layouts were equally fast).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["OUT", "TOL_BEST", "TOL_GAIN", "over_rounds", "round_stats", "sign_test",
           "verdicts", "write"]

OUT = Path(__file__).resolve().parent / "results"
TOL_BEST, TOL_GAIN = 0.10, 0.15
_MIB = 2 ** 20


def _get(layouts: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(x for x in layouts if x["name"] == name)


def round_stats(job: dict[str, Any], rnd: int) -> dict[str, Any]:
    """One round of one job: the measured top, default and fastest fitting layout, their
    ratios and gains (from the fastest steps; medians as ``*_median``), and the targets
    (None where one does not apply: the default over the cap)."""
    lay = job["layouts"]
    top, default = _get(lay, job["top"]), _get(lay, job["default"])
    t, d = top["rounds"][rnd], default["rounds"][rnd]
    ok = [x for x in lay if x["fits"] and "error" not in x["rounds"][rnd]]
    best = min(ok, key=lambda x: x["rounds"][rnd]["best_step_time"])
    b = best["rounds"][rnd]
    pred_gain = default["pred"]["best_step_time"] / top["pred"]["best_step_time"]
    gain = d["best_step_time"] / t["best_step_time"]
    out = {"top": t, "default": d, "best_name": best["name"], "best": b,
           "top_vs_default": t["best_step_time"] / d["best_step_time"],
           "top_vs_default_median": t["step_time"] / d["step_time"],
           "top_vs_best": t["best_step_time"] / b["best_step_time"],
           "top_vs_best_median": t["step_time"] / min(
               x["rounds"][rnd]["step_time"] for x in ok),
           "pred_gain": pred_gain, "gain": gain,
           "pred_gain_median": default["pred"]["step_time"] / top["pred"]["step_time"],
           "gain_median": d["step_time"] / t["step_time"],
           # CPU seconds a step: what each layout costs the shared cores whatever the others'
           # jobs do to the wall clock (a pipeline's bubbles are idle, not counted)
           "top_vs_default_cpu": t["cpu_step_time"] / d["cpu_step_time"],
           "top_vs_best_cpu": t["cpu_step_time"] / min(
               x["rounds"][rnd]["cpu_step_time"] for x in ok)}
    out["no_slower"] = out["top_vs_default"] <= 1.0 if default["fits"] else None
    out["within_best"] = out["top_vs_best"] <= 1 + TOL_BEST
    out["gain_within"] = abs(pred_gain / gain - 1) <= TOL_GAIN
    return out


def verdicts(job: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each target holds in every round (None: not applicable)."""
    n = len(job["layouts"][0]["rounds"])
    stats = [round_stats(job, r) for r in range(n)]
    out: dict[str, bool | None] = {}
    for key in ("no_slower", "within_best", "gain_within"):
        vals = [s[key] for s in stats]
        out[key] = None if any(v is None for v in vals) else all(vals)
    return out


def sign_test(wins: int, n: int) -> float:
    """P(at least ``wins`` of ``n`` fair coin flips): one-sided sign test."""
    return sum(math.comb(n, i) for i in range(wins, n + 1)) / 2 ** n


def over_rounds(job: dict[str, Any]) -> dict[str, Any]:
    """The rounds of one job taken together: medians of the per-round ratios (the top and
    the default of a round ran back to back: a pair), how many rounds held each target, and
    the sign test of "no slower" (None where the default is over the cap)."""
    n = len(job["layouts"][0]["rounds"])
    stats = [round_stats(job, r) for r in range(n)]

    def median(key: str) -> float:
        vals = sorted(s[key] for s in stats)
        return (vals[(n - 1) // 2] + vals[n // 2]) / 2

    wins = [s["no_slower"] for s in stats]
    judged = None not in wins
    gain = median("gain")
    return {"rounds": n, "top_vs_default": median("top_vs_default"),
            "top_vs_best": median("top_vs_best"), "pred_gain": stats[0]["pred_gain"],
            "gain": gain, "no_slower": sum(wins) if judged else None,
            "p_sign": sign_test(sum(wins), n) if judged else None,
            "within_best": sum(s["within_best"] for s in stats),
            "gain_within": sum(s["gain_within"] for s in stats),
            "median_gain_within": abs(stats[0]["pred_gain"] / gain - 1) <= TOL_GAIN}


def _over_rounds_table(data: dict[str, Any]) -> list[str]:
    out = ["| job | rounds | top/default: median, rounds no slower (sign test p) | top/best: "
           "median, rounds within 10% | gain predicted : median measured (within 15%) |",
           "| --- | ---: | --- | --- | --- |"]
    for j in data["jobs"]:
        o = over_rounds(j)
        slower = "n/a (default over the cap)" if o["no_slower"] is None else (
            f"{o['top_vs_default']:.3f}, {o['no_slower']} of {o['rounds']} "
            f"(p = {o['p_sign']:.3f})")
        out.append(f"| {j['job']} | {o['rounds']} | {slower} | {o['top_vs_best']:.3f}, "
                   f"{o['within_best']} of {o['rounds']} | {o['pred_gain']:.3f} : "
                   f"{o['gain']:.3f} ({_mark(o['median_gain_within'])}) |")
    return out


def _mark(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else math.nan


def _jobs_table(data: dict[str, Any]) -> list[str]:
    out = ["| job | cap MiB | top (plan auto) | predicted s (fastest) | default | predicted s "
           "(fastest) | default fits | default measured + allowances MiB | brute force: "
           "layouts, screened | screen rank corr. |",
           "| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for j in data["jobs"]:
        top, d = _get(j["layouts"], j["top"]), _get(j["layouts"], j["default"])
        allow = d["pred"]["memory"] - d["pred"]["measured_kinds"]
        meas = [r["memory"] + allow for r in d["rounds"] if "memory" in r]
        cap = "-" if j["cap_bytes"] is None else f"{j['cap_bytes'] / _MIB:.1f}"
        scr = [r for r in j["screen"] if "error" not in r]
        corr = _spearman([r.get("pred_best", math.nan) for r in scr],
                         [r["best_step_time"] for r in scr]) if scr and "pred_best" in scr[0] \
            else math.nan
        out.append(f"| {j['job']} | {cap} | {j['top']} | {top['pred']['best_step_time']:.3f} | "
                   f"{j['default']} | {d['pred']['best_step_time']:.3f} | "
                   f"{'yes' if d['fits'] else 'NO'} | "
                   f"{max(meas) / _MIB if meas else math.nan:.1f} | "
                   f"{j['brute_force_size']}, {len(j['screen'])} | {corr:.2f} |")
    return out


def _load(job: dict[str, Any], rnd: int) -> str:
    """The load average as the round's layouts started (``-``: not recorded)."""
    loads = [x["rounds"][rnd]["load"] for x in job["layouts"] if "load" in x["rounds"][rnd]]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def _rounds_table(data: dict[str, Any]) -> list[str]:
    out = ["| job | round | top s: best / median / CPU | default s: best / median / CPU | "
           "brute-force best (fastest step s) | top/default | top/best | gain predicted : "
           "measured | no slower | within 10% | gain within 15% | CPU s: top/default, "
           "top/least | load |",
           "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- | ---: "
           "| ---: |"]
    for j in data["jobs"]:
        for r in range(len(j["layouts"][0]["rounds"])):
            s = round_stats(j, r)
            t, d = s["top"], s["default"]
            out.append(
                f"| {j['job']} | {r + 1} | {t['best_step_time']:.3f} / {t['step_time']:.3f} / "
                f"{t['cpu_step_time']:.3f} | {d['best_step_time']:.3f} / {d['step_time']:.3f} / "
                f"{d['cpu_step_time']:.3f} | {s['best_name']} ({s['best']['best_step_time']:.3f}) "
                f"| {s['top_vs_default']:.3f} | {s['top_vs_best']:.3f} | "
                f"{s['pred_gain']:.3f} : {s['gain']:.3f} | {_mark(s['no_slower'])} | "
                f"{_mark(s['within_best'])} | {_mark(s['gain_within'])} | "
                f"{s['top_vs_default_cpu']:.2f}, {s['top_vs_best_cpu']:.2f} | {_load(j, r)} |")
    return out


def _layouts_table(data: dict[str, Any]) -> list[str]:
    out = ["| job | layout | role | predicted s: median / fastest | measured fastest s "
           "(rounds) | measured median s (rounds) | memory MiB: predicted (cap's) : measured "
           "+ allowances |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for j in data["jobs"]:
        for x in j["layouts"]:
            role = ("top" if x["name"] == j["top"] else "default" if x["name"] == j["default"]
                    else "finalist") + ("" if x["fits"] else ", over cap")
            ok = [r for r in x["rounds"] if "error" not in r]
            allow = x["pred"]["memory"] - x["pred"]["measured_kinds"]
            mem = max((r["memory"] for r in ok), default=math.nan) + allow
            out.append(f"| {j['job']} | {x['name']} | {role} | {x['pred']['step_time']:.3f} / "
                       f"{x['pred']['best_step_time']:.3f} | "
                       + ", ".join(f"{r['best_step_time']:.3f}" for r in ok) + " | "
                       + ", ".join(f"{r['step_time']:.3f}" for r in ok) + f" | "
                       f"{x['pred']['memory'] / _MIB:.1f} : {mem / _MIB:.1f} |")
    return out


def _screen_table(data: dict[str, Any]) -> list[str]:
    out = ["| job | screened | fastest three screened (fastest step s : predicted) | top's "
           "screen s (rank) | predicted rank of the fastest | memory error, largest |",
           "| --- | ---: | --- | ---: | ---: | ---: |"]
    for j in data["jobs"]:
        scr = sorted((r for r in j["screen"] if "error" not in r),
                     key=lambda r: r["best_step_time"])
        if not scr:
            continue
        fast = "; ".join(f"{r['name']} ({r['best_step_time']:.3f} : {r['pred_best']:.3f})"
                         for r in scr[:3])
        names = [r["name"] for r in scr]
        top = (f"{scr[names.index(j['top'])]['best_step_time']:.3f} "
               f"({names.index(j['top']) + 1})" if j["top"] in names else "-")
        by_pred = sorted(scr, key=lambda r: r["pred_best"])
        errs = [r["pred_kinds"] / r["memory"] - 1 for r in scr if "pred_kinds" in r]
        err = f"{max(errs, key=abs):+.1%}" if errs else "-"
        out.append(f"| {j['job']} | {len(scr)} of {j['brute_force_size']} | {fast} | {top} | "
                   f"{by_pred.index(scr[0]) + 1} | {err} |")
    return out


def write(data: dict[str, Any], out: Path = OUT) -> str:
    """Write ``planner_choice.json`` and ``.md`` under ``out``; return the markdown."""
    m = data["meta"]
    lines = ["# The planner's choice, measured (bench/planner_choice.py)", "",
             f"`{m['command']}`: {m['rounds']} rounds, {len(data['jobs'])} jobs, "
             f"{m['duration_s'] / 60:.1f} min (calibration {m['calibration_s']:.0f} s). Times "
             "are the slowest rank's; 'best' is the fastest step of a layout in a round. The "
             "targets are judged on the fastest steps against the undisturbed prediction; "
             "every round must hold them.", "", "## Jobs", ""]
    lines += _jobs_table(data) + ["", "## Rounds", ""] + _rounds_table(data)
    lines += ["", "## Verdicts (every round)", "", "| job | no slower than default | within "
              "10% of the best | predicted gain within 15% |", "| --- | --- | --- | --- |"]
    for j in data["jobs"]:
        v = verdicts(j)
        lines.append(f"| {j['job']} | {_mark(v['no_slower'])} | {_mark(v['within_best'])} | "
                     f"{_mark(v['gain_within'])} |")
    lines += ["", "## Over the rounds (medians of the per-round ratios; a sign test)", "",
              "Not the targets (those need every round): how the top and the default compare "
              "when each round is one pair of back-to-back runs. p is the chance of that many "
              "rounds no slower if the two were equally fast.", ""] + _over_rounds_table(data)
    lines += ["", "## Every layout of the rounds", ""] + _layouts_table(data)
    lines += ["", "## The screen (brute force, once: a warm-up step and the screen's timed "
              "steps)", ""] + _screen_table(data)
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_choice.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "planner_choice.md").write_text(text)
    return text
