"""Fitting the cost model to measurements: synthetic truths must be recovered."""

from __future__ import annotations

import pytest

from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.calibrate import (StepMeasurement, calibrate, fit_alpha_beta,
                                         fit_matmul_curve)
from shardwise.planner.cost_model import CostModel
from shardwise.planner.fit import fit_constants
from shardwise.planner.layout import Layout
from shardwise.planner.workload import Workload


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
