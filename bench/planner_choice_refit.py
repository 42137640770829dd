"""Re-predict every layout ``bench/planner_choice.py`` measured, with the cost model as it
is now, against the committed measurements: how a change to the CPU device model would
have ranked and priced what ran, without running anything.

    python bench/planner_choice_refit.py                 # every job, a table
    python bench/planner_choice_refit.py --json out.json --layouts "debug x4"

Reads ``bench/results/planner_choice.json`` (its calibration, from its ``meta``; every
layout of the screen and of the rounds). Per job, over the layouts measured:

* **rank corr.**: Spearman's correlation of the predicted and measured fastest steps (a
  layout measured in the rounds and the screen counts its fastest step);
* **median |err|**: of the predicted fastest step (the undisturbed prediction, [Note:
  undisturbed steps]) against the measured one;
* **spread**: the median distance of a layout's measured-over-predicted ratio from the
  job's median ratio (what ranks and gains depend on: a machine uniformly slower than its
  calibration moves the error, not the spread);
* **top**: what ``--parallel.plan auto`` would build now (``rank_layouts``' first) and its
  measured rank among the job's fitting measured layouts; a top never measured is stood
  in for by the measured layout that differs only in its ZeRO stage, if any (``-``:
  none);
* **gain**: the default's prediction over the top's, against each round's measured gain
  (the default's fastest step over the top's; the screen's where the top was not in the
  rounds).

The committed predictions (``pred_best``) are reported beside for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import planner_choice_space as space  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "planner_choice.json"

__all__ = ["measured_layouts", "sibling", "spearman", "refit_job", "main"]


def measured_layouts(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every layout of a job's record that ran: name -> its layout, fastest steps (screen
    and rounds), whether it fits the cap as committed, and the committed prediction."""
    out: dict[str, dict[str, Any]] = {}
    for s in job["screen"]:
        if "best_step_time" in s:
            out[s["name"]] = {"layout": s["layout"], "screen": s["best_step_time"],
                              "rounds": [], "fits": True, "was": s["pred_best"]}
    for x in job["layouts"]:
        got = [r["best_step_time"] for r in x["rounds"] if "best_step_time" in r]
        if not got:
            continue
        e = out.setdefault(x["name"], {"layout": x["layout"], "screen": None,
                                       "was": x["pred"]["best_step_time"]})
        e.update(rounds=got, fits=x["fits"])
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def sibling(L, rows: dict[str, dict[str, Any]]) -> str | None:
    """The measured layout that differs from ``L`` only in its ZeRO stage (the nearest
    stage), standing in for an ``L`` that was never measured; None if there is none."""
    want = {k: v for k, v in L.as_dict().items() if k != "zero"}
    same = [(abs(e["layout"]["zero"] - L.zero), n) for n, e in rows.items()
            if {k: v for k, v in e["layout"].items() if k != "zero"} == want]
    return min(same)[1] if same else None


def _best(e: dict[str, Any]) -> float:
    return min(e["rounds"] + ([e["screen"]] if e["screen"] is not None else []))


def refit_job(job: dict[str, Any], hw0) -> dict[str, Any]:
    """One job's figures (see the module's docstring) with the cost model as it is now."""
    from bench.planner_choice import predict

    spec = next(j for j in space.JOBS if j.name == job["job"])
    hw = space.capped(hw0, job["cap_bytes"])
    rows = measured_layouts(job)
    for e in rows.values():
        e["pred"] = predict(spec, space.layout_from(e["layout"]), hw)["best_step_time"]
        e["best"] = _best(e)
    names = list(rows)
    fitting = sorted((n for n in names if rows[n]["fits"]), key=lambda n: rows[n]["best"])
    top_layout = space.top_layout(spec, hw)
    top, default = space.name_of(top_layout), job["default"]
    stand_in = top if top in rows else sibling(top_layout, rows)
    out: dict[str, Any] = {"job": job["job"], "layouts": len(names), "top": top,
                           "stand_in": stand_in,
                           "top_measured_rank": fitting.index(stand_in) + 1
                           if stand_in in fitting else None,
                           "fitting": len(fitting), "was_top": job["top"]}
    for key, pred in (("now", "pred"), ("was", "was")):
        p = [rows[n][pred] for n in names]
        m = [rows[n]["best"] for n in names]
        ratio = [y / x for x, y in zip(p, m, strict=True)]
        mid = statistics.median(ratio)
        out[key] = {"rank_corr": spearman(p, m),
                    "median_abs_err": statistics.median(abs(1 / r - 1) for r in ratio),
                    "spread": statistics.median(abs(r / mid - 1) for r in ratio)}
    out["was"]["gain"] = rows[default]["was"] / rows[job["top"]]["was"]
    if stand_in is not None and default in rows:
        t, d = rows[stand_in], rows[default]
        out["now"]["gain"] = d["pred"] / predict(spec, top_layout, hw)["best_step_time"]
        if t["rounds"] and len(t["rounds"]) == len(d["rounds"]):
            out["measured_gain"] = [x / y for x, y in zip(d["rounds"], t["rounds"], strict=True)]
        else:
            out["measured_gain"] = [_best(d) / _best(t)]
    out["rows"] = {n: {k: rows[n][k] for k in ("pred", "was", "best", "fits")} for n in names}
    return out


def _table(res: list[dict[str, Any]]) -> str:
    head = ("| job | layouts | rank corr. was : now | median abs err was : now | spread was : "
            "now | top now (measured rank of fitting) | predicted gain was : now | measured "
            "gain |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in res:
        was, now = r["was"], r["now"]
        rank = f"{r['top_measured_rank']} of {r['fitting']}" if r["top_measured_rank"] else "-"
        if r["stand_in"] not in (None, r["top"]):
            rank += ", as its measured sibling at another ZeRO stage"
        gain = f"{now['gain']:.3f}" if "gain" in now else "-"
        meas = ", ".join(f"{g:.3f}" for g in r.get("measured_gain", []))
        same = "" if r["top"] == r["was_top"] else " (changed)"
        lines.append(f"| {r['job']} | {r['layouts']} | {was['rank_corr']:.2f} : "
                     f"{now['rank_corr']:.2f} | {was['median_abs_err']:.1%} : "
                     f"{now['median_abs_err']:.1%} | {was['spread']:.1%} : "
                     f"{now['spread']:.1%} | {r['top']}{same} ({rank}) | "
                     f"{was['gain']:.3f} : {gain} | {meas or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module's docstring."""
    from shardwise.planner.hardware import get_hardware

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(RESULTS),
                   help="planner_choice's json (default: the committed one)")
    p.add_argument("--only", action="append", help="a job's name (repeatable)")
    p.add_argument("--layouts", action="append", default=[],
                   help="also list every layout of this job (repeatable)")
    p.add_argument("--calibration", help="price with this calibration file (a toml, or a "
                   "bench json whose meta holds one) instead of the results' own")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    text = data["meta"]["calibration"]
    if args.calibration:
        text = Path(args.calibration).read_text()
        if args.calibration.endswith(".json"):
            text = json.loads(text)["meta"]["calibration"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    hw0 = get_hardware("local", calibration=f.name)
    res = [refit_job(j, hw0) for j in data["jobs"] if not args.only or j["job"] in args.only]
    print(_table(res))
    for r in res:
        if r["job"] in args.layouts:
            print(f"\n{r['job']}: predicted now / committed / measured fastest (s)")
            for n, x in sorted(r["rows"].items(), key=lambda kv: kv[1]["pred"]):
                print(f"  {x['pred']:.3f} / {x['was']:.3f} / {x['best']:.3f}  {n}"
                      + ("" if x["fits"] else "  (over cap)"))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
