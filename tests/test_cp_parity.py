"""Context parallelism trains like one process (issue 32).

One launch of ranks per world size runs the whole grid against a single process on the same
global batches (fp32, SGD with momentum): every implementation (ring, Ulysses, hybrid) with
zigzag and without, cp 2, 3 and 4, sequence lengths from 256 to 8,192, packed documents,
cp x tp (with sequence parallelism), cp x dp_shard at ZeRO stage 3, cp x ep on the MoE
model, activation checkpointing and ``torch.compile`` of the blocks. Losses and final
weights within 1e-5 relative, gradient norms within 1e-6 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.models.moe import finish_moe_step
from shardwise.testing import run_ranks
from shardwise.testing.cp_parity import CPConfig, cp_loss, cp_run
from shardwise.testing.parity import make_batches, max_rel_err, reference_run, rel_err

VOCAB = 64
SHAPES = {
    "gqa": dict(dim=32, n_heads=4, n_kv_heads=2),       # ring, hybrid (2-way all-to-all)
    "mha": dict(dim=32, n_heads=4, n_kv_heads=4),       # Ulysses at cp 4
    "h6": dict(dim=48, n_heads=6, n_kv_heads=3),        # Ulysses at cp 3
    "moe": dict(dim=32, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2, moe_ffn_dim=32),
}


def build(shape: str, max_len: int = 8192):
    return build_model(get_model_config("debug", n_layers=2, vocab_size=VOCAB, multiple_of=16,
                                        max_seq_len=max_len, **SHAPES[shape]), seed=0)


def C(cp, impl="ring", lb="zigzag", **kw) -> CPConfig:
    return CPConfig(cp=cp, impl=impl, load_balance=lb, **kw)


# (model shape, sequence length, global batch, config)
GRID = {
    2: [("gqa", 256, 2, C(2, impl, lb, documents=docs))
        for impl in ("ring", "ulysses") for lb in ("zigzag", "none") for docs in (False, True)]
       + [("gqa", 8192, 1, C(2, "ring", steps=2)), ("gqa", 8192, 1, C(2, "ulysses", steps=2)),
          ("gqa", 256, 2, C(2, compile=True)), ("gqa", 256, 2, C(2, "ulysses", compile=True))],
    3: [("gqa", 384, 2, C(3, "ring", lb, documents=docs))
        for lb in ("zigzag", "none") for docs in (False, True)]
       + [("h6", 384, 2, C(3, "ulysses", lb)) for lb in ("zigzag", "none")]
       + [("gqa", 3072, 1, C(3, "ring", steps=2))],
    4: [("gqa", 256, 2, C(4, "ring", lb)) for lb in ("zigzag", "none")]
       + [("mha", 256, 2, C(4, "ulysses", lb)) for lb in ("zigzag", "none")]
       + [("gqa", 256, 2, C(4, "hybrid", lb)) for lb in ("zigzag", "none")]
       + [("gqa", 256, 2, C(4, "hybrid", documents=True)),
          ("mha", 256, 2, C(4, "ulysses", "none", documents=True)),
          ("gqa", 256, 2, C(4, "ring", checkpoint=True, documents=True)),
          ("gqa", 256, 2, C(2, tp=2)), ("mha", 256, 2, C(2, "ulysses", tp=2)),
          ("gqa", 256, 2, C(2, dp_shard=2, stage=3)),
          ("gqa", 256, 2, C(2, "ulysses", dp_shard=2, stage=2, accum=2)),
          ("moe", 256, 2, C(2, ep=2, dp_shard=2, stage=3)),
          ("gqa", 8192, 1, C(4, "ring", steps=2))],
}


def _batches(seq: int, batch: int, cfg: CPConfig) -> torch.Tensor:
    return make_batches(seq, cfg.steps, cfg.accum, batch, seq, VOCAB)


def _grid(world: int) -> list[tuple[str, dict]]:
    cache: dict = {}
    out = []
    for shape, seq, batch, cfg in GRID[world]:
        res = cp_run(functools.partial(build, shape), _batches(seq, batch, cfg), cfg,
                     {TransformerBlock}, cache)
        out.append((f"{shape}-T{seq}-{cfg.name}", res))
    return out


@functools.cache
def _reference(shape: str, seq: int, batch: int, cfg: CPConfig):
    ref_cfg = CPConfig(cp=1, documents=cfg.documents, steps=cfg.steps, accum=cfg.accum)
    return reference_run(functools.partial(build, shape), _batches(seq, batch, cfg), ref_cfg,
                         loss_fn=cp_loss(cfg.documents, aux=shape == "moe"),
                         after_step=finish_moe_step if shape == "moe" else None)


@pytest.mark.parametrize("world", sorted(GRID))
def test_context_parallel_matches_one_process(world):
    results = run_ranks(_grid, world, (world,), timeout_s=600)[0]
    assert len(results) == len(GRID[world])
    failures = []
    for (shape, seq, batch, cfg), (name, res) in zip(GRID[world], results):
        ref = _reference(shape, seq, batch, cfg)
        loss = max(rel_err(torch.tensor(a), torch.tensor(b))
                   for a, b in zip(res.losses, ref.losses))
        norm = max(rel_err(torch.tensor(a), torch.tensor(b))
                   for a, b in zip(res.grad_norms, ref.grad_norms))
        weights, key = max_rel_err(res.state, ref.state)
        if loss > 1e-5 or norm > 1e-6 or weights > 1e-5:
            failures.append(f"{name}: loss {loss:.2e}, grad norm {norm:.2e}, weights "
                            f"{weights:.2e} ({key})")
    assert not failures, "\n".join(failures)
