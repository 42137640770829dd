"""The ten-trillion-parameter models and plans (docs/planner.md, "Ten trillion parameters";
bench/planner_10t.py writes the plans, bench/results/planner_10t.json holds them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.planner_10t import (BEGIN, END, GPUS, MODELS, WHAT_IF_SCALE, breaks_first,
                               command, shapes, workload_of, _parse)
from shardwise.planner import get_hardware, get_model_spec, planner_only_models
from shardwise.planner.cli import main as plan_main
from shardwise.planner.search import search

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "planner.md"
RESULTS = ROOT / "bench" / "results" / "planner_10t"
MESH = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


def _records() -> list[dict]:
    return json.loads(RESULTS.with_suffix(".json").read_text())


def _section() -> str:
    doc = DOCS.read_text()
    start = doc.index("## Ten trillion parameters")
    return doc[start:doc.index("\n## ", start + 1)]


def test_shapes_are_ten_trillion_and_the_active_count_is_as_documented():
    moe, dense = get_model_spec("moe-10t"), get_model_spec("dense-10t")
    assert abs(moe.num_params() / 1e13 - 1) < 0.03
    assert abs(dense.num_params() / 1e13 - 1) < 0.03
    assert moe.is_moe and moe.is_mla and moe.mtp_layers == 1 and moe.top_k == 16
    assert moe.n_moe_layers == 85 and moe.n_experts == 1024
    assert abs(moe.active_params() / 196.31e9 - 1) < 1e-3  # the docs' 196B
    assert not dense.is_moe and dense.active_params() == dense.num_params()
    assert dense.kv_heads == 8 and dense.n_heads % 8 == 0
    assert {"moe-10t", "dense-10t"} <= set(planner_only_models())
    section = _section()
    assert f"| {moe.active_params() / 1e9:.1f}B |" in section  # the generated shape table
    assert shapes() in section


def test_docs_section_is_the_scripts_output_and_its_commands_exist():
    doc = DOCS.read_text()
    order = [doc.index(h) for h in ("## Plans", "## Ten trillion parameters",
                                    "## Training with")]
    assert order == sorted(order)
    section = _section()
    assert "`python bench/planner_10t.py`" in section
    assert (ROOT / "bench" / "planner_10t.py").is_file()
    flat = re.sub(r"\s*\\\n\s*", " ", section)  # the one-plan command's continuation lines
    assert "shardwise plan " + command("moe-10t", "b200", 131072) in flat
    generated = section[section.index(BEGIN) + len(BEGIN):section.index(END)].strip()
    assert generated == RESULTS.with_suffix(".md").read_text().strip()


def test_committed_plans_cover_the_grid_fit_and_list_their_assumptions():
    recs = _records()
    devices = ("h100-sxm", "b200")
    assert {(r["model"], r["hardware"], r["gpus"], r["batch_scale"]) for r in recs} == {
        (m, h, g, 1) for m in MODELS for h in devices for g in GPUS} | {
        (m, h, GPUS[-1], WHAT_IF_SCALE) for m in MODELS for h in devices}
    for r in recs:
        assert r["fits"] and r["memory_gib"]["total"] <= r["assumptions"]["device"]["hbm_gib"]
        assert r["command"] == "shardwise plan " + command(
            r["model"], "h100" if r["hardware"] == "h100-sxm" else "b200", r["gpus"],
            r["batch_scale"])
        wl = r["assumptions"]["workload"]
        assert wl["compute_dtype"] in ("bf16", "fp8") and "overlap_dp" in wl
        assert r["tokens_per_day"] == pytest.approx(r["tokens_per_s_per_gpu"] * r["gpus"]
                                                    * 86400)
    section = _section()
    assert all(f"| {r['model']} | {r['gpus']:,} | {r['hardware']} |" in section for r in recs)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gpus", [GPUS[0], GPUS[-1]])
def test_the_planner_finds_a_fitting_layout_at_the_smallest_and_largest_cluster(model, gpus):
    """The search over the committed plan's mesh (the rest free: ZeRO, micro-batches,
    schedule, checkpointing; closed forms, not the simulated schedule, to keep it quick)
    finds a layout that fits, near the committed plan's step; the full search's speed is
    bench's."""
    for rec in [r for r in _records() if r["model"] == model and r["gpus"] == gpus
                and r["batch_scale"] == 1]:
        hw = get_hardware(rec["hardware"])
        wl = workload_of(_parse(rec["command"].removeprefix("shardwise plan ")))
        fixed = {k: rec["layout"][k] for k in MESH}
        res = search(get_model_spec(model), hw, wl, gpus, fixed, top=1, exact=False)
        best = res.ranked[0]
        assert best.fits and best.memory.total <= hw.hbm_bytes, (rec["hardware"], fixed)
        assert best.step_time == pytest.approx(rec["step_time_s"], rel=0.1)


def test_shardwise_plan_prints_moe_10t(capsys):
    rec = next(r for r in _records() if (r["model"], r["hardware"], r["gpus"],
                                         r["batch_scale"]) == ("moe-10t", "b200", 131072, 1))
    mesh = ",".join(f"{k}={rec['layout'][k]}" for k in MESH)
    argv = command("moe-10t", "b200", 131072).split() + ["--layout", mesh, "--json",
                                                         "--top", "1"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["fits"] and out[0]["layout"]["ep"] == rec["layout"]["ep"]


def test_breaks_first_names_the_size_and_the_overhead_that_grew():
    def rec(gpus, mfu, bubble, m):
        return {"model": "m", "hardware": "d", "gpus": gpus, "mfu": mfu, "fits": True,
                "step_time_s": 1.0, "step_s": {"compute": 1.0 - bubble, "pp_bubble": bubble},
                "sequences_per_dp_rank": m, "tokens_per_gpu": 512.0,
                "layout": {"pp_microbatches": m, "pp": 16}}
    s = breaks_first([rec(1024, 0.5, 0.05, 64), rec(2048, 0.48, 0.1, 32),
                      rec(4096, 0.3, 0.4, 8)])
    assert "holds to 2,048" in s and "falls to 30.0% at 4,096" in s and "pp_bubble" in s
    s = breaks_first([rec(1024, 0.5, 0.05, 64), rec(2048, 0.49, 0.06, 32)])
    assert "stays within 10%" in s and "pp_bubble (6.0% of the step)" in s
    s = breaks_first([rec(1024, 0.5, 0.05, 64), rec(2048, 0.4, 0.2, 32),
                      rec(4096, 0.3, 0.4, 8)])
    assert "falls to 40.0% at 2,048" in s and "at 4,096 the largest overhead is pp_bubble" in s
