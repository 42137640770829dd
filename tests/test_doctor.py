"""``shardwise doctor`` and the same check at the start of every run: ranks that differ in
versions, device, backend or config are named with the value; a test all-reduce checks and
times the network."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing.dist import run_ranks
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.doctor import check_ranks, config_hash
from shardwise.train.trainer import build_env


def _check(overrides_by_rank: dict, torch_by_rank: dict):
    rank = dist.get_rank()
    cfg = load_config(None, overrides_by_rank.get(rank, {}))
    if rank in torch_by_rank:
        torch.__version__ = torch_by_rank[rank]  # this process only: a rank with another torch
    try:
        return check_ranks(cfg, build_env(cfg), test_bytes=1 << 16)
    except ValueError as exc:
        return f"ValueError: {exc}"


def test_agreeing_ranks_report_and_pass_the_test_all_reduce():
    outcomes = run_ranks(_check, 3, args=({}, {}), timeout_s=60)
    assert outcomes[0] == outcomes[1] == outcomes[2]  # every rank holds every report
    reports = outcomes[0]["reports"]
    assert [r["rank"] for r in reports] == [0, 1, 2]
    assert len({r["config_hash"] for r in reports}) == 1 and len({r["pid"] for r in reports}) == 3
    assert outcomes[0]["all_reduce"]["ok"] and outcomes[0]["all_reduce"]["sum"] == 6


def test_a_rank_with_another_torch_is_named_on_every_rank():
    outcomes = run_ranks(_check, 2, args=({}, {1: "2.12.0"}), timeout_s=60)
    expected = (f"ValueError: the ranks of this job do not match: rank 1 runs torch '2.12.0'; "
                f"expected torch {str(torch.__version__)!r} as on rank 0")
    assert outcomes == [expected, expected]


def test_a_rank_with_another_config_is_named_with_the_first_differing_key():
    outcomes = run_ranks(_check, 3, args=({2: {"optim.lr": "0.001"}}, {}), timeout_s=60)
    assert set(outcomes) == {"ValueError: the ranks of this job do not match: rank 2 runs "
                             "another config (optim.lr = 0.001, rank 0: 0.003)"}


def test_config_hash_follows_every_value():
    assert config_hash(load_config(None, {})) == config_hash(load_config(None, {}))
    assert config_hash(load_config(None, {})) != config_hash(
        load_config(None, {"checkpoint.keep_last": "4"}))


def _train_here_with(overrides_by_rank: dict):
    from shardwise.train.launch import _train_here

    cfg = load_config(None, {"train.steps": "1", **overrides_by_rank.get(dist.get_rank(), {})})
    try:
        _train_here(cfg)
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_a_run_with_mismatched_ranks_stops_before_building_the_model():
    outcomes = run_ranks(_train_here_with, 2, args=({1: {"model.dim": "64"}},), timeout_s=60)
    assert outcomes == ["the ranks of this job do not match: rank 1 runs another config "
                        "(model.dim = 64, rank 0: unset)"] * 2


def test_the_doctor_command(capsys):
    assert main(["doctor", "--nproc", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["rank", "host", "pid", "device", "backend", "torch", "shardwise",
                              "python", "config_hash"]
    assert out[1].split()[0] == "0" and out[1].split()[4] == "gloo"
    assert out[2].startswith("test all-reduce: sum 1 = 1 on every rank; 4 MiB in ")
    assert out[3] == "ok: 1 rank(s) agree on device, backend, versions and config"


def test_the_doctor_command_refuses_bad_options(capsys):
    assert main(["doctor", "--parallel.stage", "9"]) == 2
    assert "parallel.stage must be a ZeRO stage in 0..3, got 9" in capsys.readouterr().err
