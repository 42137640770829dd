"""Checkpoints across EP x PP layouts, exactly (issue 13).

One launch of 4 ranks: an MoE model (bias balancing, so the routers' ``expert_bias`` buffers
move) trains two AdamW steps at pp 2 x dp_shard 2 with ep 2 (ZeRO 3), is saved, and takes a
third step there as the reference. A fresh model and optimizer at pp 1 x ep 2 (dp_shard 4,
edp 2, ZeRO 1) and at pp 1 x ep 1 (dp_shard 4, ZeRO 3) load the checkpoint: the weights and
biases are bitwise the saved ones, the state-dict names are the unsplit model's, and the
third step from them matches the reference within 1e-5 (the Adam moments and step count came
back; every layout computes the same global micro-batches). The other way round, the pp 1 x
ep 2 model saved after its third step loads bitwise into pp 2 x ep 2 and pp 2 x ep 1
(dp_shard 2) pipelines, whose fourth steps agree.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.checkpoint import load, save
from shardwise.distributed.parallel_dims import ParallelDims
from shardwise.models import (MoESettings, TransformerBlock, build_model, configure_moe,
                              finish_moe_step, get_model_config, init_module_weights,
                              moe_aux_loss)
from shardwise.parallel import apply_ep, apply_global_balance
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule,
                                         finish_pipeline_moe_step, shard_stages, split_stages)
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err

SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, moe_ffn_dim=48, vocab_size=64,
             max_seq_len=16)
CFG = get_model_config("debug-moe", **SMALL)
MICRO, PER_MICRO, SEQ = 2, 4, 8  # global micro-batches per step, sequences in each


def _global_microbatch(step: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + mb)
    return torch.randint(0, CFG.vocab_size, (PER_MICRO, SEQ + 1), generator=g)


def _share(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    per = t.shape[0] // ranks
    return t[rank * per:(rank + 1) * per]


def _settings(model):
    return configure_moe(model, MoESettings(balance="bias", bias_update_rate=0.01))


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _mesh(cache: dict, pp: int, ep: int):
    dims = ParallelDims(world_size=dist.get_world_size(), pp=pp, ep=ep).resolved()
    if dims not in cache:
        cache[dims] = dims.build_mesh()
    return cache[dims]


def _pipeline(cache: dict, ep: int, stage: int):
    mesh = _mesh(cache, 2, ep)
    sched = build_schedule("1f1b", pp=2, microbatches=MICRO)
    model = _settings(build_model(CFG, device="meta"))
    if ep > 1:
        apply_ep(model, mesh)
    part = split_stages(model, mesh, sched.virtual, placement=sched.placement)
    torch.manual_seed(1)  # another init than the checkpoint's: loading must overwrite it
    shard_stages(part, stage=stage, init_weights=init_module_weights)
    apply_global_balance(part, mesh.group("dp"))
    pipe = PipelineExecutor(part, sched)
    r, n = mesh.local_rank("dp"), mesh.size("dp")

    def step(k: int) -> None:
        mine = torch.cat([_share(_global_microbatch(k, mb), r, n) for mb in range(MICRO)])
        pipe.step(mine[:, :-1], mine[:, 1:])
    return part, step, lambda: finish_pipeline_moe_step(part)


def _whole(cache: dict, ep: int, stage: int):
    mesh = _mesh(cache, 1, ep)
    model = _settings(build_model(CFG, seed=1))
    if ep > 1:
        apply_ep(model, mesh)
    shardwise.shard(model, stage=stage, wrap={TransformerBlock}, mesh=mesh)
    apply_global_balance(model, mesh.group("dp"))
    r, n = mesh.local_rank("dp"), mesh.size("dp")

    def step(k: int) -> None:
        for mb in range(MICRO):
            t = _share(_global_microbatch(k, mb), r, n)
            with shardwise.no_sync(model) if mb < MICRO - 1 else contextlib.nullcontext():
                lm = F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
                ((lm + moe_aux_loss(model)) / MICRO).backward()
    return model, step, lambda: finish_moe_step(model)


def _train_step(model, opt, built, k: int) -> None:
    _, step, finish = built
    step(k)
    opt.step()
    opt.zero_grad()
    finish()


def _load_and_step(path: str, built, k: int, out: dict, name: str):
    model = built[0]
    opt = _optimizer(model)
    info = load(path, model, opt)
    out[f"{name}.loaded"] = shardwise.full_state_dict(model)
    out[f"{name}.step"] = info.step
    _train_step(model, opt, built, k)
    out[f"{name}.next"] = shardwise.full_state_dict(model)
    return model, opt


def _matrix(path: str) -> dict:
    torch.set_num_threads(1)
    cache, out = {}, {}
    built = _pipeline(cache, ep=2, stage=3)
    part = built[0]
    opt = _optimizer(part)
    for k in range(2):
        _train_step(part, opt, built, k)
    save(path, part, opt, step=2)
    out["saved"] = shardwise.full_state_dict(part)
    _train_step(part, opt, built, 2)
    out["reference"] = shardwise.full_state_dict(part)
    _load_and_step(path, _whole(cache, ep=1, stage=3), 2, out, "pp1xep1")
    model, opt = _load_and_step(path, _whole(cache, ep=2, stage=1), 2, out, "pp1xep2")
    save(path + "-pp1xep2", model, opt, step=3)  # back into pipelines
    for name, ep in (("pp2xep2", 2), ("pp2xep1", 1)):
        _load_and_step(path + "-pp1xep2", _pipeline(cache, ep=ep, stage=3), 3, out, name)
    return out


def _union(results: list[dict], key: str) -> dict:
    merged: dict = {}
    for r in results:
        merged.update(r[key])
    return merged


def _bitwise(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in want:
        assert torch.equal(got[k], want[k]), (where, k)


def test_save_at_pp2_ep2_loads_exactly_at_pp1_ep2_and_pp1_ep1_and_back(tmp_path):
    results = run_ranks(_matrix, 4, args=(str(tmp_path / "ckpt"),), timeout_s=300, threads=1)
    saved, reference = _union(results, "saved"), _union(results, "reference")
    assert set(saved) == set(build_model(CFG, device="meta").state_dict())  # unsplit names
    assert any(v.any() for k, v in saved.items() if k.endswith("expert_bias"))
    for name in ("pp1xep1", "pp1xep2"):
        _bitwise(_union(results, f"{name}.loaded"), saved, name)
        assert results[0][f"{name}.step"] == 2
        err, key = max_rel_err(_union(results, f"{name}.next"), reference)
        assert err < 1e-5, (name, err, key)
    back = _union(results, "pp1xep2.next")
    fourth = _union(results, "pp2xep2.next")
    for name in ("pp2xep2", "pp2xep1"):
        _bitwise(_union(results, f"{name}.loaded"), back, name)
        assert results[0][f"{name}.step"] == 3
        err, key = max_rel_err(_union(results, f"{name}.next"), fourth)
        assert err < 1e-5, (name, err, key)
