"""Tensor parallelism in the trainer (issue 11): ``--parallel.tp`` and
``--parallel.sequence_parallel``, every refusal before launch, the layout in the start line
and ``summary.json``, batch semantics (tensor ranks share their data rank's batch: the
losses equal the data-parallel run's), and ``--checkpoint.resume auto`` at another degree.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import cli_args, logged, refused, train_rank
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.parallelize import validate_tp
from shardwise.train.preflight import build_model_config, preflight

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "2", "train.eval_batches": "1",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "0", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1"}
CLI = cli_args(TINY)



@pytest.mark.parametrize("args, expected", [
    (["--nproc", "3", "--parallel.tp", "2"],
     "parallel.dp_replicate * parallel.tp = 1 * 2 = 2 does not divide the world size 3"),
    (["--nproc", "4", "--parallel.tp", "2", "--parallel.dp_shard", "3"],
     "parallel.dp_replicate * parallel.dp_shard * parallel.tp = 1 * 3 * 2 = 6, expected the "
     "world size 4"),
    (["--nproc", "4", "--parallel.tp", "4", "--model.n_heads", "2", "--model.n_kv_heads", "2"],
     "parallel.tp=4: n_heads=2 is not divisible by tp=4"),
    (["--nproc", "3", "--parallel.tp", "3", "--model.dim", "48", "--model.n_heads", "6",
      "--model.n_kv_heads", "3", "--data.seq_len", "30"],
     "parallel.tp=3: vocab_size=256 is not divisible by tp=3"),
    (["--nproc", "2", "--parallel.tp", "3"],  # the ranks before the shapes (issue 30.7)
     "parallel.dp_replicate * parallel.tp = 1 * 3 = 3 does not divide the world size 2"),
    (["--nproc", "2", "--parallel.tp", "2", "--data.seq_len", "31"],
     "data.seq_len=31 must be divisible by parallel.tp=2 with sequence parallelism"),
    (["--parallel.sequence_parallel", "true"],
     "parallel.sequence_parallel=true needs parallel.tp > 1"),
])
def test_bad_layouts_are_refused_before_launch(capsys, tmp_path, args, expected):
    assert expected in refused(capsys, *CLI, "--log.dir", str(tmp_path / "out"), *args)


def test_a_tensor_group_wider_than_a_node_is_warned(monkeypatch):
    cfg = load_config(None, {**TINY, "parallel.tp": "4"})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match="parallel.tp=4 is more than the 2 ranks of a node"):
        validate_tp(cfg, build_model_config(cfg, 256), world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_tp(cfg, build_model_config(cfg, 256), world_size=8)


def _run(log_dir: Path, world: int, **over: str):
    cfg = load_config(None, {**TINY, "log.dir": str(log_dir), **over})
    cfg, data = preflight(cfg, world_size=world)
    run_ranks(train_rank, world, args=(cfg, data), timeout_s=300)
    return cfg




def test_tp_trains_like_data_parallel_and_resumes_at_another_degree(tmp_path, capfd):
    # tp 2 x dp_shard 2 on 4 ranks: the global batch is 2 data ranks x 2 sequences, so the
    # losses are those of 2 data-parallel ranks (tp does not multiply the batch).
    code = main(["train", *CLI, "--nproc", "4", "--parallel.tp", "2", "--log.dir",
                 str(tmp_path / "tp"), "--checkpoint.interval", "2"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "layout tp 2 (sequence parallel) x dp_shard 2, ZeRO stage 3" in out
    summary = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert summary["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2,
                                 "ep": 1, "sequence_parallel": True, "stage": 3}
    assert summary["tokens"] == 4 * 2 * 2 * 32  # steps x data ranks x batch x seq_len
    _run(tmp_path / "dp", 2)
    tp, dp = logged(tmp_path / "tp"), logged(tmp_path / "dp")
    for a, b in zip(tp, dp):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    # The step-2 checkpoint of the tp 2 run, resumed at tp 1 on 2 ranks, stage 2.
    shutil.copytree(tmp_path / "tp" / "checkpoints" / "step_00000002",
                    tmp_path / "back" / "checkpoints" / "step_00000002")
    _run(tmp_path / "back", 2, **{"checkpoint.resume": "auto", "parallel.stage": "2"})
    summary = json.loads((tmp_path / "back" / "summary.json").read_text())
    assert summary["checkpoint"]["resumed_from_step"] == 2
    assert summary["layout"]["tp"] == 1 and summary["zero_stage"] == 2
    back = logged(tmp_path / "back")
    assert [r["step"] for r in back] == [3, 4]
    for a, b in zip(back, tp[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
