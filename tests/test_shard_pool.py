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
    b = pool.take(100, torch.bfloat16, CPU)  # another dtype is served separately
    c = pool.take(99, F32, CPU)  # a is in use: a new buffer
    assert b is not a and c is not a and pool.misses == 3
    assert b.dtype == torch.bfloat16 and c.numel() == 99 and c.ndim == 1


def test_best_fit_serves_smaller_requests_from_larger_buffers_within_twice():
    pool = BufferPool()
    big, mid = pool.take(100, F32, CPU), pool.take(60, F32, CPU)
    pool.give(big)
    pool.give(mid)
    view = pool.take(55, F32, CPU)  # the smallest that fits: mid (60)
    assert view.numel() == 55 and view.data_ptr() == mid.data_ptr()
    assert pool.take(40, F32, CPU).data_ptr() != big.data_ptr()  # 100 > 2 x 40: not used
    pool.give(view)
    assert pool.take(60, F32, CPU, exact=True) is mid  # exact: the very buffer
    assert pool.misses == 3 and pool.hits == 2


def test_what_is_kept_is_what_was_needed_at_once():
    """Sizes peaking at different moments are all served from what the first pass kept."""
    pool = BufferPool()
    for _ in range(3):  # a "step": a large buffer, then three smaller ones, never together
        big = pool.take(1000, F32, CPU)
        pool.give(big)
        smalls = [pool.take(600, F32, CPU) for _ in range(3)]
        for t in smalls:
            pool.give(t)
    assert pool.misses == 3 and pool.hits == 9  # the 1000 serves a 600 too
    assert pool.cached_bytes == 4 * (1000 + 600 + 600)  # all kept
    pool.clear()
    assert pool.cached_bytes == 0


def test_a_buffer_not_from_the_pool_or_given_twice_is_ignored():
    pool = BufferPool()
    pool.give(torch.empty(10))
    t = pool.take(10, F32, CPU)
    pool.give(t)
    pool.give(t)
    assert pool.cached_bytes == 40


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
    bound = POOL.high_water_bytes * 4  # kept buffers: never more than the peak needed
    in_use = POOL.in_use_bytes
    shardwise.empty_cache()
    return misses, cached, bound, in_use, POOL.cached_bytes


@pytest.mark.parametrize("stage,prefetch", [(3, 1), (3, 0), (2, 1)])
def test_training_steps_after_the_first_allocate_no_staging_buffer(stage, prefetch):
    for misses, cached, bound, in_use, after_empty in run_ranks(
            _steady_state_worker, 2, args=(stage, prefetch, 5)):
        assert misses[0] > 0
        # best fit settles within the first steps; every later step is served by reuse
        assert misses[2:] == [misses[2]] * 3, misses
        assert all(0 < c <= bound for c in cached), (cached, bound)
        assert after_empty == 0
        if stage == 3:
            assert in_use == 0  # stage 3 frees every gathered unit between steps
