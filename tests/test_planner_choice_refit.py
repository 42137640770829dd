"""bench/planner_choice_refit.py: the committed planner_choice measurements re-predicted
with the cost model as it is, offline (nothing is run).

The 4-rank debug job is the one whose predicted gain missed (1.33 predicted, 1.09-1.14
measured): its ZeRO-3 default was charged its collectives' waiting, which on 4 ranks over
2 cores is other ranks' compute ([Note: waiting beyond the cores] in
shardwise/planner/devices/cpu/step.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import planner_choice_refit as refit  # noqa: E402
from bench import planner_choice_space as space  # noqa: E402

RESULTS = json.loads(refit.RESULTS.read_text())


@pytest.fixture(scope="module")
def hw(tmp_path_factory):
    from shardwise.planner.hardware import get_hardware

    path = tmp_path_factory.mktemp("cal") / "calibration.toml"
    path.write_text(RESULTS["meta"]["calibration"])
    return get_hardware("local", calibration=str(path))


def _job(name: str) -> dict:
    return next(j for j in RESULTS["jobs"] if j["job"] == name)


def test_spearman_ranks_with_ties():
    assert refit.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert refit.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert refit.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)


def test_measured_layouts_keep_every_run_and_the_fastest_step():
    job = _job("debug x4")
    rows = refit.measured_layouts(job)
    top = rows[job["top"]]
    assert len(top["rounds"]) == 3 and top["fits"]
    assert {n for n in rows} >= {x["name"] for x in job["layouts"]}
    default = rows[job["default"]]
    assert default["was"] == pytest.approx(0.324, abs=1e-3)  # the committed prediction


def test_sibling_stands_in_only_for_another_zero_stage():
    rows = refit.measured_layouts(_job("debug x4"))
    measured = space.layout_from(rows["dp_shard 4, stage 1, batch 4 x 1, ac none"]["layout"])
    assert refit.sibling(measured.replace(zero=2), rows) == (
        "dp_shard 4, stage 1, batch 4 x 1, ac none")
    assert refit.sibling(measured.replace(microbatch=2, pp_microbatches=2), rows) is None


def test_debug_x4_gain_within_15_percent_of_every_round(hw):
    """The committed top and default of debug x4, re-predicted from the committed
    calibration: their predicted gain within 15% of each round's measured gain (the
    committed prediction, 1.33, was 16-22% above)."""
    from bench.planner_choice import predict

    job = _job("debug x4")
    spec = next(j for j in space.JOBS if j.name == "debug x4")
    rows = refit.measured_layouts(job)
    top, default = rows[job["top"]], rows[job["default"]]
    pred = {n: predict(spec, space.layout_from(rows[n]["layout"]), hw)["best_step_time"]
            for n in (job["top"], job["default"])}
    gain = pred[job["default"]] / pred[job["top"]]
    measured = [d / t for d, t in zip(default["rounds"], top["rounds"], strict=True)]
    assert all(abs(gain / g - 1) <= 0.15 for g in measured), (gain, measured)
    assert any(abs(default["was"] / top["was"] / g - 1) > 0.15 for g in measured)


@pytest.mark.parametrize("name", ["debug x4", "debug x4, cap", "small x4", "small x4, cap"])
def test_four_rank_jobs_rank_the_measured_layouts_better(hw, name):
    """Over every layout measured for a 4-rank job, the re-predicted order correlates with
    the measured one better than the committed predictions did."""
    got = refit.refit_job(_job(name), hw)
    assert got["now"]["rank_corr"] > got["was"]["rank_corr"]
