"""A device's constants refitted to measured steps: :func:`calibrate` ([Note: calibration]
in calibrate/__init__.py).

    hw, err = calibrate([StepMeasurement(spec, wl, layout, 1.42)], get_hardware("h100"))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardwise.planner.calibrate.fit import (fit_constants, fit_directions,
                                             identified_directions, log_error)
from shardwise.planner.cost_model import CostModel

__all__ = ["StepMeasurement", "calibrate", "constant"]

_FITTABLE = {"matmul_max": (0.05, 1.5), "memory_efficiency": (0.05, 1.5),
             "intra_efficiency": (0.02, 1.5), "inter_efficiency": (0.02, 1.5),
             "cpu_busy": (1.0, 3.0)}
"""Constants :func:`calibrate` fits, with their bounds. ``cpu_busy`` is a CPU device's
slowdown with every core computing (``CpuCosts.busy`` at ``cores``): the one constant of
``local`` that one-rank steps cannot see, and the least steady of its calibration
([Note: undisturbed steps] in devices/cpu/costs.py)."""


def constant(hw, name: str) -> float:
    """The current value of a constant :func:`calibrate` can fit (``cpu_busy``, which is no
    attribute of the device, from its CPU model's every-core slowdown).

    Raises:
        ValueError: ``cpu_busy`` of a device without a CPU model and its cores.
    """
    if name == "cpu_busy":
        if hw.cpu is None or not hw.cores:
            raise ValueError(f"calibrate: cpu_busy needs a CPU device with its cores; "
                             f"{hw.name!r} has none")
        return max(1.0, hw.cpu.contention(hw.cores, hw.cores))
    return getattr(hw, name)


def _with_constants(hw, params: dict[str, float]):
    """``hw`` with fitted constants; ``cpu_busy`` replaces the every-core slowdown (and
    scales the fastest calls' one, ``busy_best``, by the same ratio); counts of busy
    ranks below the cores are interpolated again from it."""
    rest = {k: v for k, v in params.items() if k != "cpu_busy"}
    out = hw.replace(**rest) if rest else hw
    if "cpu_busy" in params:
        c, busy = hw.cpu, params["cpu_busy"]
        ratio = busy / constant(hw, "cpu_busy")
        best = c.undisturbed().contention(hw.cores, hw.cores)
        out = out.replace(cpu=dataclasses.replace(
            c, busy={hw.cores: busy},
            busy_best={hw.cores: max(1.0, best * ratio)} if c.busy_best else {}))
    return out


@dataclass(frozen=True)
class StepMeasurement:
    """One measured training step of a layout.

    Attributes:
        spec, workload, layout: what ran.
        step_time: measured seconds per step.
        dp_collective_time: measured seconds of the step's data-parallel collectives
            (gathers + reductions, as ``comm_stats`` labels them), or None.
    """

    spec: object
    workload: object
    layout: object
    step_time: float
    dp_collective_time: float | None = None


def _predict(hw, m: StepMeasurement) -> tuple[float, float]:
    # exact: a measured layout's pipeline is simulated with every rank's own costs, as the
    # search re-prices its best layouts (the closed forms take the busiest rank's for all)
    cm = CostModel(m.spec, hw, m.workload)
    return cm.estimate(m.layout, exact=True).step_time, cm.dp_collective_seconds(m.layout)


def calibrate(measurements: list[StepMeasurement], hw, params: tuple[str, ...] = (
        "matmul_max", "memory_efficiency", "intra_efficiency", "inter_efficiency"),
              iterations: int = 600, min_ratio: float = 0.2):
    """Refit ``hw``'s constants so the cost model reproduces measured steps, moving only
    the combinations of constants the measurements determine ([Note: identified
    directions] in fit.py).

    Args:
        measurements: at least one :class:`StepMeasurement` (more, of layouts stressing
            different parts, identify more constants).
        hw: the :class:`~shardwise.planner.hardware.Hardware` to correct.
        params: which constants to fit (any of matmul_max, memory_efficiency,
            intra_efficiency, inter_efficiency; cpu_busy on a CPU device).
        iterations: optimiser steps.
        min_ratio: a combination of constants is fitted when the predictions depend on it
            at least this fraction as strongly as on the best-determined one; the others
            keep ``hw``'s values.

    Returns:
        (the corrected Hardware, the fit's mean squared log error).

    Raises:
        ValueError: no measurements, or an unknown parameter.
    """
    if not measurements:
        raise ValueError("calibrate needs at least one StepMeasurement")
    bad = [p for p in params if p not in _FITTABLE]
    if bad:
        raise ValueError(f"calibrate: cannot fit {bad[0]!r}; fittable: {', '.join(_FITTABLE)}")
    observed, which = [], []
    for i, m in enumerate(measurements):
        observed.append(m.step_time)
        which.append((i, 0))
        if m.dp_collective_time:
            observed.append(m.dp_collective_time)
            which.append((i, 1))
    start = {p: constant(hw, p) for p in params}
    bounds = {p: _FITTABLE[p] for p in params}

    def predicted(p):
        h = _with_constants(hw, p)
        preds = [_predict(h, m) for m in measurements]
        return [preds[i][k] for i, k in which]

    def loss(p):
        return log_error(predicted(p), observed)

    directions = _directions(predicted, start, min_ratio)
    if directions is None or len(directions) == len(params):
        best, err = fit_constants(start, bounds, loss, iterations)
    else:  # fit what the measurements determine ([Note: identified directions] in fit.py)
        best, err = fit_directions(start, bounds, directions, loss, iterations)
    return _with_constants(hw, best), err


def _directions(predicted, start: dict[str, float], min_ratio: float, h: float = 0.05
                ) -> list[list[float]] | None:
    """The identified directions of the constants at ``start`` (finite differences of log
    predictions over a 5% step of each constant); None when a prediction is not positive."""
    base = predicted(start)
    if not all(v > 0 and math.isfinite(v) for v in base):
        return None
    cols = []
    for name, value in start.items():
        step = predicted({**start, name: value * math.exp(h)})
        if not all(v > 0 and math.isfinite(v) for v in step):
            return None
        cols.append([(math.log(a) - math.log(b)) / h for a, b in zip(step, base, strict=True)])
    return identified_directions([list(r) for r in zip(*cols, strict=True)], min_ratio)
