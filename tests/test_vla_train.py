"""The VLA through the trainer (issue 34): `shardwise train` on BabyAI demonstrations at every
layout the trainer takes, evaluation in the loop, the refusals.

The layouts share one launch of ranks per world size (``train_runs``); every run trains the
same global batches from the same init, so in fp32 the ZeRO stages agree with one another
to rounding, tensor parallelism to a looser bound, and a frozen vision tower leaves its
weights untouched. Pipelined layouts (pp 2 x dp 1 on two ranks, pp 3 on three: one data rank
of the same global batch, the vision tower on the first stage) match the unpipelined losses
within 1e-5 and validate to the same accuracy and success rate; so does context
parallelism (cp 2 x dp 1: each cp rank decodes its zigzag part of the same global batch).
The model-level parity against one process is tests/test_vla_model.py's
(tests/test_vla_pp.py's for pipelines).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("minigrid")

from shardwise.testing.dist import run_ranks  # noqa: E402
from shardwise.testing.trainer import cli_args, logged, refused, train_runs  # noqa: E402
from shardwise.train.config import load_config  # noqa: E402
from shardwise.train.preflight import preflight  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LEVEL = "BabyAI-GoToLocal-v0"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small demonstration set, made once for the module (about a second)."""
    from shardwise.data.vla import ensure_dataset

    return ensure_dataset(tmp_path_factory.mktemp("vla") / "demos", LEVEL, episodes=40)


def _values(dataset: Path, log_dir: Path, **extra: str) -> dict[str, str]:
    values = {"model.name": "debug-vla", "vla.dir": str(dataset), "vla.episodes": "40",
              "vla.eval_episodes": "4", "vla.val_fraction": "0.1", "train.steps": "4",
              "train.batch_size": "4", "train.eval_interval": "0", "train.eval_batches": "1",
              "optim.lr": "0.001", "log.dir": str(log_dir), "log.progress": "false",
              "log.plot": "false", "parallel.nproc": "2"}
    values.update(extra)
    return values


LAYOUTS = {
    "stage0": {"parallel.stage": "0"},
    "stage1": {"parallel.stage": "1"},
    "stage2": {"parallel.stage": "2"},
    "stage3": {"parallel.stage": "3"},
    "frozen": {"parallel.stage": "3", "model.freeze": "vision"},
    # one data rank of 8 samples: the same global batches as 2 data ranks of 4
    "tp2": {"parallel.stage": "1", "parallel.tp": "2", "train.batch_size": "8"},
    "text_only": {"parallel.stage": "3", "vla.text_only_share": "0.5"},
    "ac_full": {"parallel.stage": "3", "train.activation_checkpoint": "full"},
    "moe_ep2": {"model.name": "debug-vla-moe", "parallel.stage": "3", "parallel.ep": "2"},
    # cp 2 x dp 1: one data rank of 8 samples, each cp rank decoding its zigzag part
    "cp2": {"parallel.stage": "3", "parallel.cp": "2", "train.batch_size": "8"},
    # ... and samples with no frame, ZeRO 1
    "cp2_text": {"parallel.stage": "1", "parallel.cp": "2", "train.batch_size": "8",
                 "vla.text_only_share": "0.5"},
    # pp 2 x dp 1: one data rank of 8 samples in 4 micro-batches, the vision tower on stage 0
    "pp2": {"parallel.stage": "1", "parallel.pp": "2", "train.batch_size": "8",
            "parallel.pp_microbatches": "4"},
    # ... ZeRO-3 inside the stages, GPipe, micro-batches with no frame
    "pp2_text": {"parallel.stage": "3", "parallel.pp": "2", "train.batch_size": "8",
                 "parallel.pp_microbatches": "4", "parallel.pp_schedule": "gpipe",
                 "vla.text_only_share": "0.5"},
}


def _launch(dataset: Path, root: Path, layouts: dict, world: int) -> dict[str, Path]:
    prepared, dirs = [], {}
    for name, extra in layouts.items():
        dirs[name] = root / name
        cfg = load_config(None, _values(dataset, dirs[name], **extra))
        prepared.append(preflight(cfg, world_size=world))
    run_ranks(train_runs, world, args=(prepared,), timeout_s=600)
    return dirs


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:
    """Every layout of LAYOUTS trained in one launch of 2 ranks; their log folders."""
    return _launch(dataset, tmp_path_factory.mktemp("vla-runs"), LAYOUTS, 2)


def _losses(log_dir: Path) -> list[float]:
    return [r["loss"] for r in logged(log_dir)]


def test_every_layout_trains_and_evaluates_the_policy(runs):
    for name, log_dir in runs.items():
        losses = _losses(log_dir)
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), name
        (val,) = logged(log_dir, "success_rate")
        assert 0.0 <= val["success_rate"] <= 1.0 and 0.0 <= val["action_accuracy"] <= 1.0
        summary = json.loads((log_dir / "summary.json").read_text())
        assert summary["final_success_rate"] == val["success_rate"], name
        assert (log_dir / "rollout.png").stat().st_size > 1000, name


def test_the_zero_stages_agree_and_tensor_parallelism_matches(runs):
    ref = _losses(runs["stage0"])
    for name in ("stage1", "stage2", "stage3", "ac_full"):
        got = _losses(runs[name])
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (name, got, ref)
    for name, ref_name in (("pp2", "stage0"), ("pp2_text", "text_only"), ("cp2", "stage0"),
                           ("cp2_text", "text_only")):
        got, want = _losses(runs[name]), _losses(runs[ref_name])
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-5, (name, got, want)
    got = _losses(runs["tp2"])
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
    # the same first batch from the same init: the frozen run's first loss is the others'
    assert abs(_losses(runs["frozen"])[0] - ref[0]) / ref[0] < 1e-5
    assert _losses(runs["frozen"])[1:] != ref[1:]  # ... and then only the rest learns


def test_pipelined_validation_counts_what_one_stage_counts(runs, dataset, tmp_path):
    # the same weights (within rounding): the same accuracy and, acting in lockstep through
    # the schedule (the cp ranks: on gathered logits), the same episodes
    for name, ref_name in (("pp2", "stage0"), ("pp2_text", "text_only"), ("cp2", "stage0"),
                           ("cp2_text", "text_only")):
        (got,), (want,) = logged(runs[name], "success_rate"), logged(runs[ref_name],
                                                                     "success_rate")
        assert got["action_accuracy"] == want["action_accuracy"], (name, got, want)
        assert got["success_rate"] == want["success_rate"], (name, got, want)
        assert got["val_tokens"] == want["val_tokens"], (name, got, want)
        assert abs(got["val_loss"] - want["val_loss"]) / want["val_loss"] < 1e-5, name
    # three stages on three ranks (pp 3 x dp 1), the tower on the first
    pp3 = _launch(dataset, tmp_path, {"pp3": {**LAYOUTS["pp2"], "parallel.pp": "3",
                                              "parallel.nproc": "3"}}, 3)["pp3"]
    got, ref = _losses(pp3), _losses(runs["stage0"])
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (got, ref)
    (val,) = logged(pp3, "success_rate")
    assert val["success_rate"] == logged(runs["stage0"], "success_rate")[0]["success_rate"]


def test_a_frozen_vision_tower_holds_no_gradient_or_optimizer_state(runs):
    frozen = json.loads((runs["frozen"] / "summary.json").read_text())["model_state_mib"]
    full = json.loads((runs["stage3"] / "summary.json").read_text())["model_state_mib"]
    assert all(f < g for f, g in zip(frozen, full)), (frozen, full)


def test_the_start_lines_say_what_the_run_is(dataset, tmp_path, capfd):
    from shardwise.train.cli import main

    args = cli_args(_values(dataset, tmp_path / "run", **{"train.steps": "2",
                                                          "parallel.nproc": "1"}))
    assert main(["train", *args]) == 0
    out = capfd.readouterr().out
    assert "model 'debug-vla' (vision 2 x 128" in out and "demonstrations" in out
    assert "success rate of the greedy policy acting on 4 held-out seeds" in out
    assert "policy: success rate" in out


def test_the_vla_config_file_runs_through_the_command(dataset, tmp_path):
    cmd = [sys.executable, "-m", "shardwise.train.cli", "train", "--config",
           str(ROOT / "configs" / "vla.toml"), "--vla.dir", str(dataset), "--vla.episodes",
           "40", "--train.steps", "3", "--train.batch_size", "4", "--vla.eval_episodes", "2",
           "--train.eval_batches", "1", "--vla.val_fraction", "0.1",
           "--log.dir", str(tmp_path / "run"), "--log.progress", "false"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("metrics.jsonl", "loss.png", "rollout.png", "summary.json"):
        assert (tmp_path / "run" / name).exists(), name


@pytest.mark.parametrize("extra, expected", [
    ({"parallel.pp": "2", "parallel.tp": "2", "parallel.nproc": "4"},
     "parallel.pp=2 with parallel.tp=2 is not supported with the vision-language-action"),
    ({"parallel.pp": "2", "model.freeze": "vision"},
     "parallel.pp=2 with model.freeze=['vision'] is not supported"),
    ({"parallel.cp": "2", "parallel.pp": "2", "parallel.nproc": "4"},
     "parallel.cp=2 with parallel.pp=2 is not supported"),
    ({"parallel.cp": "2", "parallel.tp": "2", "parallel.nproc": "4"},
     "parallel.cp=2 with parallel.tp=2 is not supported"),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true"},
     "parallel.sequence_parallel=true is not supported"),
    ({"model.freeze": "eyes"}, "model.freeze: 'eyes' is not a submodule of the model"),
    ({"vla.frames": "9"}, "vla.frames=9 makes samples of up to"),
    ({"vla.level": "MiniGrid-Empty-5x5-v0"}, "vla.level='MiniGrid-Empty-5x5-v0'"),
    ({"vla.val_fraction": "0.05", "train.batch_size": "8"},
     "fewer than one global batch of 16"),
    ({"parallel.tp": "3", "parallel.nproc": "3"}, "parallel.tp=3 does not divide"),
])
def test_layouts_the_vla_path_does_not_take_are_refused_before_any_rank(
        dataset, tmp_path, capsys, extra, expected):
    message = refused(capsys, *cli_args(_values(dataset, tmp_path / "run", **extra)))
    assert expected in message
