"""Offload inside the engine: the policy given to ``shard``, two ranks at stage 3, and the
guard against an optimizer that was not wrapped (the wrapper itself: test_offload.py)."""

from __future__ import annotations

import os

import pytest
import torch

import shardwise
from shardwise.models import TransformerBlock
from shardwise.shard.offload import Offload, OffloadedOptimizer, offload_optimizer
from shardwise.testing import run_ranks
from test_offload import BUFFER_MB, OPTIMIZERS, _batches, _model, _same, _train


def test_policy_given_to_shard_is_found_on_the_model(tmp_path):
    from shardwise.shard.api import engine_states
    model = shardwise.shard(_model(), stage=3, wrap={TransformerBlock})
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs offload=Offload"):
        offload_optimizer(opt, model=model)
    policy = Offload(device="disk", path=str(tmp_path), buffer_mb=BUFFER_MB)
    engine_states(model)[0].offload = policy  # what shard(..., offload=policy) records
    with offload_optimizer(opt, model=model) as wrapped:
        assert wrapped.offload is policy
        mine = wrapped.model_params()
        assert len(mine) == len(list(model.parameters()))
        assert all(a is b for a, b in zip(mine, model.parameters()))


def _two_rank_parity(path: str):
    """No offload, CPU and disk offload at stage 3 on this rank: the same weights."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    weights, info = {}, {}
    for kind in ("none", "cpu", "disk"):
        model = shardwise.shard(_model(), stage=3, wrap={TransformerBlock})
        opt = OPTIMIZERS["adamw"](model.parameters())
        if kind != "none":
            opt = offload_optimizer(opt, Offload(device="disk", path=path, buffer_mb=0.1)
                                    if kind == "disk" else Offload(), model=model)
        _train(model, opt, _batches(3, rank, world))
        weights[kind] = [p.detach().clone() for p in model.parameters()]
        if kind == "disk":
            st = opt.stats()
            info = dict(run_dir=st.run_dir, exists=os.path.exists(st.run_dir),
                        peak=st.peak_resident_bytes, buffer=st.buffer_bytes,
                        file=st.file_bytes)
            torch.distributed.barrier()  # both ranks' files exist at the same time here
            info["listing"] = sorted(os.listdir(path))
            torch.distributed.barrier()  # both have looked before either removes its files
            opt.close()
    return (_same(weights["none"], weights["cpu"]), _same(weights["none"], weights["disk"]),
            info)


def test_two_ranks_stage3_offload_is_bitwise_equal(tmp_path):
    results = run_ranks(_two_rank_parity, world_size=2, args=(str(tmp_path),), timeout_s=120)
    dirs = []
    for cpu_same, disk_same, info in results:
        assert cpu_same and disk_same
        assert info["exists"] and 0 < info["peak"] <= info["buffer"] < info["file"]
        assert os.path.dirname(info["run_dir"]) == str(tmp_path)
        dirs.append(os.path.basename(info["run_dir"]))
        assert len(info["listing"]) == 2  # one run directory per rank, side by side
    assert dirs[0] != dirs[1] and "rank0" in dirs[0] and "rank1" in dirs[1]
    assert os.listdir(tmp_path) == []
    assert isinstance(OffloadedOptimizer, type)


def test_shard_records_the_policy_and_refuses_an_unwrapped_optimizer(tmp_path):
    import shardwise

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    policy = shardwise.Offload(device="disk", path=str(tmp_path), buffer_mb=1)
    shardwise.shard(model, stage=3, offload=policy)
    plain = torch.optim.AdamW(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="was not wrapped: use opt = shardwise.offload_optimiz"):
        plain.step()
    with shardwise.offload_optimizer(torch.optim.AdamW(model.parameters()), model=model) as opt:
        opt.step()
        assert opt.stats().offloaded_bytes > 0
    with pytest.raises(ValueError, match="offload must be a shardwise.Offload, got str"):
        shardwise.shard(torch.nn.Linear(2, 2), offload="disk")
    with pytest.raises(ValueError, match=r"Offload\(path='.*nope'\) does not exist; create the "
                       "directory first"):
        shardwise.shard(torch.nn.Linear(2, 2),
                        offload=shardwise.Offload(device="disk", path=str(tmp_path / "nope")))
