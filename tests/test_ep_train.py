"""Expert parallelism in the trainer (issue 13): ``--parallel.ep``, every refusal before
launch (those of EP x PP are in tests/test_ep_pp_train.py), the layout in the start line and
``summary.json``, the losses of ``--model.name debug-moe --parallel.ep 2`` equal to the ep 1
run's (same global batch, same routing), those of ``--parallel.tp 2 --parallel.ep 2`` on 4
ranks equal to ``--parallel.tp 2``'s, and ``--checkpoint.resume auto`` of an ep 2
checkpoint at ep 1, stage 1.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import cli_args, logged, refused, train_rank
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight

TINY = {"model.name": "debug-moe", "model.dim": "32", "model.n_layers": "2",
        "model.n_heads": "4", "model.n_kv_heads": "2", "model.moe_ffn_dim": "48",
        "data.seq_len": "32", "train.batch_size": "2", "train.eval_batches": "1",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "0", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1"}
CLI = cli_args(TINY)



@pytest.mark.parametrize("args, expected", [
    (["--nproc", "4", "--parallel.ep", "3"],
     "parallel.ep=3 must divide parallel.dp_shard=4"),
    (["--nproc", "2", "--parallel.ep", "2", "--model.name", "debug"],
     "parallel.ep=2 needs a mixture-of-experts model; 'debug' has no MoE layers"),
    (["--nproc", "4", "--parallel.ep", "4", "--model.num_experts", "6"],
     "parallel.ep=4 must divide the number of experts (model.num_experts=6)"),
    (["--nproc", "4", "--parallel.ep", "2", "--parallel.tp", "2",
      "--parallel.sequence_parallel", "false"],
     "parallel.ep=2 with parallel.tp=2 needs sequence parallelism"),
    (["--parallel.ep", "0"], "parallel.ep must be a positive int (expert-parallel degree)"),
    (["--nproc", "4", "--parallel.ep", "4", "--parallel.tp", "2"],
     "parallel.ep=4 must divide parallel.dp_shard=2"),
    (["--nproc", "4", "--parallel.ep", "4", "--parallel.pp", "2"],
     "parallel.ep=4 must divide parallel.dp_shard=2"),
])
def test_bad_expert_layouts_are_refused_before_launch(capsys, tmp_path, args, expected):
    assert expected in refused(capsys, *CLI, "--log.dir", str(tmp_path / "out"), *args)


def _run(log_dir: Path, world: int, **over: str):
    cfg = load_config(None, {**TINY, "log.dir": str(log_dir), **over})
    cfg, data = preflight(cfg, world_size=world)
    run_ranks(train_rank, world, args=(cfg, data), timeout_s=300)
    return cfg




def test_debug_moe_trains_at_ep_2_like_ep_1_and_resumes_at_ep_1(tmp_path, capfd):
    code = main(["train", *CLI, "--nproc", "2", "--parallel.ep", "2", "--log.dir",
                 str(tmp_path / "ep"), "--checkpoint.interval", "2", "--moe.balance", "bias",
                 "--moe.bias_update_rate", "0.01"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "layout dp_shard 2 (ep 2), ZeRO stage 3" in out
    summary = json.loads((tmp_path / "ep" / "summary.json").read_text())
    assert summary["layout"]["ep"] == 2 and summary["layout"]["dp_shard"] == 2
    _run(tmp_path / "dp", 2, **{"moe.balance": "bias", "moe.bias_update_rate": "0.01"})
    ep, dp = logged(tmp_path / "ep"), logged(tmp_path / "dp")
    assert len(ep) == len(dp) == 4
    for a, b in zip(ep, dp):
        for key in ("loss", "grad_norm", "aux_loss", "z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
        assert a["moe_tokens_min"] == b["moe_tokens_min"]  # the same routing
        assert a["moe_tokens_max"] == b["moe_tokens_max"]
    # tp 2 x dp_shard 2 on 4 ranks, ep 2 against ep 1: each tensor rank routes its sequence
    # shard. (Against the tp 1 run routing may differ: tensor parallelism reassociates the
    # attention's sums, and a near-tie between two experts' scores can flip.)
    bias = {"moe.balance": "bias", "moe.bias_update_rate": "0.01"}
    _run(tmp_path / "tp-ep2", 4, **{"parallel.tp": "2", "parallel.ep": "2", **bias})
    _run(tmp_path / "tp-ep1", 4, **{"parallel.tp": "2", **bias})
    tp_ep1 = logged(tmp_path / "tp-ep1")
    for a, b in zip(logged(tmp_path / "tp-ep2"), tp_ep1, strict=True):
        for key in ("loss", "grad_norm", "aux_loss", "z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
        assert a["moe_tokens_cv"] == b["moe_tokens_cv"]
    assert tp_ep1[0]["loss"] == pytest.approx(dp[0]["loss"], rel=1e-4)
    # The step-2 checkpoint of the ep 2 run, resumed at ep 1 on 2 ranks, stage 1.
    shutil.copytree(tmp_path / "ep" / "checkpoints" / "step_00000002",
                    tmp_path / "back" / "checkpoints" / "step_00000002")
    _run(tmp_path / "back", 2, **{"checkpoint.resume": "auto", "parallel.stage": "1",
                                  "moe.balance": "bias", "moe.bias_update_rate": "0.01"})
    summary = json.loads((tmp_path / "back" / "summary.json").read_text())
    assert summary["checkpoint"]["resumed_from_step"] == 2
    assert summary["layout"]["ep"] == 1 and summary["zero_stage"] == 1
    back = logged(tmp_path / "back")
    assert [r["step"] for r in back] == [3, 4]
    for a, b in zip(back, ep[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
