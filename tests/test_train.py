"""The trainer: schedule, optimizer groups, accumulation parity, launching, failures, end to end.

Multi-rank tests run real processes on Gloo: ``run_ranks`` (shardwise.testing) for the loop
itself, and the real ``shardwise`` command (local launcher, torchrun) end to end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from shardwise.testing import dist as testing_dist
from shardwise.testing.dist import run_ranks
from shardwise.train.config import load_config
from shardwise.train.launch import RankFailure, _agree_on_preflight, launch_local
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, build_optimizer, lr_factor, train

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false"}


def _shardwise_cmd() -> list[str]:
    script = Path(sys.executable).parent / "shardwise"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardwise.train.cli"]


def _clean_env() -> dict[str, str]:
    """This environment minus launcher variables (the suite itself may run under SLURM)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                "SLURM_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher)}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=_clean_env())


def _steps(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# ----------------------------------------------------------------------------- pieces


def test_lr_schedule_warmup_then_cosine_to_floor():
    total, warmup, floor = 100, 10, 0.1
    factors = [lr_factor(s, warmup, total, floor) for s in range(total)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(factors[:10], factors[1:10]))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[-1] == pytest.approx(floor)
    assert lr_factor(0, 0, 1, 0.5) == pytest.approx(1.0)  # no warmup, one step: peak lr


def test_optimizer_excludes_no_decay_names_from_weight_decay():
    from shardwise.models import build_model, get_model_config

    model = build_model(get_model_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    cfg = load_config(None, {"optim.weight_decay": "0.5", "optim.no_decay": "norm,tok_embeddings"})
    opt = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.5
               for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0
             for p in g["params"]}
    assert "layers.0.attention.wq.weight" in decayed and "output.weight" in decayed
    assert {"norm.weight", "layers.1.ffn_norm.weight", "tok_embeddings.weight"} <= plain
    assert decayed.isdisjoint(plain) and len(decayed | plain) == len(names)


def _agree(rank_with_error: int) -> str:
    import torch.distributed as dist

    env = build_env(load_config(None, {}))
    error = "data.source 'x' is too small" if dist.get_rank() == rank_with_error else None
    try:
        _agree_on_preflight(error, env)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_preflight_failure_on_one_rank_stops_every_rank():
    messages = run_ranks(_agree, world_size=2, args=(1,), timeout_s=60)
    assert messages == ["on rank 1: data.source 'x' is too small"] * 2


def _train_on_ranks(cfg, data) -> list[float]:
    train(cfg, data, build_env(cfg))
    return [r["loss"] for r in _steps(Path(cfg.log.dir)) if "loss" in r]


def test_grad_accumulation_matches_a_bigger_batch(tmp_path):
    """2 x 2 accumulated micro-batches == one micro-batch of 4: same windows, same math."""
    runs = {}
    for name, batch, accum in (("big", "4", "1"), ("accum", "2", "2")):
        cfg = load_config(None, {**TINY, "train.steps": "3", "train.batch_size": batch,
                                 "train.grad_accum": accum, "train.eval_interval": "0",
                                 "log.dir": str(tmp_path / name)})
        cfg, data = preflight(cfg, world_size=2)
        runs[name] = run_ranks(_train_on_ranks, world_size=2, args=(cfg, data), timeout_s=120)[0]
    assert len(runs["big"]) == 3
    torch.testing.assert_close(runs["accum"], runs["big"], rtol=1e-5, atol=1e-6)


def test_every_zero_stage_and_bf16_train_the_same_numbers(tmp_path):
    """The trainer runs on the engine: stages 0-3 give one loss curve, bf16 follows it."""
    runs = {}
    for name, over in (("s0", {"parallel.stage": "0"}), ("s1", {"parallel.stage": "1"}),
                       ("s3", {"parallel.stage": "3"}),
                       ("bf16", {"parallel.stage": "3", "precision.param_dtype": "bf16"})):
        cfg = load_config(None, {**TINY, "train.steps": "3", "train.eval_interval": "0",
                                 "log.dir": str(tmp_path / name), **over})
        cfg, data = preflight(cfg, world_size=2)
        runs[name] = run_ranks(_train_on_ranks, world_size=2, args=(cfg, data), timeout_s=120)[0]
    for name in ("s1", "s3"):
        torch.testing.assert_close(runs[name], runs["s0"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["bf16"], runs["s0"], rtol=2e-2, atol=1e-2)


def test_quantised_comm_and_disk_offload_from_the_command_line(tmp_path):
    """[comm] and [offload] reach the engine: int8 weights / int4 gradients with optimizer
    state on disk train like the plain run; a missing offload folder stops the launch."""
    plain = load_config(None, {**TINY, "train.steps": "3", "train.eval_interval": "0",
                               "log.dir": str(tmp_path / "plain")})
    (tmp_path / "opt").mkdir()
    tuned = load_config(None, {**TINY, "train.steps": "3", "train.eval_interval": "0",
                               "log.dir": str(tmp_path / "tuned"), "comm.weights": "int8",
                               "comm.grads": "int4", "offload.device": "disk",
                               "offload.path": str(tmp_path / "opt"), "offload.buffer_mb": "1"})
    runs = {}
    for name, cfg in (("plain", plain), ("tuned", tuned)):
        cfg, data = preflight(cfg, world_size=2)
        runs[name] = run_ranks(_train_on_ranks, world_size=2, args=(cfg, data), timeout_s=180)[0]
    torch.testing.assert_close(runs["tuned"], runs["plain"], rtol=2e-2, atol=2e-2)
    assert list((tmp_path / "opt").iterdir()) == []  # offload files removed at the end
    missing = load_config(None, {**TINY, "offload.device": "disk",
                                 "offload.path": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="^offload.path = '.*nope' does not exist; create the "
                       "directory first$"):
        preflight(missing, world_size=2)


def _fail_on_rank_one() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("deliberate failure on this rank")
    return rank


def test_a_failing_local_rank_is_named():
    with pytest.raises(RankFailure) as info:
        launch_local(_fail_on_rank_one, nproc=2)
    assert "rank 1 failed (exit code 1): ValueError: deliberate failure on this rank" in str(
        info.value)
    assert list(info.value.failures) == [1]


def test_the_command_exits_1_naming_the_failed_rank(monkeypatch, capsys):
    from shardwise.train import cli, launch

    def fail(cfg):
        raise RankFailure({1: (1, "RuntimeError: loss is nan on rank 1 at step 3")})

    monkeypatch.setattr(launch, "run_training", fail)
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.strip() == (
        "shardwise: error: rank 1 failed (exit code 1): RuntimeError: loss is nan on rank 1 at "
        "step 3")


def test_a_diverging_loss_stops_every_rank_naming_the_step(tmp_path):
    cfg = load_config(None, {**TINY, "train.steps": "5", "optim.lr": "1e30",
                             "optim.warmup_steps": "0", "optim.grad_clip": "0",
                             "log.dir": str(tmp_path)})
    cfg, data = preflight(cfg, world_size=2)
    with pytest.raises(testing_dist.RankFailure) as info:
        run_ranks(_train_on_ranks, world_size=2, args=(cfg, data), timeout_s=120)
    # caught before the optimizer step, by gradient; every rank names the same parameter
    expected = ("NonFiniteError: non-finite gradient at step 2: first offending parameter "
                "'tok_embeddings.weight' (nan, ")
    assert str(info.value).count(expected) == 2


# ----------------------------------------------------------------------------- end to end


def test_default_command_trains_and_writes_outputs(tmp_path):
    """The issue's acceptance run: ``shardwise train --train.steps 30 --log.dir D``."""
    out = tmp_path / "run"
    proc = _run([*_shardwise_cmd(), "train", "--train.steps", "30", "--log.dir", str(out)], 400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _steps(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "rss_mib"):
        assert key in steps[0]
    assert len(steps[0]["rss_mib"]) == 2
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0, (steps[0]["loss"], steps[-1]["loss"])
    assert any("val_loss" in r for r in records)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = load_config(out / "config.toml")
    assert saved.train.steps == 30 and saved.log.dir == str(out) and saved.parallel.dp_shard == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_train_loss"] == pytest.approx(steps[-1]["loss"])
    assert math.isfinite(summary["final_val_loss"]) and len(summary["peak_rss_mib"]) == 2
    # sharded by the ZeRO engine: each rank holds about 16 bytes x params / 2 of model state
    assert summary["zero_stage"] == 3
    psi = 3_279_104
    for mib in summary["model_state_mib"]:
        assert abs(mib * 2**20 - 16 * psi / 2) < 0.02 * 16 * psi / 2, mib
    assert "final train loss" in proc.stdout and str(out) in proc.stdout
    assert proc.stdout.count("config: every key in") == 1
    assert f"  log.dir = \"{out}\"" in proc.stdout and "  train.steps = 30" in proc.stdout
    assert "steps = 150" not in proc.stdout  # only the keys that differ from the defaults


def test_under_torchrun(tmp_path):
    out = tmp_path / "tr"
    args = [f"--{k}={v}" for k, v in TINY.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "shardwise.train.cli", "train", "--train.steps", "4", "--train.eval_interval",
           "2", *args, "--log.dir", str(out)]
    proc = _run(cmd, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _steps(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert proc.stdout.count("summary:") == 1  # rank 0 alone reports
    assert tomllib.loads((out / "config.toml").read_text())["parallel"]["dp_shard"] == 2


def test_under_slurm_srun(tmp_path):
    """What ``srun --ntasks 2 shardwise train`` starts: two processes with SLURM's variables."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "slurm"
    args = [f"--{k}={v}" for k, v in TINY.items()]
    cmd = [*_shardwise_cmd(), "train", "--train.steps", "3", *args, "--log.dir", str(out)]
    base = _clean_env()
    procs = []
    for rank in range(2):
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert "summary:" in results[0][0] and "summary:" not in results[1][0]
    assert [r["step"] for r in _steps(out) if "loss" in r] == [1, 2, 3]
