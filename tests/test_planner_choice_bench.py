"""bench/planner_choice.py: a tiny run measures what its table says (one job, 2 ranks, one
round), its ratios come from those measurements, and the search fix it found holds.

The calibration is the one committed with planner_bench's run (no micro-benchmarks here).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import planner_choice, planner_choice_report, planner_choice_space  # noqa: E402

search_mod = importlib.import_module("shardwise.planner.search")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    meta = json.loads((ROOT / "bench/results/planner_bench.json").read_text())["meta"]
    path = tmp_path_factory.mktemp("cal") / "calibration.toml"
    path.write_text(meta["calibration"])
    return path


@pytest.fixture(scope="module")
def tiny(calibration, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("choice")
    planner_choice.main(["--only", "debug x2", "--rounds", "1", "--steps", "1",
                         "--screen-steps", "1", "--screen-max", "2", "--finalists", "1",
                         "--calibration", str(calibration), "--out", str(out)])
    data = json.loads((out / "planner_choice.json").read_text())
    return {"data": data, "md": (out / "planner_choice.md").read_text()}


def test_every_layout_was_measured(tiny):
    (job,) = tiny["data"]["jobs"]
    assert job["job"] == "debug x2" and job["cap_bytes"] is None
    assert len(job["screen"]) == 2 and job["brute_force_size"] > 2
    for row in job["screen"]:
        assert row["best_step_time"] > 0 and row["memory"] > 0
    names = [x["name"] for x in job["layouts"]]
    assert job["top"] in names and job["default"] in names
    assert 2 <= len(names) <= 3  # top, default, and the fastest screened one unless it is one
    for x in job["layouts"]:
        (r,) = x["rounds"]  # one round, every layout measured in it
        assert "error" not in r, r
        assert 0 < r["best_step_time"] <= r["step_time"] and r["cpu_step_time"] > 0
        assert r["memory"] > 0 and x["pred"]["step_time"] > 0


def test_ratios_come_from_the_measurements(tiny):
    (job,) = tiny["data"]["jobs"]
    s = planner_choice_report.round_stats(job, 0)
    by = {x["name"]: x["rounds"][0] for x in job["layouts"]}
    top, default = by[job["top"]], by[job["default"]]
    assert s["top_vs_default"] == pytest.approx(top["best_step_time"]
                                                / default["best_step_time"])
    fastest = min(r["best_step_time"] for r in by.values())  # no cap: all fit
    assert s["best"]["best_step_time"] == fastest
    assert s["top_vs_best"] == pytest.approx(top["best_step_time"] / fastest)
    assert s["gain"] == pytest.approx(1 / s["top_vs_default"])
    assert s["no_slower"] == (s["top_vs_default"] <= 1.0)
    assert f"| {job['job']} | 1 | {top['best_step_time']:.3f}" in tiny["md"]


def test_default_over_the_cap_is_not_judged():
    def lay(name, fits, best, pred):
        return {"name": name, "fits": fits, "pred": {"step_time": pred, "best_step_time": pred},
                "rounds": [{"step_time": best * 1.1, "best_step_time": best,
                            "cpu_step_time": best}]}
    job = {"top": "a", "default": "b",
           "layouts": [lay("a", True, 0.30, 0.3), lay("b", False, 0.20, 0.2),
                       lay("c", True, 0.25, 0.28)]}
    s = planner_choice_report.round_stats(job, 0)
    assert s["no_slower"] is None and s["best_name"] == "c"  # the default does not fit
    assert s["top_vs_best"] == pytest.approx(0.30 / 0.25) and not s["within_best"]
    assert planner_choice_report.verdicts(job) == {"no_slower": None, "within_best": False,
                                                   "gain_within": True}


def test_search_prices_exactly_a_pipeline_the_closed_form_rejects(calibration):
    """[Note: pipelines that fit exactly]: ZB-V's closed form counts more in-flight
    activations than its simulated schedule; capped between the two, the search keeps it."""
    from shardwise.planner.cost_model import CostModel
    from shardwise.planner.hardware import get_hardware
    from shardwise.planner.parallel_layout import Layout
    from shardwise.train import plan_layout
    from shardwise.train.preflight import build_model_config

    job = planner_choice_space.Job("debug", 2, True)
    cfg = planner_choice_space.job_config(job)
    spec, hw, wl = plan_layout.planner_inputs(cfg, build_model_config(cfg),
                                              get_hardware("local", calibration=calibration))
    L = Layout(dp_shard=1, pp=2, pp_schedule="zbv", pp_virtual=2, zero=0, microbatch=4,
               pp_microbatches=2)
    cm = CostModel(spec, hw, wl)
    closed, exact = cm.estimate(L).memory, cm.estimate(L, exact=True).memory
    assert closed.total > exact.total and closed.total - closed.activations < exact.total
    capped = hw.replace(hbm_bytes=(closed.total + exact.total) / 2)
    ranked = search_mod.search(spec, capped, wl, 2, plan_layout.plan_constraints(cfg)).ranked
    assert any(e.layout == L and e.fits for e in ranked)


def test_over_the_rounds_pairs_top_and_default_round_by_round():
    def lay(name, fits, pred, bests):
        return {"name": name, "fits": fits, "pred": {"step_time": pred, "best_step_time": pred},
                "rounds": [{"step_time": b, "best_step_time": b, "cpu_step_time": b}
                           for b in bests]}
    top = lay("a", True, 0.20, [0.30, 0.21, 0.19, 0.25])
    job = {"top": "a", "default": "b",
           "layouts": [top, lay("b", True, 0.25, [0.28, 0.24, 0.22, 0.30])]}
    o = planner_choice_report.over_rounds(job)
    # per round top/default: 1.071, 0.875, 0.864, 0.833 -> 3 of 4 no slower
    assert o["rounds"] == 4 and o["no_slower"] == 3
    assert o["top_vs_default"] == pytest.approx((0.21 / 0.24 + 0.19 / 0.22) / 2)
    assert o["p_sign"] == pytest.approx(5 / 16)  # P(>= 3 of 4 fair flips)
    assert o["gain"] == pytest.approx((0.24 / 0.21 + 0.22 / 0.19) / 2)
    assert o["median_gain_within"]  # predicted 1.25 against about 1.15
    job["layouts"][1]["fits"] = False  # the default over the cap: nothing to pair
    assert planner_choice_report.over_rounds(job)["p_sign"] is None
    assert planner_choice_report.sign_test(3, 3) == 0.125
    assert planner_choice_report.sign_test(0, 5) == 1.0
