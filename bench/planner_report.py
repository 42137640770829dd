"""planner_bench's tables: predictions against the rounds' measurements, and the refit.

A target is met only when every round holds it; the per-round counts and the load averages
(``os.getloadavg()`` at the start of each case) are printed with the tables.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["OUT", "FIT_CASES", "FIT_PARAMS", "write_results", "report", "refit", "refit_report",
           "verdict"]

OUT = Path(__file__).resolve().parent / "results"
_MIB = 2 ** 20
STEP_TOL, MEM_TOL = 0.15, 0.10
FIT_CASES = ("debug x1 stage 0", "small x1 stage 0", "debug x2 stage 0")
"""Rows the refit of the second table learns from: one rank (compute alone, two widths) and
two data-parallel ranks (the same compute with both cores busy: ``cpu_busy``); the other
rows are judged with the refitted constants."""
FIT_PARAMS = ("matmul_max", "memory_efficiency", "cpu_busy")
_KINDS = (("states", ("params", "grads", "optimizer")), ("whole_grads", ("whole_grads",)),
          ("transient", ("transient",)), ("activations", ("activations",)))


def _err(pred: float, meas: list[float]) -> list[float]:
    return [pred / m - 1 for m in meas]


def _ok(pred: float, meas: list[float], tol: float) -> list[bool]:
    return [abs(e) <= tol for e in _err(pred, meas)]


def _span(values: list[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def _espan(e: list[float], fmt: str = "+.0%") -> str:
    return f"{min(e):{fmt}}..{max(e):{fmt}}"


def _factor(x) -> str:
    """A calibration factor, or a ``{processes: factor}`` table, for the header."""
    if isinstance(x, dict):
        return ", ".join(f"{v:.3g} ({k} busy)" for k, v in x.items()) or "not measured"
    return f"{x:.3g}" if x else "not measured"


def _ms(x) -> str:
    """A calibration time in seconds, for the header in ms."""
    return f"{x * 1e3:.3g} ms" if x is not None else "not measured"


def _kinds(r: dict[str, Any]) -> str:
    b, k = r["breakdown"][0], r["pred"]["kinds"]
    meas = {name: sum(b.get(x, 0) for x in parts) for name, parts in _KINDS}
    return " / ".join(f"{k.get(x, 0) / _MIB:.1f} : {meas[x] / _MIB:.1f}" for x in meas)


def _loads(r: dict[str, Any]) -> str:
    loads = ", ".join(f"{a:.1f}" for a, _ in r.get("load", []))
    steal = [s for s in r.get("steal", []) if s is not None]
    return loads + (" (steal " + ", ".join(f"{s:.0%}" for s in steal) + ")" if steal else "")


def verdict(oks: list[bool], name: str) -> str:
    """``name`` when every round holds the target, ``NAME MISS`` when none does, and
    ``name not settled`` when the rounds straddle it (more rounds would decide)."""
    if oks and all(oks):
        return name
    return f"{name.upper()} MISS" if not any(oks) else f"{name} not settled"


def _best_cells(r: dict[str, Any]) -> tuple[str, str, list[bool]]:
    """(undisturbed prediction, its error against the best steps, per-round targets)."""
    pb = r["pred"].get("best_step_time")
    if pb is None:  # a run from before the undisturbed prediction
        return "-", "-", []
    return f"{pb:.3f}", _espan(_err(pb, r["best"])), _ok(pb, r["best"], STEP_TOL)


def _row(r: dict[str, Any]) -> str:
    p = r["pred"]
    ok_t, ok_m = _ok(p["step_time"], r["step"], STEP_TOL), _ok(p["memory"], r["mem"], MEM_TOL)
    pb, eb, ok_b = _best_cells(r)
    marks = [verdict(ok_t, "time"), verdict(ok_b, "best") if ok_b else None,
             verdict(ok_m, "mem")]
    return (f"| {r['case']} | {p['layout']} | {p['bottleneck']} | {p['step_time']:.3f} | "
            f"{_span(r['step'])} | {_espan(_err(p['step_time'], r['step']))} | "
            f"{pb} | {_span(r['best'])} | {eb} | {_span(r['cpu'])} | "
            f"{_espan(_err(p['step_time'], r['cpu']))} | {p['memory'] / _MIB:.1f} | "
            f"{_span([m / _MIB for m in r['mem']], '.1f')} | "
            f"{_espan(_err(p['memory'], r['mem']), '+.1%')} | {_kinds(r)} | {_loads(r)} | "
            f"{', '.join(m for m in marks if m)} |")


def _summary(rows: list[dict[str, Any]], rounds: int) -> list[str]:
    lines = []
    for i in range(rounds):
        t = sum(_ok(r["pred"]["step_time"], r["step"][i:i + 1], STEP_TOL)[0] for r in rows)
        m = sum(_ok(r["pred"]["memory"], r["mem"][i:i + 1], MEM_TOL)[0] for r in rows)
        loads = [a for r in rows for a, _ in r.get("load", [])[i:i + 1]]
        lines.append(f"- round {i + 1} (load average {_span(loads, '.2f')}): step time "
                     f"{t} of {len(rows)}, memory {m} of {len(rows)}")
    oks = [_ok(r["pred"]["step_time"], r["step"], STEP_TOL) for r in rows]
    t, unsettled = sum(all(o) for o in oks), sum(any(o) and not all(o) for o in oks)
    c = sum(all(_ok(r["pred"]["step_time"], r["cpu"], STEP_TOL)) for r in rows)
    m = sum(all(_ok(r["pred"]["memory"], r["mem"], MEM_TOL)) for r in rows)
    lines.append(f"- every round: step time (median) {t} of {len(rows)} cases ({unsettled} "
                 f"not settled: within in some rounds only; CPU time per step: {c}), memory "
                 f"{m} of {len(rows)}")
    best = [_best_cells(r)[2] for r in rows]
    if all(best):
        per_round = ", ".join(f"{sum(o[i] for o in best)}" for i in range(rounds))
        lines.append(f"- fastest step against the undisturbed prediction ([Note: undisturbed "
                     f"steps]): every round {sum(all(o) for o in best)} of {len(rows)} "
                     f"({sum(any(o) and not all(o) for o in best)} not settled; per round "
                     f"{per_round})")
    return lines


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table: prediction, measured per round (range), error per round."""
    steps = meta.get("steps")
    by_model = meta.get("steps_per_model", {"debug": 8, "small": 5})  # older runs: 8 / 5
    per_model = " / ".join(f"{n} ({m})" for m, n in by_model.items()) + " timed steps"
    lines = [
        "# Planner predictions against the trainer on CPU ranks",
        "",
        f"`python bench/planner_bench.py` ({meta['rounds']} rounds, seq {meta['seq']}, "
        f"batch {meta['batch']} sequences per data rank, one thread per rank, "
        f"{meta['cores']} cores; "
        f"{'%d timed steps per case' % steps if steps else per_model}"
        f"; calibration {meta['calibration_s']:.0f} s, whole run "
        f"{meta.get('duration_s', 0) / 60:.0f} min). Error = predicted / measured - 1, per "
        f"round; targets: step time (the median step, wall clock) within +-15%, memory "
        f"within +-10%, in every round (a row within in some rounds only is \"not "
        f"settled\"). The fastest step is compared with the undisturbed prediction (the "
        f"layers priced at the calibration blocks' fastest calls, `compose_best` "
        f"{_factor(meta.get('compose_best'))} and `busy_best` "
        f"{_factor(meta.get('busy_best'))}, against `compose` "
        f"{_factor(meta.get('compose'))} and `busy` {_factor(meta.get('busy'))} for the "
        f"median; the kernels' factor `compose_kernels` "
        f"{_factor(meta.get('compose_kernels'))} (best "
        f"{_factor(meta.get('compose_kernels_best'))}) and `collective_overhead` "
        f"{_ms(meta.get('collective_overhead'))} (best "
        f"{_ms(meta.get('collective_overhead_best'))}) per collective between a block's "
        f"operators). Load = `os.getloadavg()` (1 min) when each round's "
        f"case started; steal = the share of the machine's CPU time the hypervisor gave "
        f"other guests while it ran (`/proc/stat`)."
        + (" Predictions made again from the run's calibration by a later planner "
           "(`--report-only --repredict`)." if meta.get("repredicted") else ""),
        "",
        "| case | layout | bottleneck | step predicted s | measured s (rounds) | error | "
        "undisturbed predicted s | best step s | error | CPU s/step | error | memory "
        "predicted MiB | measured MiB | error | states / whole grads / transient / "
        "activations MiB, predicted : measured (round 1) | load | within |",
        "| " + " | ".join(["---"] * 17) + " |"]
    lines += [_row(r) for r in rows]
    lines += ["", "Within target:", *_summary(rows, meta["rounds"]), ""]
    return "\n".join(lines)


def refit(rows: list[dict[str, Any]], hw, inputs: list[tuple]) -> tuple[Any, list[float]]:
    """What ``--parallel.plan auto`` does with measurements: refit FIT_PARAMS to the
    FIT_CASES' measured step times (median over rounds), then predict every row again.
    ``inputs``: each row's (spec, workload, layout). Returns (the device, the predictions
    in row order)."""
    from shardwise.planner.calibrate import StepMeasurement, calibrate
    from shardwise.planner.cost_model import CostModel

    ms = [StepMeasurement(*inputs[i], statistics.median(r["step"]))
          for i, r in enumerate(rows) if r["case"] in FIT_CASES]
    if not ms:
        return hw, [r["pred"]["step_time"] for r in rows]
    fitted, _ = calibrate(ms, hw, params=FIT_PARAMS)
    return fitted, [CostModel(spec, fitted, wl).estimate(L, exact=True).step_time
                    for spec, wl, L in inputs]


def _busy(hw) -> float:
    return hw.cpu.contention(hw.cores, hw.cores) if hw.cpu is not None and hw.cores else 1.0


def refit_report(rows: list[dict[str, Any]], fitted, preds: list[float]) -> str:
    """The second table: step times predicted after the refit, against the medians."""
    lines = ["## After refitting to measured steps", "",
             f"`matmul_max`, `memory_efficiency` and `cpu_busy` refit (planner.calibrate, "
             f"as `--parallel.plan auto` does) to the median step times of "
             f"{', '.join(FIT_CASES)}, along the combinations of the three the "
             f"measurements determine ([Note: identified directions] in "
             f"shardwise/planner/calibrate/fit.py): matmul_max {fitted.matmul_max:.3g}, "
             f"memory_efficiency {fitted.memory_efficiency:.3g}, cpu_busy "
             f"{_busy(fitted):.3g}. The other rows are held out.",
             "", "| case | fit on | step predicted s | measured s (rounds) | error | within |",
             "| --- | --- | --- | --- | --- | --- |"]
    ok = n = 0
    for r, p in zip(rows, preds, strict=True):
        good = all(_ok(p, r["step"], STEP_TOL))
        held = r["case"] not in FIT_CASES
        ok, n = ok + (good and held), n + held
        lines.append(f"| {r['case']} | {'no' if held else 'yes'} | {p:.3f} | "
                     f"{_span(r['step'])} | {_espan(_err(p, r['step']))} | "
                     f"{'yes' if good else 'MISS'} |")
    lines += ["", f"Held-out rows within +-15% in every round: {ok} of {n}.", ""]
    return "\n".join(lines)


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], hw, inputs: list[tuple],
                  out: Path = OUT) -> str:
    """Refit, then write ``out``/planner_bench.{md,json}; returns the markdown."""
    text = report(rows, meta)
    if any(r["case"] in FIT_CASES for r in rows):  # a run of some rows (--only) may have none
        fitted, preds = refit(rows, hw, inputs)
        for r, p in zip(rows, preds, strict=True):
            r["refit_step_time"] = p
        meta["refit"] = {"cases": list(FIT_CASES), "matmul_max": fitted.matmul_max,
                         "memory_efficiency": fitted.memory_efficiency,
                         "cpu_busy": _busy(fitted)}
        text += "\n" + refit_report(rows, fitted, preds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_bench.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                       indent=1) + "\n")
    (out / "planner_bench.md").write_text(text)
    return text
