"""The staging-buffer pool: reuse, its bound, and a stage-3 step that allocates nothing new."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.shard.pool import POOL, BufferPool
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


def test_cache_stays_within_twice_the_high_water_mark_largest_evicted_first():
    pool = BufferPool()
    small = [pool.take(10, F32, CPU) for _ in range(3)]  # 120 bytes in use: the peak
    for t in small:
        pool.give(t)
    assert (pool.high_water_bytes, pool.cached_bytes) == (120, 120)
    mid = pool.take(20, F32, CPU)  # 80 bytes
    pool.give(mid)
    assert pool.cached_bytes == 200  # <= 2 x 120
    large = pool.take(25, F32, CPU)  # 100 bytes; the peak stays 120
    pool.give(large)  # 300 > 240: the largest cached (80 bytes) goes first
    assert pool.cached_bytes == 220 and pool.high_water_bytes == 120
    assert pool.take(25, F32, CPU) is large
    assert pool.take(20, F32, CPU) is not mid  # evicted: allocated anew
    again = [pool.take(10, F32, CPU) for _ in range(3)]
    assert {id(t) for t in again} == {id(t) for t in small}  # the small ones stayed
    pool.clear()
    assert pool.cached_bytes == 0 and pool.high_water_bytes == pool.in_use_bytes == 300


def test_a_buffer_larger_than_the_bound_is_not_kept():
    pool = BufferPool()
    pool.high_water_bytes = 0
    t = torch.empty(10)
    pool.in_use_bytes = 40  # as if taken without raising the mark
    pool.give(t)
    assert pool.cached_bytes == 0


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
    bound = 2 * POOL.high_water_bytes
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
