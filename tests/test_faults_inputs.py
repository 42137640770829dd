"""Bad input catalogue, the part that concerns an existing run: a missing or incomplete
checkpoint, a model or tokenizer that does not fit it, a typo in the fault spec, a disk that
fills up during a save. Each is refused with one line naming the value (before any rank
starts where it can be known then), and the earlier checkpoint is left byte for byte intact.

(Configuration values, model shapes, unwritable folders and corpora too small for the
sequence length and world size are in tests/test_cli.py and tests/test_config.py.)
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from shardwise import checkpoint
from shardwise.testing.dist import RankFailure, run_ranks
from shardwise.testing.trainer import refused, train_rank
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.eval_interval": "0", "checkpoint.interval": "2", "checkpoint.keep_last": "0"}


def _args(**over: str) -> list[str]:
    return [f"--{k}={v}" for k, v in {**TINY, **over}.items()]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 2 steps with its checkpoint step_2, and the checkpoints' digest."""
    log = tmp_path_factory.mktemp("saved")
    cfg, data = preflight(load_config(None, {**TINY, "train.steps": "2", "log.dir": str(log)}),
                          world_size=2)
    run_ranks(train_rank, 2, args=(cfg, data), timeout_s=120)
    return log, _digest(log / "checkpoints")



def test_a_missing_checkpoint_is_named_before_launch(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "step_00000010"
    message = refused(capsys, *_args(**{"log.dir": str(tmp_path / "o"),
                                         "checkpoint.resume": str(missing)}))
    assert message == (f"checkpoint.resume '{missing}': checkpoint {missing} does not exist "
                       "(expected a folder written by shardwise.checkpoint.save)")


def test_an_incomplete_checkpoint_isrefused(capsys, saved, tmp_path):
    log, digest = saved
    partial = tmp_path / ".step_00000004.partial"
    shutil.copytree(log / "checkpoints" / "step_00000002", partial)
    message = refused(capsys, *_args(**{"log.dir": str(tmp_path / "o"),
                                         "checkpoint.resume": str(partial)}))
    assert "is a save that was never committed: it may be incomplete" in message
    assert _digest(log / "checkpoints") == digest


@pytest.mark.parametrize("over, expected", [
    ({"data.tokenizer": "bpe", "data.bpe_vocab_size": "300"},
     "was trained with vocab_size=256, but data.tokenizer 'bpe' with data.bpe_vocab_size=300 "
     "gives 300 token ids; expected the tokenizer the checkpoint was trained with"),
    ({"model.dim": "64"},
     "holds a model of another shape: dim=32 (this run: 64); expected the same model.* "
     "settings as the run that saved it"),
    ({"model.n_layers": "3", "model.tie_embeddings": "true"},
     "n_layers=2 (this run: 3), tie_embeddings=False (this run: True)"),
])
def test_resuming_into_another_model_or_vocabulary_isrefused(capsys, saved, over, expected):
    log, digest = saved
    message = refused(capsys, *_args(**{"log.dir": str(log), "checkpoint.resume": "auto",
                                         **over}))
    assert message.startswith(f"checkpoint {log / 'checkpoints' / 'step_00000002'} ")
    assert expected in message
    assert _digest(log / "checkpoints") == digest


def test_a_typo_in_the_fault_spec_is_refused_before_launch(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=3:phase=bakward")
    message = refused(capsys, *_args(**{"log.dir": str(tmp_path)}))
    assert message.startswith("SHARDWISE_FAULT: unknown phase 'bakward'; expected one of start")


def _train_reporting(cfg, data):
    try:
        train(cfg, data, build_env(cfg))
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return f"{type(exc).__name__}: {exc}"
    return "finished"


def test_a_full_disk_during_a_save_fails_clearly_and_keeps_the_last_checkpoint(saved, tmp_path):
    log, _ = saved
    shutil.copytree(log / "checkpoints", tmp_path / "checkpoints")
    before = _digest(tmp_path / "checkpoints")
    cfg, data = preflight(load_config(None, {**TINY, "train.steps": "4", "log.dir": str(tmp_path),
                                             "checkpoint.resume": "auto"}), world_size=2)
    outcomes = run_ranks(_train_reporting, 2, args=(cfg, data), timeout_s=120,
                         env={"SHARDWISE_FAULT": "enospc:rank=1:step=4"})
    target = tmp_path / "checkpoints" / "step_00000004"
    for outcome in outcomes:  # every rank says which save failed, and why
        assert outcome.startswith(f"RuntimeError: saving checkpoint {target} failed"), outcome
        assert "No space left on device" in outcome
    assert checkpoint.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    kept = {k: v for k, v in _digest(tmp_path / "checkpoints").items()
            if k.startswith("step_00000002")}
    assert kept == before  # the previous checkpoint: byte for byte
    checkpoint.verify(tmp_path / "checkpoints" / "step_00000002")
    with pytest.raises(RankFailure):  # ...and resuming from it works once the disk has room
        run_ranks(train_rank, 2, args=(cfg, data), timeout_s=120,
                  env={"SHARDWISE_FAULT": "enospc:rank=0:step=4"})
    run_ranks(train_rank, 2, args=(cfg, data), timeout_s=120)
    assert checkpoint.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"
