"""Parity grid: every stage, world size and accumulation trains like one process.

stages {0, 1, 2, 3} x world sizes {1, 2, 3, 4} x accumulation {1, 4}, plus hybrid sharding
(2 replicas x 2 shards) at 4 ranks, against a single process on the same global batches:

* SGD + momentum on the edge-case model (every awkward case at once) and on a tied-embedding
  Llama: losses and final weights within 1e-5 relative, global gradient norm within 1e-6;
* AdamW on a Llama: losses within 1e-5, gradient norm within 1e-6, and weights no further
  from the reference than torch DDP's in the same run (Adam amplifies rounding noise).
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.models import EdgeBlock, EdgeCaseModel
from shardwise.testing.parity import (ParityConfig, ddp_run, make_batches, max_rel_err,
                                      reference_run, sharded_run)

STEPS, GLOBAL_BATCH, SEQ = 5, 12, 8          # 12 sequences divide among 1, 2, 3 and 4 ranks
LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def build_edge():
    torch.manual_seed(0)
    return EdgeCaseModel()


def build_llama():
    return build_model(get_model_config("debug", **LLAMA), seed=0)


def build_llama_tied():
    return build_model(get_model_config("debug", tie_embeddings=True, **LLAMA), seed=0)


MODELS = {
    "edge": (build_edge, {EdgeBlock}, 11, "sgd"),
    "llama_tied": (build_llama_tied, {TransformerBlock}, 64, "sgd"),
    "llama": (build_llama, {TransformerBlock}, 64, "adamw"),
}


def _configs(world: int, optimizer: str) -> list[ParityConfig]:
    cfgs = [ParityConfig(stage=s, accum=a, optimizer=optimizer, steps=STEPS)
            for s in (0, 1, 2, 3) for a in (1, 4)]
    if world == 4:
        cfgs += [ParityConfig(stage=s, accum=a, optimizer=optimizer, steps=STEPS, hybrid=True)
                 for s in (1, 2, 3) for a in (1, 4)]
    return cfgs


@functools.lru_cache(maxsize=None)
def _batches(vocab: int) -> torch.Tensor:
    return make_batches(seed=1, steps=STEPS, accum=4, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                        vocab=vocab)


@functools.lru_cache(maxsize=None)
def _reference(model: str, accum: int, optimizer: str):
    build, _, vocab, _ = MODELS[model]
    cfg = ParityConfig(stage=0, accum=accum, optimizer=optimizer, steps=STEPS)
    return reference_run(build, _batches(vocab), cfg)


def _grid_worker(world: int):
    out = {}
    for model, (build, wrap, vocab, optimizer) in MODELS.items():
        batches = _batches(vocab)
        for cfg in _configs(world, optimizer):
            out[(model, cfg.name)] = sharded_run(build, batches, cfg, wrap=wrap)
        if optimizer == "adamw" and world > 1:
            for accum in (1, 4):
                cfg = ParityConfig(stage=0, accum=accum, optimizer=optimizer, steps=STEPS)
                out[(model, "ddp-" + cfg.name)] = ddp_run(build, batches, cfg)
    return out


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_grid(world):
    per_rank = run_ranks(_grid_worker, world, args=(world,), timeout_s=600)
    results = per_rank[0]
    failures, rows = [], []
    for (model, name), res in results.items():
        if name.startswith("ddp-"):
            continue
        build, _, _, optimizer = MODELS[model]
        accum = int(name.split("accum")[1].split("-")[0])
        ref = _reference(model, accum, optimizer)
        for r in range(1, world):  # every rank saw the same global losses
            assert per_rank[r][(model, name)].losses == res.losses
        loss_err, norm_err = _rel(res.losses, ref.losses), _rel(res.grad_norms, ref.grad_norms)
        weight_err, where = max_rel_err(res.state, ref.state)
        rows.append(f"{model:10s} {name:28s} loss {loss_err:.1e} norm {norm_err:.1e} "
                    f"weights {weight_err:.1e} ({where})")
        if loss_err > 1e-5 or norm_err > 1e-6:
            failures.append(rows[-1])
        if optimizer == "sgd" and weight_err > 1e-5:
            failures.append(rows[-1])
        if optimizer == "adamw":
            ddp_key = (model, f"ddp-stage0-accum{accum}-adamw")
            if ddp_key in results:
                ddp_err, _ = max_rel_err(results[ddp_key].state, ref.state)
                if weight_err > 1.5 * ddp_err + 1e-6:
                    failures.append(rows[-1] + f" > DDP's {ddp_err:.1e}")
            elif weight_err > 1e-5:  # one rank: nothing to reduce, so no rounding noise
                failures.append(rows[-1])
    print("\n".join(rows))
    assert not failures, "parity failures:\n" + "\n".join(failures)
