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


def test_lowbit_kernel_rows_on_the_cpu():
    """The low-bit rows' kernel check: the CPU's scaled_mm takes the fp8 tensorwise and
    rowwise recipes and matches the emulation (rowwise bitwise); the others are reported as
    emulated, by name."""
    from bench.gpu_lowbit import kernel_rows
    from shardwise.parallel.lowbit import RECIPE_NAMES
    rows = kernel_rows("cpu")
    assert [r[0].split(":")[0] for r in rows] == [f"low-bit {n}" for n in RECIPE_NAMES]
    assert all(v == "ok" for _, _, v in rows), rows
    by = {r[0].split(":")[0].removeprefix("low-bit "): r[1] for r in rows}
    assert by["fp8_rowwise"].startswith("max rel diff 0.0e+00")
    assert "max rel diff" in by["fp8_tensorwise"]
    for name in ("fp8_blockwise", "mxfp8", "nvfp4"):
        assert by[name].startswith("emulated"), by[name]


def test_lowbit_throughput_rows_dry_run():
    """Every recipe trains through shard(stage=3) on the dry-run shape; the rows name the
    reference and one row per recipe plus the fp8-gather row."""
    from bench.gpu_check import BILLION
    from bench.gpu_lowbit import throughput_rows
    from shardwise.testing import run_ranks
    rows = run_ranks(throughput_rows, 1, ("cpu", BILLION, 2))[0]
    assert len(rows) == 1 + 6 + 1 and all(v == "ok" for _, _, v in rows)
    assert rows[-1][0] == "low-bit fp8_tensorwise + fp8 all-gather"


def test_phase_memory_rows_dry_run():
    """The per-phase memory rows (batch 1 and 4) run the stage-3 steps on the CPU; no CUDA
    statistics there, so the rows say so and pass."""
    from bench.gpu_check import phase_memory
    from shardwise.testing import run_ranks
    rows = run_ranks(phase_memory, 1, ("cpu",))[0]
    assert [r[0] for r in rows] == ["memory per phase, stage 3, 1 x 32",
                                    "memory per phase, stage 3, 4 x 32"]
    assert all(v == "ok" and s == "no CUDA statistics" for _, s, v in rows), rows


def test_phase_memory_summary_names_the_phases_and_growth_fails():
    """What the GPU run prints and judges: first steps and the last, and a FAIL verdict
    when the bytes left after a step keep growing (the first H100 run: 3.3 GiB a step)."""
    from bench.gpu_check import PhaseMemory
    mem = PhaseMemory("cpu")
    mem.rows = [(1.0, 2.0, 3.0, 4.0, 3.5), (5.0, 6.0, 7.0, 7.5, 7.0),
                (5.0, 6.0, 7.0, 7.5, 7.0), (5.0, 6.0, 7.0, 7.5, 7.01), (5, 6, 7, 7.5, 7.0)]
    assert mem.summary() == ("GiB fwd/loss/bwd/opt > after: s1 1.0/2.0/3.0/4.0 > 3.5; "
                             "s2 5.0/6.0/7.0/7.5 > 7.0; s3 5.0/6.0/7.0/7.5 > 7.0; "
                             "s5 5.0/6.0/7.0/7.5 > 7.0")
    assert mem.steady()
    mem.rows += [(8.3, 9.3, 10.3, 10.8, 10.3)]
    assert not mem.steady()


def test_decode_row_dry_run():
    """The decode row's code path (a tiny shape in bf16 on the CPU): every token made, the
    published gpt-fast figure and the ratio in the row."""
    from bench.gpu_decode import decode_rows
    (label, value, verdict), = decode_rows("cpu")
    assert verdict == "ok", value
    assert label.startswith("decode dry-run") and label.endswith("eager")
    assert "gpt-fast A100 compiled 104.9" in value
