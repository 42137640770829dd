"""The multi-rank harness: results, failures named by rank, hangs turned into timeouts."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import RankFailure, RankTimeout, run_ranks


def _sum_ranks(scale):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item() * scale, dist.get_rank(), dist.get_world_size()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _hang_in_collective():
    if dist.get_rank() == 0:
        time.sleep(60)
    dist.barrier()


def _kill_self():
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_results_come_back_per_rank(world_size):
    out = run_ranks(_sum_ranks, world_size, args=(2.0,))
    total = sum(range(world_size)) * 2.0
    assert out == [(total, r, world_size) for r in range(world_size)]


def test_exception_names_rank_and_traceback():
    with pytest.raises(RankFailure) as e:
        run_ranks(_raise_on_rank_one, 2, timeout_s=30, grace_s=1)
    msg = str(e.value)
    assert "failed on rank 1 of 2 first" in msg and "boom on purpose" in msg
    assert "--- rank 0" in msg


def test_hang_becomes_timeout_with_every_stack():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as e:
        run_ranks(_hang_in_collective, 2, timeout_s=3)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "did not finish within 3 s" in msg
    assert "_hang_in_collective" in msg  # the stacks are printed


def test_killed_rank_is_named():
    with pytest.raises(RankFailure) as e:
        run_ranks(_kill_self, 3, timeout_s=30, grace_s=1)
    msg = str(e.value)
    assert "failed on rank 2 of 3 first" in msg and "SIGKILL" in msg


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_ranks(_sum_ranks, 0)
