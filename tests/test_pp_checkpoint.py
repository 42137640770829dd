"""Checkpoints across pipeline layouts (issue 12): save at pp 2 x dp 2, load at pp 1 x dp 4 and
pp 4 x dp 1 exactly ([Note: checkpoints of pipeline parts] in checkpoint/state.py).

One launch of 4 ranks: train two AdamW steps at pp 2 x dp 2 (ZeRO 3), save, take a third
step there as the reference; then load the checkpoint into a fresh model and optimizer at
pp 1 x dp 4 (the plain sharded model) and at pp 4 x dp 1 (ZeRO 1): the loaded weights are
bitwise the saved ones, and the third step from them matches the reference (the Adam
moments and step count came back too). Tied embeddings ride along at pp 4, where the
embedding's mirror lives on another rank. Across pp x tp: the same checkpoint loads exactly
at pp 2 x tp 2 (vocab-parallel tied embedding, sequence parallelism), whose own checkpoint
after the third step loads bitwise at pp 1 x dp 4.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import load, save
from shardwise.distributed.parallel_dims import ParallelDims
from shardwise.models import LlamaConfig, TransformerBlock, build_model, init_module_weights
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, cross_entropy_loss,
                                         pipeline_mesh, shard_stages, split_stages)
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err

CFG = LlamaConfig(dim=16, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                  max_seq_len=8, tie_embeddings=True)
BATCH, SEQ = 8, 4


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _pipeline(pp: int, stage: int, schedule: str, microbatches: int, tp: int = 1):
    sched = build_schedule(schedule, pp=pp, microbatches=microbatches)
    model = build_model(CFG, device="meta")
    if tp == 1:
        mesh = pipeline_mesh(pp)
    else:
        mesh = ParallelDims(world_size=dist.get_world_size(), pp=pp, tp=tp).build_mesh()
        shardwise.apply_tp(model, mesh["tp"])
    part = split_stages(model, mesh, sched.virtual, placement=sched.placement)
    torch.manual_seed(1)  # another init than the checkpoint's: loading must overwrite it
    shard_stages(part, stage=stage, init_weights=init_module_weights)
    dp, r = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    pipe = PipelineExecutor(part, sched)

    def step(n: int) -> float:
        x, y = _batch(n)
        per = BATCH // dp
        return pipe.step(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]).item()
    return part, step


def _whole(world: int):
    model = shardwise.shard(build_model(CFG, device="meta"), stage=3, wrap={TransformerBlock},
                            init_weights=init_module_weights)
    r = dist.get_rank()

    def step(n: int) -> float:
        x, y = _batch(n)
        per = BATCH // world
        loss = cross_entropy_loss(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per])
        loss.backward()
        return loss.item()
    return model, step


def _train_step(model, opt, step_fn, n: int) -> None:
    step_fn(n)
    opt.step()
    opt.zero_grad()


def _matrix(path: str) -> dict:
    out = {}
    part, step = _pipeline(2, 3, "1f1b", 4)
    opt = _optimizer(part)
    for n in range(2):
        _train_step(part, opt, step, n)
    save(path, part, opt, step=2)
    out["saved"] = shardwise.full_state_dict(part)
    _train_step(part, opt, step, 2)
    out["reference"] = shardwise.full_state_dict(part)
    for name, build in (("pp1xdp4", lambda: _whole(4)),
                        ("pp4xdp1", lambda: _pipeline(4, 1, "zb1", 4)),
                        ("pp2xtp2", lambda: _pipeline(2, 3, "zb1", 4, tp=2))):
        model, step = build()
        opt = _optimizer(model)
        info = load(path, model, opt)
        out[f"{name}.loaded"] = shardwise.full_state_dict(model)
        out[f"{name}.step"] = info.step
        _train_step(model, opt, step, 2)
        out[f"{name}.next"] = shardwise.full_state_dict(model)
    save(path + "-pp2xtp2", model, opt, step=3)  # the pp 2 x tp 2 model, back at pp 1
    whole, _ = _whole(4)
    load(path + "-pp2xtp2", whole, _optimizer(whole))
    out["pp2xtp2.reloaded"] = shardwise.full_state_dict(whole)
    return out


def _union(results: list[dict], key: str) -> dict:
    merged: dict = {}
    for r in results:
        merged.update(r[key])
    return merged


def test_save_at_pp2_dp2_loads_exactly_at_pp1_dp4_pp4_dp1_and_pp2_tp2(tmp_path):
    results = run_ranks(_matrix, 4, args=(str(tmp_path / "ckpt"),), timeout_s=300, threads=1)
    saved, reference = _union(results, "saved"), _union(results, "reference")
    assert set(saved) == set(build_model(CFG, device="meta").state_dict())  # unsplit names
    for name in ("pp1xdp4", "pp4xdp1", "pp2xtp2"):
        loaded = _union(results, f"{name}.loaded")
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[k], saved[k]) for k in saved), name
        assert results[0][f"{name}.step"] == 2
        err, key = max_rel_err(_union(results, f"{name}.next"), reference)
        assert err < 1e-5, (name, err, key)
    saved_tp, reloaded = _union(results, "pp2xtp2.next"), _union(results, "pp2xtp2.reloaded")
    assert reloaded.keys() == saved_tp.keys()
    assert all(torch.equal(reloaded[k], saved_tp[k]) for k in saved_tp)
    assert dataclasses.asdict(CFG)["tie_embeddings"]
