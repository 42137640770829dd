"""The trainer on MoE models: every ZeRO stage, the [moe] section, metrics, refusals, the
command line end to end (with a checkpoint holding the routing biases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise.testing.dist import run_ranks
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

ROOT = Path(__file__).resolve().parents[1]
SMALL_MOE = {"model.name": "debug-moe", "model.dim": "64", "model.n_layers": "2",
             "model.n_heads": "4", "model.n_kv_heads": "2", "model.moe_ffn_dim": "32",
             "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
             "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false"}


def _shardwise_cmd() -> list[str]:
    script = Path(sys.executable).parent / "shardwise"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardwise.train.cli"]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _steps(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _train_on_ranks(cfg, data) -> list[dict]:
    train(cfg, data, build_env(cfg))
    return [r for r in _steps(Path(cfg.log.dir)) if "loss" in r]


def _records(tmp_path: Path, name: str, **over: str) -> list[dict]:
    cfg = load_config(None, {**SMALL_MOE, "train.steps": "3", "train.eval_interval": "0",
                             "log.dir": str(tmp_path / name), **over})
    cfg, data = preflight(cfg, world_size=2)
    return run_ranks(_train_on_ranks, world_size=2, args=(cfg, data), timeout_s=180)[0]


def test_every_zero_stage_trains_debug_moe_the_same(tmp_path):
    runs = {s: _records(tmp_path, f"s{s}", **{"parallel.stage": str(s)}) for s in (0, 1, 2, 3)}
    first = runs[0][0]
    for key in ("aux_loss", "z_loss", "moe_tokens_min", "moe_tokens_max", "moe_tokens_cv"):
        assert key in first, key
    assert len(first["moe_tokens_cv"]) == 2 and "moe_dropped_frac" not in first
    # 2 ranks x 4 sequences x 32 tokens x top-2 assignments over 8 experts, per layer
    assert first["moe_tokens_min"][0] <= 2 * 4 * 32 * 2 / 8 <= first["moe_tokens_max"][0]
    for stage in (1, 2, 3):
        for key in ("loss", "aux_loss", "z_loss"):
            torch.testing.assert_close([r[key] for r in runs[stage]],
                                       [r[key] for r in runs[0]], rtol=1e-5, atol=1e-6)
        assert [r["moe_tokens_max"] for r in runs[stage]] == [r["moe_tokens_max"]
                                                              for r in runs[0]]


def test_balance_none_leaves_the_lm_loss_alone(tmp_path):
    """loss is the LM loss: without balance terms the first step's loss is unchanged."""
    plain = _records(tmp_path, "none", **{"moe.balance": "none", "moe.z_loss_coef": "0"})
    aux = _records(tmp_path, "aux", **{"moe.aux_loss_coef": "1.0"})
    assert plain[0]["loss"] == pytest.approx(aux[0]["loss"], rel=1e-6)
    assert plain[0]["aux_loss"] == pytest.approx(aux[0]["aux_loss"], rel=1e-6)
    assert plain[1]["loss"] != pytest.approx(aux[1]["loss"], rel=1e-6)  # the update differs


def test_command_line_run_with_capacity_and_bias_balancing(tmp_path):
    out = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in SMALL_MOE.items() if not k.startswith("model.")]
    proc = _run([*_shardwise_cmd(), "train", "--model.name", "debug-moe", "--train.steps", "5",
                 "--moe.capacity_factor", "1.0", "--moe.balance", "bias",
                 "--moe.bias_update_rate", "0.01", "--checkpoint.interval", "5",
                 "--log.dir", str(out), *args], 400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MoE: 4 of 4 blocks, 8 experts of width 384, top-2 softmax" in proc.stdout
    records = _steps(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert len(r["moe_dropped_frac"]) == 4 and len(r["moe_tokens_cv"]) == 4
        assert all(0 <= f < 1 for f in r["moe_dropped_frac"])
        assert r["aux_loss"] > 0 and r["z_loss"] > 0
    assert any(f > 0 for r in steps for f in r["moe_dropped_frac"])
    assert any("val_loss" in r for r in records)
    ckpt = out / "checkpoints" / "step_00000005"
    reader = dcp.FileSystemReader(str(ckpt))
    keys = [k for k in reader.read_metadata().state_dict_metadata if k.endswith("expert_bias")]
    assert len(keys) == 4
    biases = {k: torch.empty(8) for k in keys}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": {k[len("model."):]: v for k, v in biases.items()}},
                 storage_reader=reader, no_dist=True)
    # five sign steps of 0.01 each: every bias is a multiple of 0.01 within [-0.05, 0.05]
    for b in biases.values():
        assert b.any() and b.abs().max() <= 0.05 + 1e-6
        assert torch.allclose(b * 100, (b * 100).round(), atol=1e-4)
    assert json.loads((out / "summary.json").read_text())["steps"] == 5


def _refused(capsys, *args: str) -> str:
    code = main(["train", "--train.steps", "1", "--log.progress", "false", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize("args, expected", [
    (["--model.name", "debug", "--moe.balance", "bias"],
     "moe.balance='bias' cannot take effect: model 'debug' has no MoE layers"),
    (["--model.name", "debug-moe", "--moe.capacity_factor", "0"],
     "moe.capacity_factor must be unset (dropless) or a finite number > 0, got 0.0"),
    (["--model.name", "debug-moe", "--moe.balance", "loss"],
     "moe.balance must be 'aux', 'bias' or 'none', got 'loss'"),
    (["--model.name", "debug-moe", "--moe.balance", "bias", "--moe.bias_update_rate", "0"],
     "moe.balance='bias' with moe.bias_update_rate=0 never moves the bias"),
    (["--model.name", "debug-moe", "--model.top_k", "9"], "top_k=9 exceeds num_experts=8"),
    (["--model.name", "debug-moe", "--model.router_score", "tanh"],
     "model.router_score must be 'softmax' or 'sigmoid', got 'tanh'"),
    (["--model.name", "debug-moe", "--model.num_experts", "-1"],
     "model.num_experts must be an int >= 0 (0: dense), got -1"),
])
def test_bad_moe_settings_are_refused_before_launch(capsys, tmp_path, args, expected):
    assert expected in _refused(capsys, "--log.dir", str(tmp_path / "out"), *args)
