"""Tensor (and sequence) parallelism trains like one process (issue 11).

One launch of ranks per world size runs the whole grid against a single process on the same
global batches, on a Llama with grouped-query attention (4 query heads, 2 KV heads: at tp 4
every KV head is copied to two tensor ranks) and on its tied-embedding twin:

* tp {2, 4}, tp 2 x dp_shard 2 at stages 2 and 3, hybrid tp 2 x dp_replicate 2, stage 0,
  accumulation, each with and without sequence parallelism, fp32 SGD + momentum: losses
  and final weights within 1e-5 relative, the global gradient norm within 1e-6;
* AdamW: weights within a few times torch DDP's deviation on the same ranks ([Note: AdamW
  noise floor] below);
* a meta-device build materialises bitwise equal to the eager build at any degree;
* bf16 compute with int8 gradient reduce-scatters trains (loss within 2% of fp32);
* a Hugging Face Llama built from a config, parallelised from its ``base_model_tp_plan``.

``SHARDWISE_TP_WIDE=1`` adds every stage x SP x accumulation combination.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config, \
    init_module_weights
from shardwise.testing import run_ranks
from shardwise.testing.parity import (ParityConfig, ddp_run, make_batches, max_rel_err,
                                      reference_run)
from shardwise.testing.tp_parity import TPConfig, mesh_for, tp_run

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 8, 64
LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=16,
             multiple_of=16)
WIDE = os.environ.get("SHARDWISE_TP_WIDE") == "1"


def build_llama(tie: bool = False, device: str = "cpu"):
    return build_model(get_model_config("debug", tie_embeddings=tie, **LLAMA), device=device,
                       seed=0)


MODELS = {"llama": functools.partial(build_llama, False),
          "llama_tied": functools.partial(build_llama, True)}


def C(**kw) -> TPConfig:
    return TPConfig(steps=STEPS, **kw)


def _grid(world: int) -> list[tuple[str, TPConfig]]:
    sgd = []
    for sp in (True, False):
        if world == 2:
            sgd += [C(tp=2, sp=sp), C(tp=2, stage=1, sp=sp, accum=2)]
        else:
            sgd += [C(tp=4, sp=sp), C(tp=2, stage=2, sp=sp),
                    C(tp=2, stage=3, sp=sp, accum=2 if sp else 1)]
    if world == 4:
        sgd += [C(tp=2, dp_replicate=2, stage=3), C(tp=2, stage=0, sp=False),
                C(tp=4, loss_parallel=False, sp=False)]
    if WIDE:
        sgd += [C(tp=2, stage=s, sp=sp, accum=a) for s in (0, 1, 2, 3)
                for sp in (True, False) for a in (1, 2)]
    out = [("llama", c) for c in sgd]
    out += [("llama_tied", C(tp=world)), ("llama_tied", C(tp=2, sp=False))]
    out += [("llama", C(tp=world, optimizer="adamw")),
            ("llama", C(tp=2, optimizer="adamw", sp=False))]
    return out


@functools.lru_cache(maxsize=None)
def _batches() -> torch.Tensor:
    return make_batches(seed=1, steps=STEPS, accum=2, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                        vocab=VOCAB)


@functools.lru_cache(maxsize=None)
def _reference(model: str, accum: int, optimizer: str):
    cfg = ParityConfig(stage=0, accum=accum, optimizer=optimizer, steps=STEPS)
    return reference_run(MODELS[model], _batches(), cfg)


def _meta_matches_eager(cfg: TPConfig, cache: dict) -> bool:
    """A meta-device build, parallelised and materialised, equals the eager build bitwise."""
    meta = build_llama(device="meta")
    shardwise.apply_tp(meta, mesh_for(cfg, cache)["tp"], sequence_parallel=cfg.sp)
    torch.manual_seed(0)
    mesh = mesh_for(cfg, cache)
    shardwise.shard(meta, stage=cfg.stage, wrap={TransformerBlock}, mesh=mesh,
                    init_weights=init_module_weights)
    full = shardwise.full_state_dict(meta)
    eager = build_llama().state_dict()
    return full.keys() == eager.keys() and all(torch.equal(full[k], eager[k]) for k in eager)


def _worker(world: int):
    cache: dict = {}
    out = {}
    for model, cfg in _grid(world):
        out[(model, cfg.name)] = tp_run(MODELS[model], _batches(), cfg, {TransformerBlock},
                                        cache)
    for accum in (1,):
        cfg = ParityConfig(stage=0, accum=accum, optimizer="adamw", steps=STEPS)
        out[("llama", "ddp-adamw")] = ddp_run(MODELS["llama"], _batches(), cfg)
    mp = C(tp=2, param_dtype="bf16", comm_grads="int8" if world == 4 else None)
    out[("llama", mp.name)] = tp_run(MODELS["llama"], _batches(), mp, {TransformerBlock}, cache)
    meta = [C(tp=world), C(tp=2, stage=1, sp=False)]
    out["meta"] = [_meta_matches_eager(c, cache) for c in meta]
    return out


ADAMW_NOISE = 8.0
"""[Note: AdamW noise floor] AdamW divides each gradient element by its own running size,
so an element whose gradient is near zero moves by about the learning rate whatever its
size, and a rounding difference that flips its sign moves it by twice that. The weights
after a few steps therefore differ from the reference by how the run rounds, not by
whether it is right: torch DDP, which only sums the gradients in another order, is the
yardstick. Tensor parallelism also splits every multiply's reduction over the ranks, so it
rounds differently in more places: within 1.5x DDP's deviation (the earlier bound) on
every machine CI ran on until 2026-12-03, then 3.2x (tp 2 on 2 ranks) and 4.5x (tp 2 x
dp 2 on 4 ranks; both in layers.1.feed_forward.w2) on the Xeon of 2026-12-04, whose
losses and gradient norms
still agreed within 1.1e-7 and 7.1e-7 and whose SGD runs of the same layouts kept every
weight within 1.3e-7. The gradients are what the SGD rows pin down; these rows catch an
optimizer state that is wrong, which moves the weights far beyond 8x DDP's 1.3e-4 here:
a weight decay applied twice moves them by 4 steps x lr 1e-2 x 0.1 = 4e-3."""


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 4])
def test_tp_parity_grid(world):
    per_rank = run_ranks(_worker, world, args=(world,), timeout_s=900)
    results = per_rank[0]
    assert all(r["meta"] == [True, True] for r in per_rank), [r["meta"] for r in per_rank]
    ddp_err, _ = max_rel_err(results[("llama", "ddp-adamw")].state,
                             _reference("llama", 1, "adamw").state)
    failures, rows = [], []
    for key, res in results.items():
        if key == "meta" or key[1] == "ddp-adamw":
            continue
        model, name = key
        accum = int(name.split("accum")[1].split("-")[0])
        optimizer = "adamw" if "adamw" in name else "sgd"
        ref = _reference(model, accum, optimizer)
        for r in range(1, world):  # every rank saw the same global losses and norms
            assert per_rank[r][key].losses == res.losses, name
        loss_err, norm_err = _rel(res.losses, ref.losses), _rel(res.grad_norms, ref.grad_norms)
        weight_err, where = max_rel_err(res.state, ref.state)
        rows.append(f"{model:10s} {name:42s} loss {loss_err:.1e} norm {norm_err:.1e} "
                    f"weights {weight_err:.1e} ({where})")
        if "mp-" in name:
            if loss_err > 2e-2:
                failures.append(rows[-1])
            continue
        if loss_err > 1e-5 or norm_err > 1e-6:
            failures.append(rows[-1])
        if optimizer == "sgd" and weight_err > 1e-5:
            failures.append(rows[-1])
        if optimizer == "adamw" and weight_err > ADAMW_NOISE * ddp_err + 1e-6:
            failures.append(rows[-1] + f" > DDP's {ddp_err:.1e}")
    print(f"DDP AdamW deviation at {world} ranks: {ddp_err:.1e}")
    print("\n".join(rows))
    assert not failures, "tensor-parallel parity failures:\n" + "\n".join(failures)
