"""Mixed precision: bf16 / fp16 compute over fp32 master shards, loss scaling with skips.

Documented tolerance: over 120 steps of a small Llama on 2 ranks (AdamW lr 1e-3, loss
falling from 4.1 to about 0.8; fp16 skips its first step on overflow, as dynamic scaling
does), the bf16 and fp16 loss curves stay within 0.05 of the fp32 curve (mean absolute
difference over the last 20 steps), and the mean of their last 20 losses is within 5% of
fp32's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise import LossScaler, MixedPrecision
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.shard.identity import TAG_BYTES
from shardwise.testing import run_ranks

CFG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
           multiple_of=16)
STEPS = 120


def _text_like_batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """A learnable stream: tokens follow a noisy fixed permutation."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(64, generator=g)
    start = torch.randint(0, 64, (steps, batch, 1), generator=g)
    toks = [start]
    for _ in range(seq):
        nxt = perm[toks[-1]]
        noise = torch.rand(nxt.shape, generator=g) < 0.1
        toks.append(torch.where(noise, torch.randint(0, 64, nxt.shape, generator=g), nxt))
    return torch.cat(toks, dim=-1)


def _train(stage: int, dtype: str | None, steps: int, init_scale: float = 2.0**16):
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = None
    if dtype:
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype="fp32")
    model = shardwise.shard(build_model(get_model_config("debug", **CFG), seed=0), stage=stage,
                            wrap={TransformerBlock}, mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=init_scale, enabled=dtype == "fp16")
    batches = _text_like_batches(steps, 4 * world, 16)
    losses, stepped, bytes_gathered = [], [], 0
    for s in range(steps):
        tok = batches[s, 4 * rank:4 * rank + 4]
        shardwise.reset_comm_stats()
        loss = F.cross_entropy(model(tok[:, :-1]).float().flatten(0, 1), tok[:, 1:].flatten())
        scaler.scale(loss).backward()
        gathers = shardwise.comm_stats()["all_gather"]
        # without the 8-byte unit identity each gather carries ([Note: gather identity])
        bytes_gathered = gathers.bytes_sent - gathers.calls * (world - 1) * TAG_BYTES
        before = [p.detach().clone() for p in model.parameters()]
        ok = scaler.step(model, opt)
        if not ok:  # a skipped step leaves every weight untouched
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        scaler.update()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        stepped.append(ok)
    dtypes = {p.dtype for p in model.parameters()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    return dict(losses=losses, stepped=stepped, skipped=scaler.skipped_steps,
                scale=scaler.scale_value, bytes=bytes_gathered, dtypes=dtypes, buffers=buffers)


def _curves(stage):
    return {d: _train(stage, d, STEPS) for d in (None, "bf16", "fp16")}


@pytest.mark.parametrize("stage", [3, 0])
def test_low_precision_follows_fp32_and_keeps_fp32_state(stage):
    runs = run_ranks(_curves, 2, args=(stage,), timeout_s=600)[0]
    ref = runs[None]["losses"]
    assert ref[-1] < ref[0] - 1.0  # it learns
    for d in ("bf16", "fp16"):
        cur = runs[d]["losses"]
        tail = sum(abs(a - b) for a, b in zip(cur[-20:], ref[-20:])) / 20
        assert tail < 0.05, (d, tail)
        mean_cur, mean_ref = sum(cur[-20:]) / 20, sum(ref[-20:]) / 20
        assert abs(mean_cur - mean_ref) / mean_ref < 0.05, (d, mean_cur, mean_ref)
        assert runs[d]["dtypes"] == {torch.float32}             # master shards
        assert set(runs[d]["buffers"].values()) == {torch.float32}  # RoPE tables
    if stage == 3:  # 16-bit gathers move half the bytes
        assert runs["bf16"]["bytes"] * 2 == runs[None]["bytes"]


def _overflow():
    return _train(2, "fp16", 6, init_scale=2.0**40)


def test_fp16_overflow_skips_steps_on_every_rank_and_backs_off():
    results = run_ranks(_overflow, 2)
    first = results[0]
    assert first["skipped"] >= 1 and first["stepped"][0] is False
    assert first["scale"] < 2.0**40
    assert all(r["stepped"] == first["stepped"] for r in results)  # ranks agree


def test_policy_and_scaler_refuse_bad_values():
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        MixedPrecision(param_dtype="int8")
    with pytest.raises(ValueError, match="MixedPrecision.reduce_dtype must be a floating dtype"):
        MixedPrecision(reduce_dtype=torch.int32)
    with pytest.raises(ValueError, match="need init_scale > 0"):
        LossScaler(init_scale=0)
    with pytest.raises(ValueError, match="mixed_precision must be a shardwise.MixedPrecision"):
        shardwise.shard(torch.nn.Linear(2, 2), mixed_precision="bf16")
