"""Non-finite losses and gradients: caught before the optimizer step, named identically on
every rank, with the ``stop`` and ``skip`` policies of the trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing.dist import RankFailure, run_ranks
from shardwise.train.config import load_config
from shardwise import find_nonfinite_grads  # the public spelling
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)
TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "0"}


def test_a_plain_model_names_the_first_offending_parameter():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model(torch.ones(2, 3)).sum().backward()
    assert find_nonfinite_grads(model, loss=1.0) is None
    model[2].weight.grad[1, 0] = math.inf
    model[2].bias.grad[0] = math.nan
    report = find_nonfinite_grads(model, loss=1.0)
    assert (report.param, report.kind, report.bad_elements) == ("2.weight", "inf", 1)
    assert report.message(7) == ("non-finite gradient at step 7: first offending parameter "
                                 "'2.weight' (inf, 1 element on rank 0)")
    only_loss = find_nonfinite_grads(nn.Linear(2, 2), loss=math.nan)
    assert only_loss.param is None and only_loss.message(3) == (
        "loss is nan on rank 0 at step 3 (ranks with non-finite loss: [0])")


def _sharded_check(stage: int):
    model = build_model(get_model_config("debug", **LLAMA), seed=0)
    shardwise.shard(model, stage=stage, wrap={TransformerBlock})
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens).float().logsumexp(-1).mean().backward()
    clean = find_nonfinite_grads(model, loss=1.0)
    name = "layers.1.attention.wq.weight"
    grad = dict(model.named_parameters())[name].grad
    if dist.get_rank() == 1:
        grad.view(-1)[:3] = math.nan  # this rank's shard only
    report = find_nonfinite_grads(model, loss=math.inf if dist.get_rank() == 0 else 0.5)
    return clean, report


@pytest.mark.parametrize("stage", [0, 3])
def test_all_ranks_agree_on_the_offending_parameter_of_a_sharded_model(stage):
    results = run_ranks(_sharded_check, 2, args=(stage,), timeout_s=60)
    assert all(clean is None for clean, _ in results)
    reports = {r for _, r in results}
    assert len(reports) == 1  # identical on every rank
    report = reports.pop()
    assert (report.param, report.param_ranks, report.kind) == (
        "layers.1.attention.wq.weight", (1,), "nan")
    assert report.bad_elements == 3 and report.loss_ranks == (0,)
    assert report.message(5) == (
        "loss is inf on rank 0 at step 5 (ranks with non-finite loss: [0]); first non-finite "
        "gradient: 'layers.1.attention.wq.weight' (nan, 3 elements on rank 1)")


def _train_logged(cfg, data):
    try:
        train(cfg, data, build_env(cfg))
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return f"{type(exc).__name__}: {exc}"
    return "finished"


def _run(tmp_path: Path, fault: str, policy: str) -> list[str]:
    cfg = load_config(None, {**TINY, "log.dir": str(tmp_path), "train.nonfinite": policy})
    cfg, data = preflight(cfg, world_size=2)
    return run_ranks(_train_logged, 2, args=(cfg, data), env={"SHARDWISE_FAULT": fault},
                     timeout_s=120)


GRAD_FAULT = "nan:rank=1:step=2:phase=grad:param=layers.0.feed_forward.w2.weight"


def test_stop_names_the_step_and_parameter_before_the_optimizer_steps(tmp_path):
    outcomes = _run(tmp_path, GRAD_FAULT, "stop")
    assert outcomes[0] == outcomes[1] == (
        "NonFiniteError: non-finite gradient at step 2: first offending parameter "
        "'layers.0.feed_forward.w2.weight' (nan, 1 element on rank 1); try a lower optim.lr, "
        "or train.nonfinite = 'skip' to drop such steps")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1]  # step 2 never reached the optimizer


def test_skip_drops_the_update_and_training_goes_on(tmp_path):
    outcomes = _run(tmp_path, "nan:rank=0:step=3:phase=loss", "skip")
    assert outcomes == ["finished", "finished"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
               .splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["skipped"] is True
    assert records[2]["nonfinite"].startswith("loss is nan on rank 0 at step 3 (ranks with "
                                              "non-finite loss: [0]); first non-finite gradient")
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 1


def test_an_unknown_parameter_in_a_fault_is_refused(tmp_path):
    with pytest.raises(RankFailure, match="param 'nope' is not a parameter of the model"):
        cfg = load_config(None, {**TINY, "log.dir": str(tmp_path)})
        cfg, data = preflight(cfg, world_size=2)
        run_ranks(_train_raises, 2, args=(cfg, data), timeout_s=60,
                  env={"SHARDWISE_FAULT": "nan:rank=0:step=1:phase=grad:param=nope"})


def _train_raises(cfg, data):
    train(cfg, data, build_env(cfg))
