"""The planner's replay of the engine's buffers ([Note: buffer replay]) equals what
``memory_report`` reports on real Gloo ranks: the peak of gathered parameters and
communication buffers at stages 1-3, fp32 and bf16 compute, with uneven shards; and the
CPU memory prediction of a whole run (activations, whole gradients) against the bench's
measurement of one step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.models import get_model_config
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.devices.cpu.engine_buffers import (MAX_INFLIGHT, replay_peak,
                                                          shard_calls, unit_buffers)
from shardwise.shard.hooks import OrderedLauncher
from shardwise.testing import run_ranks
from tests.planner_helpers import ODD_SHAPE, lm_backward, sharded_odd_debug

CASES = [(1, None), (2, None), (3, None), (2, "bf16"), (3, "bf16")]


def _steps(cases):
    rank = dist.get_rank()
    out = []
    for stage, dtype in cases:
        model = sharded_odd_debug(stage, bf16=dtype == "bf16")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):  # the second step is the steady state (forward prefetch)
            lm_backward(model, torch.randint(0, 67, (2, 9), generator=gen))
            opt.step()
            opt.zero_grad()
        r = shardwise.memory_report(model, opt)
        out.append((r.peak_transient_bytes, r.peak_unsharded_bytes))
        del model, opt
    return out


def test_launcher_default_is_what_the_replay_reads():
    assert MAX_INFLIGHT == OrderedLauncher().max_inflight


@pytest.mark.parametrize("world", [1, 2])
def test_replayed_peak_equals_memory_report(world):
    spec = from_llama_config(get_model_config("debug", **ODD_SHAPE))
    for rank, reports in enumerate(run_ranks(_steps, world, args=(CASES,), timeout_s=120)):
        for (stage, dtype), (got, _) in zip(CASES, reports, strict=True):
            cb = 2 if dtype else 4
            bufs = [unit_buffers(tuple(u), world, compute_bytes=cb, param_bytes=4)
                    for u in spec.unit_shapes()]
            assert sum(replay_peak(bufs, zero=stage)) == got, (stage, dtype, world, rank)


def test_replay_counts_the_gloo_scratch_and_inflight_reductions():
    """Stage 2 on 2 ranks: every unit stays gathered, and the peak holds the reductions
    the launcher keeps outstanding plus the one being launched, each with its Gloo
    scratch."""
    spec = from_llama_config(get_model_config("debug"))
    units = [tuple(u) for u in spec.unit_shapes()]
    bufs = [unit_buffers(u, 2, compute_bytes=4, param_bytes=4) for u in units]
    unsharded, comm = replay_peak(bufs, zero=2)
    assert unsharded == sum(b.full for b in bufs)
    block = bufs[1]
    assert comm == (MAX_INFLIGHT + 1) * (block.reduce_in + block.scratch)
    nccl = [unit_buffers(u, 2, compute_bytes=4, param_bytes=4, gloo=False) for u in units]
    assert replay_peak(nccl, zero=2)[1] == (MAX_INFLIGHT + 1) * block.reduce_in


def test_pipeline_pieces_are_the_trainers_shard_calls():
    """A pipeline stage shards each piece on its own: the embedding, each block (norms as
    its root, attention, feed-forward), the final norm and the head."""
    spec = from_llama_config(get_model_config("debug"))
    first = shard_calls(spec, 1, 1, [0, 1], True, False, pipeline=True)
    last = shard_calls(spec, 1, 1, [2, 3], False, True, pipeline=True)
    assert len(first) == 3 and len(last) == 4
    params = sum(torch.Size(s).numel() for calls in (first, last) for c in calls for u in c
                 for s in u)
    assert params == spec.num_params()
    assert shard_calls(spec, 1, 1, [0, 1, 2, 3], True, True, pipeline=False) == [
        [tuple(u) for u in spec.unit_shapes()]]
