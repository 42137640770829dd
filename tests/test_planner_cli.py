"""``shardwise plan`` end to end: table, --json, --layout, --plot, --model-config,
--calibrate, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re

import pytest

from shardwise.train.cli import main
from tests.planner_helpers import RECORD_KEYS

JOB = ["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "16", "--seq-len",
       "8192", "--global-batch", "64"]
KEYS = RECORD_KEYS | {"buildable", "not_buildable_reason"}


def test_table(capsys):
    assert main(JOB + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b on 16 x h100-sxm" in out and "bottleneck" in out
    rows = [line for line in out.splitlines() if re.match(r"^\s*\d+\s+[\d.]+\s", line)]
    assert len(rows) == 3


def test_json_prints_only_the_records(capsys):
    assert main(JOB + ["--json", "--layout", "tp=8,ac=full"]) == 0
    records = json.loads(capsys.readouterr().out)  # nothing but the JSON array
    assert records and all(set(r) == KEYS for r in records)
    assert all(r["layout"]["tp"] == 8 and r["layout"]["ac"] == "full" for r in records)
    times = [r["step_time_s"] for r in records if r["fits"]]
    assert times == sorted(times)


def test_layout_of_the_issue(capsys):
    args = ["plan", "--model", "llama3-405b", "--hardware", "h100", "--gpus", "16384",
            "--seq-len", "8192", "--global-batch", "2048", "--json", "--top", "1", "--layout",
            "tp=8,pp=16,dp_shard=128,pp_schedule=1f1b,microbatch=1,ac=full"]
    assert main(args) == 0
    (rec,) = json.loads(capsys.readouterr().out)
    want = {"tp": 8, "pp": 16, "dp_shard": 128, "pp_schedule": "1f1b", "microbatch": 1,
            "ac": "full", "dp_replicate": 1, "cp": 1, "pp_microbatches": 16}
    assert {k: rec["layout"][k] for k in want} == want and rec["fits"]


def test_plot_and_model_config(tmp_path, capsys):
    cfg = tmp_path / "half.toml"
    cfg.write_text('base = "llama3-8b"\nn_layers = 16\n')
    png = tmp_path / "plan.png"
    args = ["plan", "--model-config", str(cfg), "--hardware", "a100", "--gpus", "8",
            "--seq-len", "4096", "--global-batch", "32", "--layout", "pp=2", "--plot", str(png)]
    assert main(args) == 0
    assert "half on 8 x a100-80gb" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--layout", "tp=3"], "tp=3 must divide the 8 GPUs of a node"),
    (["--layout", "tpp=2"], "did you mean 'tp'"),
    (["--layout", "tp=8,pp=4"], "expected the GPU count 16"),
    (["--top", "0"], "--top=0"),
])
def test_bad_input_exits_2_naming_the_value(args, message, capsys):
    assert main(JOB + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("shardwise: error:")


def test_unknown_model_and_missing_arguments(capsys):
    assert main(["plan", "--model", "llama3-8", "--hardware", "h100", "--gpus", "8",
                 "--seq-len", "1024", "--global-batch", "8"]) == 2
    assert "did you mean 'llama3-8b'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100"]) == 2
    assert "--gpus is required" in capsys.readouterr().err


def test_calibrate_local_then_plan(tmp_path, capsys):
    cal = tmp_path / "cal.toml"
    assert main(["plan", "--hardware", "local", "--calibrate", "--calibrate-budget", "2",
                 "--calibration", str(cal)]) == 0
    text = cal.read_text()
    assert "[local]" in text and "matmul_flops_seconds" in text
    capsys.readouterr()
    assert main(["plan", "--model", "debug", "--hardware", "local", "--calibration", str(cal),
                 "--gpus", "2", "--seq-len", "256", "--global-batch", "8", "--json",
                 "--compute-dtype", "fp32"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[0]["fits"] and records[0]["step_time_s"] > 0
    assert main(["plan", "--hardware", "h100", "--calibrate"]) == 2
    assert "use --hardware local" in capsys.readouterr().err


# ----------------------------------------------------------------- buildable layouts (#30)
_BIG = ["plan", "--model", "llama3-70b", "--hardware", "h100", "--gpus", "64", "--seq-len",
        "8192", "--global-batch", "64", "--top", "4"]


def test_layouts_the_trainer_cannot_build_are_marked_and_can_be_left_out(capsys):
    """The planner prices what the trainer cannot build yet (context parallelism of
    multi-head latent attention): every record says whether ``shardwise train`` can run it,
    and ``--buildable`` searches only those. Context parallelism of grouped-query attention
    is built (issue 32)."""
    assert main([*_BIG, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert any(r["layout"]["cp"] > 1 for r in records)
    assert all(r["buildable"] and r["not_buildable_reason"] is None for r in records)
    mla = ["plan", "--model", "deepseek-v3", "--hardware", "h100", "--gpus", "64",
           "--seq-len", "8192", "--global-batch", "64", "--top", "2"]
    assert main([*mla, "--layout", "cp=2", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and all(r["layout"]["cp"] == 2 and not r["buildable"] for r in records)
    reason = "context parallelism (cp > 1) does not cover multi-head latent attention yet"
    assert {r["not_buildable_reason"] for r in records} == {reason}
    assert main([*mla, "--layout", "cp=2"]) == 0
    table = capsys.readouterr().out
    assert " build " in table.splitlines()[2] and "  no  " in table
    assert f"{reason}; shardwise train of this version refuses it (--buildable: only layouts " \
        "it builds)" in table
    assert main([*_BIG, "--buildable", "--layout", "cp=2", "--json"]) == 0
    only = json.loads(capsys.readouterr().out)
    assert only and all(r["buildable"] and r["layout"]["cp"] == 2 for r in only)


@pytest.mark.parametrize("layout, model, buildable", [
    (dict(dp_shard=2, zero=3, microbatch=4), "debug", True),
    (dict(pp=2, pp_schedule="1f1b", zero=1, microbatch=2, pp_microbatches=2,
          offload="cpu"), "debug", False),
    (dict(dp_shard=2, tp=2, ep=2, zero=3, microbatch=4, sp=False), "debug-moe", False),
    (dict(dp_shard=2, tp=2, ep=2, zero=3, microbatch=4, sp=True), "debug-moe", True),
    (dict(dp_shard=4, ep=2, zero=3, microbatch=4, ac="full"), "debug-moe", False),
    (dict(cp=2, zero=3, microbatch=4), "debug", True),
    (dict(dp_shard=2, cp=2, tp=2, zero=3, microbatch=4, sp=True), "debug", True),
    (dict(pp=2, pp_schedule="1f1b", cp=2, zero=1, microbatch=2, pp_microbatches=2), "debug",
     True),
    (dict(cp=2, ep=2, zero=3, microbatch=4), "debug-moe", True),
    (dict(cp=2, zero=3, microbatch=4), "deepseek-v3", False),
    (dict(pp=2, pp_schedule="zb1", zero=0, microbatch=4, pp_microbatches=2, ac="selective"),
     "debug", False),
    (dict(pp=2, pp_schedule="zbv", pp_virtual=2, zero=0, microbatch=4, pp_microbatches=2,
          ac="full"), "debug", True),
    (dict(pp=2, pp_schedule="1f1b", zero=0, microbatch=4, pp_microbatches=2,
          ac="selective"), "debug", True),
])
def test_the_buildable_rules_are_the_trainers_refusals(layout, model, buildable, tmp_path):
    """[Note: buildable layouts]: the planner's rule and the trainer's own checks agree."""
    from shardwise.planner.buildable import not_buildable
    from shardwise.planner.catalogue import from_llama_config
    from shardwise.planner.parallel_layout import Layout
    from shardwise.train import plan_layout
    from shardwise.train.config import load_config, resolve_world
    from shardwise.train.preflight import build_model_config

    L = Layout(**layout)
    cfg = load_config(None, {"model.name": model, "log.dir": str(tmp_path),
                             "offload.device": L.offload})  # with_layout keeps the config's
    model_cfg = build_model_config(cfg, 256)
    new = plan_layout.with_layout(resolve_world(cfg, L.gpus), L)
    assert plan_layout._buildable(new, model_cfg, L.gpus) is buildable
    spec = from_llama_config(model_cfg, model)
    assert (not_buildable(L, spec) is None) is buildable


DEEPSEEK = ["plan", "--model", "deepseek-v3", "--hardware", "h800", "--gpus", "2048",
            "--seq-len", "4096", "--global-batch", "15360", "--json", "--top", "1", "--layout",
            "tp=1,pp=16,ep=64,dp_shard=128,zero=1,microbatch=1,pp_schedule=dualpipev,"
            "ac=selective"]


def _one(args, capsys) -> tuple[dict, str]:
    assert main(args) == 0
    out = capsys.readouterr()
    (rec,) = json.loads(out.out)
    return rec, out.err


def test_workload_of_prices_a_published_runs_stack(capsys):
    """The issue's DeepSeek-V3 command does not fit with shardwise's own stack (bf16
    activations) and says which published run's stack does, and what memory it gives;
    ``--workload-of`` prices that stack (the fitting layout), and options given beside it
    win over the run's stack."""
    own, hint = _one(DEEPSEEK, capsys)
    assert not own["fits"]
    m = re.search(r"published run deepseek-v3-2048 \(as deepseek-v3-mtp\); .*"
                  r"\(--workload-of deepseek-v3-2048\) this layout takes ([\d.]+) GiB per GPU "
                  r"of [\d.]+ \(fits\)", hint)
    assert m, hint
    theirs, hint2 = _one(DEEPSEEK + ["--workload-of", "deepseek-v3-2048"], capsys)
    assert theirs["fits"] and not hint2
    assert theirs["memory_per_gpu_gib"] == pytest.approx(float(m[1]), abs=0.05)
    assert theirs["step_time_s"] < own["step_time_s"]  # fp8 multiplies, overlapped all-to-all
    more, _ = _one(DEEPSEEK + ["--workload-of", "deepseek-v3-2048", "--workload",
                               "fp8_activations=false"], capsys)
    assert more["memory_per_gpu_gib"] > theirs["memory_per_gpu_gib"] + 5
    bf16, _ = _one(DEEPSEEK + ["--workload-of", "deepseek-v3-2048", "--compute-dtype",
                               "bf16"], capsys)
    assert bf16["step_time_s"] > theirs["step_time_s"]


def test_workload_of_an_unknown_run_names_the_close_ones(capsys):
    assert main(DEEPSEEK + ["--workload-of", "deepseek-v3"]) == 2
    err = capsys.readouterr().err
    assert "no published run 'deepseek-v3'" in err and "did you mean deepseek-v3-2048" in err


def test_the_hint_only_when_the_layout_does_not_fit(capsys):
    assert main(JOB + ["--layout", "tp=8,ac=full"]) == 0
    assert "hint:" not in capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8",
                 "--seq-len", "8192", "--global-batch", "64", "--layout",
                 "dp_shard=8,zero=0,microbatch=8,ac=none"]) == 0
    out = capsys.readouterr().out
    assert " NO " in out and "hint:" in out  # torchtitan trained llama3-8b
