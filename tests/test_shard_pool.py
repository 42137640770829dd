"""The staging-buffer pool: reuse, its working-set bound, and steps that allocate nothing new."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.distributed.pool import POOL, BufferPool
from shardwise.testing import run_ranks

F32 = torch.float32
CPU = torch.device("cpu")


def test_given_back_buffer_is_handed_out_again_by_size_and_dtype():
    pool = BufferPool()
    a = pool.take(100, F32, CPU)
    assert (pool.misses, pool.in_use_bytes) == (1, 400)
    pool.give(a)
    assert pool.cached_bytes == 400 and pool.in_use_bytes == 0
    assert pool.take(100, F32, CPU) is a and pool.hits == 1
    b = pool.take(100, torch.bfloat16, CPU)  # another dtype is another key
    c = pool.take(99, F32, CPU)  # and another size
    assert b is not a and c is not a and pool.misses == 3
    assert b.dtype == torch.bfloat16 and c.numel() == 99 and c.ndim == 1


def test_cache_keeps_each_size_up_to_its_working_set():
    pool = BufferPool()
    small = [pool.take(10, F32, CPU) for _ in range(3)]  # three 10-element buffers at once
    for t in small:
        pool.give(t)
    assert pool.cached_bytes == 120
    mid = pool.take(20, F32, CPU)
    pool.give(mid)
    assert pool.cached_bytes == 200
    stray = torch.empty(20)  # a fourth 20-element buffer beyond the working set of one
    pool.in_use_bytes += 80
    pool._in_use[(20, F32, CPU)] = 1
    pool.give(stray)  # the one cached already covers the peak: this one is not kept
    assert pool.cached_bytes == 200
    again = [pool.take(10, F32, CPU) for _ in range(3)]
    assert {id(t) for t in again} == {id(t) for t in small}  # all three reused
    assert pool.take(20, F32, CPU) is mid
    pool.clear()
    assert pool.cached_bytes == 0


def test_sizes_peaking_at_different_moments_are_all_kept():
    """The case the old bound (2 x the peak bytes in use) evicted every step."""
    pool = BufferPool()
    for _ in range(3):  # a "step": a large buffer, then three small ones, never together
        big = pool.take(1000, F32, CPU)
        pool.give(big)
        smalls = [pool.take(400, F32, CPU) for _ in range(3)]
        for t in smalls:
            pool.give(t)
    assert pool.misses == 4 and pool.hits == 8


def test_meta_and_none_are_ignored():
    pool = BufferPool()
    pool.give(None)
    pool.give(torch.empty(4, device="meta"))
    assert pool.cached_bytes == 0


def _steady_state_worker(stage, prefetch, steps):
    rank = dist.get_rank()
    cfg = get_model_config("debug", dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                           vocab_size=64, max_seq_len=16, multiple_of=16)
    model = shardwise.shard(build_model(cfg, seed=0), stage=stage, wrap={TransformerBlock},
                            prefetch=prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    misses, cached = [], []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        misses.append(POOL.misses)
        cached.append(shardwise.memory_report(model, opt).cached_bytes)
    bound = sum(k[0] * k[1].itemsize * c for k, c in POOL._peak.items())
    in_use = POOL.in_use_bytes
    shardwise.empty_cache()
    return misses, cached, bound, in_use, POOL.cached_bytes


@pytest.mark.parametrize("stage,prefetch", [(3, 1), (3, 0), (2, 1)])
def test_training_steps_after_the_first_allocate_no_staging_buffer(stage, prefetch):
    for misses, cached, bound, in_use, after_empty in run_ranks(
            _steady_state_worker, 2, args=(stage, prefetch, 5)):
        assert misses[0] > 0
        assert misses[1:] == [misses[1]] * 4, misses  # every later step is served by reuse
        assert all(0 < c <= bound for c in cached), (cached, bound)
        assert after_empty == 0
        if stage == 3:
            assert in_use == 0  # stage 3 frees every gathered unit between steps
