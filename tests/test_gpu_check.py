"""bench/gpu_check.py's device rows that need no peer, run here on the CPU (the GPU run is
the same code on CUDA): the zero-bubble split backward and the grouped expert compute, in
fp32 and bf16 (the dtype the GPU run uses)."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_check import expert_compute, split_backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_backward_row_is_bitwise(dtype):
    label, value, verdict = split_backward("cpu", dtype)
    assert verdict == "ok", value
    assert "bitwise True" in value and str(dtype) in value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_compute_row_matches_the_loop(dtype):
    label, value, verdict = expert_compute("cpu", dtype)
    assert verdict == "ok", value
    assert str(dtype) in value


def _context_parallel_row():
    from bench.gpu_check import context_parallel
    return context_parallel("cpu")


def test_context_parallel_row_matches_sdpa():
    from shardwise.testing import run_ranks
    label, value, verdict = run_ranks(_context_parallel_row, 1)[0]
    assert verdict == "ok", value
