"""The watchdog around the real trainer and engine: a rank that hangs in backward, and a rank
whose engine skips one collective (debug mode), each end every rank with one report naming
the rank, the collective and the step, within the configured timeout."""

from __future__ import annotations

import time

from shardwise.testing.dist import run_ranks
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

T = 3.0
TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "0", "parallel.timeout_s": str(T)}


def _train_until_stopped(cfg, data):
    from shardwise.distributed.watchdog import CollectiveError

    env = build_env(cfg)
    start = time.monotonic()
    try:
        train(cfg, data, env)
    except CollectiveError as exc:
        return time.monotonic() - start, str(exc)
    return None, "finished"


def _run(tmp_path, fault: str, **over: str):
    cfg = load_config(None, {**TINY, "log.dir": str(tmp_path), **over})
    cfg, data = preflight(cfg, world_size=2)
    return run_ranks(_train_until_stopped, 2, args=(cfg, data), timeout_s=120,
                     env={"SHARDWISE_FAULT": fault})


def test_a_rank_hanging_in_backward_is_named_with_its_stack(tmp_path):
    results = _run(tmp_path, "hang:rank=1:step=2:phase=backward")
    (t0, report), (t1, report1) = results
    assert report == report1
    head = report.splitlines()[0]
    assert head.startswith("shardwise watchdog: collective ") and head.endswith(
        "did not complete within 3 s on rank 0: rank 1 never issued it"), head
    assert "rank 0 (host" in report and "at step 2" in report
    assert "rank 1 (host" in report and "not in a collective at step 2" in report
    assert "in _arm_model" not in report and "faults.py" in report  # rank 1's stack: the hang
    assert max(t0, t1) < 60  # building + 1 step + the 3 s timeout + the exchange


def test_an_engine_collective_skipped_on_one_rank_is_caught_before_it_runs(tmp_path):
    results = _run(tmp_path, "skip:rank=1:step=3:label=clip_grad_norm",
                   **{"parallel.watchdog": "debug"})
    reports = {r[1] for r in results}
    assert len(reports) == 1
    report = reports.pop()
    head = report.splitlines()[0]
    assert head.startswith("shardwise watchdog: ranks disagree on collective seq "), head
    assert head.endswith(": rank 0 issued all_reduce 'clip_grad_norm' float32[1]; rank 1 issued "
                         "all_gather 'train.stats' float64[4]"), head
    assert "at step 3" in report
