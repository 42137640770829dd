"""Checkpoints in the trainer: bitwise exact resume, ``--checkpoint.resume auto`` at another
world size, importing safetensors weights, and the ``shardwise checkpoint`` commands."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from shardwise import checkpoint
from shardwise.models import build_model
from shardwise.testing.dist import run_ranks
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.preflight import build_model_config, preflight
from shardwise.train.trainer import build_env, build_optimizer, train

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "6", "train.eval_interval": "0", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "2"}


def _run(log_dir: Path, world: int, **over: str):
    cfg = load_config(None, {**TINY, "log.dir": str(log_dir), **over})
    cfg, data = preflight(cfg, world_size=world)
    run_ranks(_train, world, args=(cfg, data), timeout_s=180)
    return cfg, data


def _train(cfg, data):
    train(cfg, data, build_env(cfg))


def _records(log_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    lines = (log_dir / name).read_text().splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]


def _read(path: Path, cfg, data) -> tuple[dict, dict]:
    """A trainer checkpoint read whole, in this process: weights and optimizer state."""
    model = build_model(build_model_config(cfg, data.vocab_size), seed=1)
    opt = build_optimizer(model, cfg.optim)
    checkpoint.load(path, model, opt)
    return model.state_dict(), opt.state_dict()["state"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 steps on 2 ranks, ZeRO-3, a background checkpoint every 3 steps."""
    log = tmp_path_factory.mktemp("a")
    cfg, data = _run(log, 2, **{"checkpoint.interval": "3", "checkpoint.async_save": "true"})
    return log, cfg, data


def test_resume_is_bitwise_equal_to_the_uninterrupted_run(uninterrupted, tmp_path):
    log_a, cfg, data = uninterrupted
    step3 = log_a / "checkpoints" / "step_00000003"
    (tmp_path / "metrics.jsonl").write_text((log_a / "metrics.jsonl").read_text())  # an old log
    _run(tmp_path, 2, **{"checkpoint.interval": "3", "checkpoint.resume": str(step3),
                         "log.plot": "true"})
    resumed, full = _records(tmp_path), _records(log_a)
    # one continuous history: the kept steps 1-3, then the resumed run's 4-6 (the old log's
    # 4-6 and its validation at step 6 are dropped: they ran again)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr"):  # JSON floats round-trip exactly
        assert [r[key] for r in resumed] == [r[key] for r in full], key
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()[:3]
    assert kept == (log_a / "metrics.jsonl").read_text().splitlines()[:3]  # verbatim
    assert not list(tmp_path.glob("metrics.until-step-*"))
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    (wa, oa), (wb, ob) = (_read(d / "checkpoints" / "step_00000006", cfg, data)
                          for d in (log_a, tmp_path))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checkpoint"]["resumed_from_step"] == 3


@pytest.mark.parametrize("horizon", ["keep", "extend"])
def test_resuming_with_more_steps_keeps_or_extends_the_schedule(uninterrupted, tmp_path,
                                                                 horizon):
    """The checkpoint was saved at step 3 of a 6-step run; this run asks for 8 steps."""
    from shardwise.train.lr_schedule import lr_factor

    log_a, cfg, _ = uninterrupted
    step3 = log_a / "checkpoints" / "step_00000003"
    _run(tmp_path, 2, **{"checkpoint.resume": str(step3), "train.steps": "8",
                         "optim.schedule_horizon": horizon})
    lrs = [r["lr"] for r in _records(tmp_path)]
    full = [r["lr"] for r in _records(log_a)]
    o = cfg.optim
    if horizon == "keep":  # the original 6-step schedule, then its floor: bitwise the same
        assert lrs == full[3:] + [o.lr * o.min_lr_ratio] * 2
    else:  # re-planned over 8 steps from step 4 on
        assert lrs == pytest.approx([o.lr * lr_factor(s - 1, o.warmup_steps, 8, o.min_lr_ratio)
                                     for s in range(4, 9)], rel=1e-12)
        assert lrs[0] > full[3]  # a longer cosine: higher than the original at step 4
    # (the line that says so at start: tests/test_train_schedule.py)


def test_resume_auto_picks_the_latest_complete_checkpoint_at_another_world_size(
        uninterrupted, tmp_path):
    log_a, _, _ = uninterrupted
    shutil.copytree(log_a / "checkpoints" / "step_00000003",
                    tmp_path / "checkpoints" / "step_00000003")
    (tmp_path / "checkpoints" / ".step_00000005.partial").mkdir()  # a save that was killed
    _run(tmp_path, 3, **{"checkpoint.resume": "auto", "parallel.stage": "2"})
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [4, 5, 6]
    assert all(0 < r["loss"] < 10 for r in records)
    # nothing saved (interval 0), nothing found: a fresh start with resume auto
    _run(tmp_path / "fresh", 1, **{"checkpoint.resume": "auto", "train.steps": "1"})
    assert [r["step"] for r in _records(tmp_path / "fresh")] == [1]


def test_commands_inspect_export_import_and_the_trainer_import_option(
        uninterrupted, tmp_path, capsys):
    log_a, cfg, data = uninterrupted
    assert main(["checkpoint", "inspect", str(log_a / "checkpoints"), "--verify",
                 "--tensors"]) == 0
    text = capsys.readouterr().out
    for part in ("2 checkpoint(s) under", "step:      6", "2 rank(s), ZeRO stage 3",
                 "optimizer: AdamW, 2 param group(s)", "extra:     loader, run, scaler, schedule",
                 "checksums verified", "model.tok_embeddings.weight", "(256, 32)",
                 "optim.layers.1.feed_forward.w2.weight.exp_avg_sq"):
        assert part in text, part
    step6 = log_a / "checkpoints" / "step_00000006"
    assert main(["checkpoint", "export", str(step6), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert main(["checkpoint", "import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 0
    weights, _ = _read(step6, cfg, data)
    back = build_model(build_model_config(cfg, data.vocab_size), seed=2)
    checkpoint.load(tmp_path / "imp", back)
    assert all(torch.equal(v, weights[k]) for k, v in back.state_dict().items())
    # The trainer option: with lr 0 one step leaves the imported weights unchanged.
    _run(tmp_path / "run", 2, **{"checkpoint.import_safetensors": str(tmp_path / "hf"),
                                 "train.steps": "1", "checkpoint.interval": "1",
                                 "optim.lr": "0"})
    trained, _ = _read(tmp_path / "run" / "checkpoints" / "step_00000001", cfg, data)
    assert all(torch.equal(trained[k], weights[k]) for k in weights)
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ resume checks (issue 30)
def test_resuming_at_or_past_the_last_step_is_refused_before_launch(uninterrupted, tmp_path,
                                                                      capsys):
    log_a, _, _ = uninterrupted
    step6 = str(log_a / "checkpoints" / "step_00000006")
    for steps in ("6", "3"):
        cfg = load_config(None, {**TINY, "log.dir": str(tmp_path / steps), "train.steps": steps,
                                 "checkpoint.resume": step6})
        with pytest.raises(ValueError) as info:
            preflight(cfg, world_size=2)
        assert str(info.value).startswith(
            f"train.steps={steps}: checkpoint {step6} is at step 6 already, so nothing is "
            f"left to train; expected train.steps > 6")
    args = [f"--{k}={v}" for k, v in TINY.items()]
    code = main(["train", *args, "--train.steps", "3", "--checkpoint.resume", step6,
                 "--log.dir", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "nothing is left to train" in err


def test_resuming_with_another_global_batch_says_so(uninterrupted, tmp_path):
    log_a, _, _ = uninterrupted
    step3 = str(log_a / "checkpoints" / "step_00000003")

    def warned(world, **over):
        cfg = load_config(None, {**TINY, "log.dir": str(tmp_path / str(len(over))),
                                 "checkpoint.resume": step3, **over})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight(cfg, world_size=world)
        return [str(w.message) for w in caught if "global batch" in str(w.message)]

    assert warned(2) == []  # the same batch: nothing to say
    assert warned(2, **{"train.batch_size": "2", "train.grad_accum": "2"}) == []  # same split
    [message] = warned(2, **{"train.batch_size": "8"})
    assert ("took a global batch of 8 sequences x 32 tokens (2 data ranks x train.batch_size 4 "
            "x train.grad_accum 1) per step, this run takes 16 sequences x 32 tokens (2 data "
            "ranks x train.batch_size 8 x train.grad_accum 1): each step from 3 on sees 2x the "
            "tokens. The learning-rate schedule goes on by step") in message
    [message] = warned(3)  # one more data rank: 12 sequences a step
    assert "this run takes 12 sequences" in message and "1.5x" in message


def _corrupt(path: Path) -> str:
    data = sorted(path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte: the size is right, the hash is not
    data.write_bytes(bytes(raw))
    return data.name


def test_resume_auto_skips_a_damaged_newest_checkpoint(uninterrupted, tmp_path):
    """Before launch (the launching process verifies and pins the intact one) and on the
    ranks (each verifies its share; all fall back together), with a warning naming the
    damaged checkpoint and file; every checkpoint damaged is refused."""
    log_a, _, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(log_a / "checkpoints", run / "checkpoints")
    bad = _corrupt(run / "checkpoints" / "step_00000006")
    values = {**TINY, "log.dir": str(run), "train.steps": "8", "checkpoint.resume": "auto"}
    with pytest.warns(UserWarning, match=f"skipping step_00000006, it is damaged .*file {bad} "
                                         f"is corrupted.*resuming from step_00000003"):
        cfg, data = preflight(load_config(None, values), world_size=2)
    assert cfg.checkpoint.resume == str(run / "checkpoints" / "step_00000003")
    # the ranks' own fallback: what a torchrun job does (its ranks skip the launcher's check)
    cfg, data = preflight(load_config(None, values), world_size=2, verify_checkpoint=False)
    assert cfg.checkpoint.resume == "auto"
    run_ranks(_train, 2, args=(cfg, data), timeout_s=180)
    assert [r["step"] for r in _records(run)][-5:] == [4, 5, 6, 7, 8]
    assert json.loads((run / "summary.json").read_text())["checkpoint"][
        "resumed_from_step"] == 3
    _corrupt(run / "checkpoints" / "step_00000003")  # (step 6 is damaged already)
    with pytest.raises(ValueError, match="every checkpoint under .* is damaged"):
        preflight(load_config(None, {**values, "train.steps": "9"}), world_size=2)
