"""Fitting the cost model to measurements: synthetic truths must be recovered."""

from __future__ import annotations

import math

import pytest

from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.calibrate import (StepMeasurement, calibrate, fit_alpha_beta,
                                         fit_matmul_curve)
from shardwise.planner.cost_model import CostModel
from shardwise.planner.calibrate.fit import fit_constants, identified_directions
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.workload import Workload
from tests.planner_helpers import local_cpu


def _measure(hw, cases):
    out = []
    for spec, wl, L in cases:
        cm = CostModel(spec, hw, wl)
        out.append(StepMeasurement(spec, wl, L, cm.estimate(L).step_time,
                                   cm.dp_collective_seconds(L)))
    return out


def test_calibrate_recovers_the_constants_of_measured_steps():
    """Steps 'measured' on a device twice as slow at matmuls, with a network at a third of
    its rated bandwidth and HBM at 60%, correct a catalogue entry to that device."""
    catalogue = get_hardware("a100-80gb")
    truth = catalogue.replace(matmul_max=catalogue.matmul_max / 2, inter_efficiency=0.3,
                              memory_efficiency=0.6, intra_efficiency=0.5)
    spec = get_model_spec("llama3-8b")
    wl = Workload(seq_len=4096, global_batch=64)
    cases = [(spec, wl, Layout(dp_shard=16, zero=3, microbatch=1, pp_microbatches=4)),
             (spec, wl, Layout(dp_shard=8, tp=2, sp=True, zero=2, microbatch=1,
                               pp_microbatches=8, ac="full")),
             (spec, wl, Layout(dp_replicate=2, dp_shard=2, tp=4, sp=True, zero=1, microbatch=2,
                               pp_microbatches=8)),
             (get_model_spec("small"), Workload(seq_len=512, global_batch=256),
              Layout(dp_shard=16, zero=3, microbatch=16, pp_microbatches=1))]
    measured = _measure(truth, cases)
    fitted, err = calibrate(measured, catalogue)
    assert err < 1e-6
    for name in ("matmul_max", "inter_efficiency", "memory_efficiency", "intra_efficiency"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    for m, again in zip(measured, _measure(fitted, cases), strict=True):
        assert again.step_time == pytest.approx(m.step_time, rel=1e-3)


def test_calibrate_refuses_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        calibrate([], get_hardware("h100"))
    spec = get_model_spec("debug")
    m = StepMeasurement(spec, Workload(seq_len=256, global_batch=2), Layout(dp_shard=2), 1.0)
    with pytest.raises(ValueError, match="cannot fit 'peak'"):
        calibrate([m], get_hardware("h100"), params=("peak",))


def test_micro_benchmark_fits():
    peak, emax, half = 2e11, 0.8, 5e7  # FLOP/s of the best size, curve maximum, half size
    sizes = [1e6, 1e7, 1e8, 1e9, 1e10]
    pts = [(f, (f + half) / (peak / 0.8 * emax)) for f in sizes]  # best size: e ~ 0.8
    got_peak, got_max, got_half = fit_matmul_curve(pts)
    times = [(f + got_half) / (got_peak * got_max) for f in sizes]
    assert times == pytest.approx([t for _, t in pts], rel=0.02)
    alpha, beta = 3e-5, 2e9
    pts = [(s, b, s * alpha + b / beta) for s in (1, 2, 6) for b in (1e3, 1e5, 1e7, 1e8)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=0.02) and b == pytest.approx(beta, rel=0.02)


def test_fit_constants_respects_bounds():
    best, loss = fit_constants({"x": 0.5}, {"x": (0.1, 1.0)}, lambda p: (p["x"] - 3) ** 2)
    assert 0.99 < best["x"] <= 1.0
    with pytest.raises(ValueError, match="outside"):
        fit_constants({"x": 5.0}, {"x": (0.1, 1.0)}, lambda p: 0.0)


def test_identified_directions_drop_flat_and_collinear_constants():
    """A constant no prediction depends on is not a direction; two observations of nearly
    the same mix determine one combination, two different mixes two."""
    flat = identified_directions([[-0.7, 0.0], [-0.8, 0.0]])
    assert len(flat) == 1 and flat[0][1] == pytest.approx(0.0, abs=1e-9)
    assert len(identified_directions([[-0.70, -0.29], [-0.83, -0.16]])) == 1
    assert len(identified_directions([[-0.70, -0.29], [-0.83, -0.16]], min_ratio=0.05)) == 2
    assert len(identified_directions([[-0.9, -0.1], [-0.1, -0.9]])) == 2
    assert identified_directions([[0.0, 0.0]]) == []


def test_calibrate_fits_one_speed_from_two_steps_of_the_same_mix():
    """Two one-GPU steps (multiplies and bandwidth-bound kernels in the same proportions)
    measured 10% slower than predicted, with +-5% noise in opposite directions: the refit
    moves matmul_max and memory_efficiency together (the noise does not pull them apart),
    leaves the intra-node link (no collective ran) exactly as it was, and reproduces both
    steps' mean slowdown. Fitting every singular direction (min_ratio 0) splits them."""
    hw = get_hardware("a100-80gb")
    spec = get_model_spec("llama3-8b")  # multiplies 0.70 / 0.69 of the step's elasticity
    cases = [(spec, Workload(seq_len=4096, global_batch=1),
              Layout(dp_shard=1, microbatch=1, pp_microbatches=1)),
             (spec, Workload(seq_len=512, global_batch=8),
              Layout(dp_shard=1, microbatch=8, pp_microbatches=1))]
    truth = [m.step_time * 1.1 * noise for m, noise in zip(_measure(hw, cases), (1.05, 0.95),
                                                             strict=True)]
    measured = [StepMeasurement(s, w, L, t) for (s, w, L), t in zip(cases, truth, strict=True)]
    params = ("matmul_max", "memory_efficiency", "intra_efficiency")
    fitted, _ = calibrate(measured, hw, params=params)
    moved = [getattr(fitted, p) / getattr(hw, p) for p in params[:2]]
    assert all(0.8 < r < 1.0 for r in moved), moved  # both slower, neither far off
    assert fitted.intra_efficiency == hw.intra_efficiency
    again = [m.step_time for m in _measure(fitted, cases)]
    mean_ratio = math.exp(sum(math.log(a / t) for a, t in zip(again, truth, strict=True)) / 2)
    assert mean_ratio == pytest.approx(1.0, abs=0.02)
    split, _ = calibrate(measured, hw, params=params[:2], min_ratio=0.0)
    apart = [getattr(split, p) / getattr(hw, p) for p in params[:2]]
    assert (apart[0] - 1) * (apart[1] - 1) < 0, apart  # one faster, the other slower


def test_calibrate_fits_the_cores_contention_from_a_two_rank_step():
    """A CPU device calibrated with no contention (``busy`` 1.0) whose two cores really
    compute 1.3x slower together, and whose multiplies run 10% slower than calibrated: two
    one-rank steps and one two-rank step recover both (the one-rank steps cannot see
    ``cpu_busy``, the two-rank step cannot tell it from the multiplies alone), and the
    fastest calls' slowdown moves by the same ratio."""
    import dataclasses


    base = local_cpu(2)
    start = base.replace(cpu=dataclasses.replace(base.cpu, busy={2: 1.0}, busy_best={2: 1.1}))
    truth = start.replace(matmul_max=start.matmul_max * 0.9,
                          cpu=dataclasses.replace(start.cpu, busy={2: 1.3}))
    wl = Workload(seq_len=128, global_batch=4, compute_dtype="fp32")
    cases = [(get_model_spec("debug"), wl, Layout(microbatch=4)),
             (get_model_spec("small"), wl, Layout(microbatch=4)),
             (get_model_spec("debug"), Workload(seq_len=128, global_batch=8,
                                                compute_dtype="fp32"),
              Layout(dp_shard=2, zero=0, microbatch=4))]
    measured = [StepMeasurement(s, w, L, CostModel(s, truth, w).estimate(L, exact=True)
                                .step_time) for s, w, L in cases]
    fitted, err = calibrate(measured, start, params=("matmul_max", "cpu_busy"))
    assert err < 1e-6
    assert fitted.matmul_max == pytest.approx(truth.matmul_max, rel=0.01)
    assert fitted.cpu.contention(2, 2) == pytest.approx(1.3, rel=0.01)
    assert fitted.cpu.undisturbed().contention(2, 2) == pytest.approx(1.1 * 1.3, rel=0.01)
    one_rank, _ = calibrate(measured[:2], start, params=("matmul_max", "cpu_busy"))
    assert one_rank.cpu.contention(2, 2) == pytest.approx(1.0)  # not identified: kept
    with pytest.raises(ValueError, match="cpu_busy needs a CPU device.*'h100-sxm' has none"):
        calibrate(measured, get_hardware("h100"), params=("cpu_busy",))
