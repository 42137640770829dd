"""planner_bench's verdicts: a target is met only when every round holds it, a row that
holds it in some rounds only is "not settled", and the fastest step is judged against the
undisturbed prediction ([Note: undisturbed steps] in shardwise/planner/devices/cpu/costs.py)."""

from __future__ import annotations

from bench.planner_report import report, verdict

_MIB = 2 ** 20


def _row(case: str, pred: float, steps: list[float], best_pred: float | None,
         best: list[float]) -> dict:
    p = {"step_time": pred, "layout": "dp_shard 1", "bottleneck": "compute",
         "memory": 10 * _MIB, "kinds": {"states": 10 * _MIB}}
    if best_pred is not None:
        p["best_step_time"] = best_pred
    n = len(steps)
    return {"case": case, "pred": p, "step": steps, "best": best, "cpu": steps,
            "mem": [10 * _MIB] * n, "breakdown": [{"params": 10 * _MIB}] * n,
            "load": [[1.0, 1.0]] * n, "steal": [0.0] * n}


def test_verdict_tells_met_missed_and_unsettled_apart():
    assert verdict([True, True], "time") == "time"
    assert verdict([False, False], "time") == "TIME MISS"
    assert verdict([True, False], "time") == "time not settled"
    assert verdict([], "best") == "BEST MISS"


def test_report_counts_every_round_and_the_undisturbed_steps():
    meta = {"rounds": 2, "seq": 128, "batch": 4, "cores": 2, "calibration_s": 30.0,
            "compose": 1.1, "compose_best": 0.95, "busy": {"2": 1.2}, "busy_best": {"2": 1.05},
            "compose_kernels": 1.6, "compose_kernels_best": 1.5,
            "collective_overhead": 0.00112, "collective_overhead_best": 0.0002,
            "steps_per_model": {"debug": 16}}
    rows = [_row("a", 1.0, [1.0, 1.05], 0.9, [0.92, 0.95]),    # both met
            _row("b", 1.0, [1.0, 1.30], 0.9, [0.70, 0.72]),    # median unsettled, best miss
            _row("c", 1.0, [1.5, 1.60], 0.9, [0.85, 1.20])]    # median miss, best unsettled
    text = report(rows, meta)
    lines = {ln.split(" | ")[0][2:]: ln for ln in text.splitlines() if ln.startswith("| ")}
    assert lines["a"].endswith("| time, best, mem |")
    assert lines["b"].endswith("| time not settled, BEST MISS, mem |")
    assert lines["c"].endswith("| TIME MISS, best not settled, mem |")
    assert ("`compose_best` 0.95 and `busy_best` 1.05 (2 busy), against `compose` 1.1 and "
            "`busy` 1.2 (2 busy)") in text
    assert ("`compose_kernels` 1.6 (best 1.5) and `collective_overhead` 1.12 ms (best "
            "0.2 ms) per collective") in text
    assert "16 (debug) timed steps" in text
    assert "- every round: step time (median) 1 of 3 cases (1 not settled" in text
    assert "every round 1 of 3 (1 not settled; per round 2, 1)" in text
    # a run from before the undisturbed prediction: no best verdict, no best summary
    old = report([_row("a", 1.0, [1.0, 1.05], None, [0.92, 0.95])], {**meta,
                                                                     "compose_best": 0.0})
    assert "| time, mem |" in old and "undisturbed prediction ([Note" not in old
    assert "`compose_best` not measured" in old
    # a run from before the tensor-parallel pairs: their overhead was not measured
    older = report([_row("a", 1.0, [1.0, 1.05], None, [0.92, 0.95])],
                   {k: v for k, v in meta.items() if not k.startswith("collective")})
    assert "`collective_overhead` not measured (best not measured)" in older
