"""Fitting a few positive constants to observations: Nelder-Mead on log-errors.

One small optimiser serves both places that fit the cost model to reality: the hardware
families' constants fitted on published runs (validate/fit_runs.py) and a device's
constants fitted to what a run measured (refit.py). Parameters live in bounded intervals;
the search runs on a logit-like transform of each so no step leaves its interval, and
minimises the mean squared log ratio of prediction to observation (errors of 10% too fast
and 10% too slow weigh the same, and large and small runs count alike).

[Note: identified directions] Measurements determine only some combinations of the
constants. Two steps of nearly the same mix of work (two one-rank steps of different
widths, mostly multiplies) tell how fast the mix runs, not how fast each part does;
fitting both parts anyway turns the measurements' noise into large opposite changes of
the constants, which every layout with another mix then extrapolates. So a fit can be
restricted to the directions the measurements determine: the singular vectors of the
elasticities (d log prediction / d log constant, at the starting constants) whose singular
value is at least ``min_ratio`` of the largest (default 0.2), and not below ``1e-3`` (a
constant no prediction depends on: intra-node efficiency from one-rank steps). The other
directions keep their starting values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["fit_constants", "log_error", "identified_directions", "fit_directions"]


def log_error(predicted: Sequence[float], observed: Sequence[float]) -> float:
    """Mean of ``log(predicted / observed) ** 2`` (inf when a prediction is not positive)."""
    total = 0.0
    for p, o in zip(predicted, observed, strict=True):
        if not (p > 0 and o > 0) or not math.isfinite(p):
            return math.inf
        total += math.log(p / o) ** 2
    return total / max(1, len(observed))


def _to_unit(x: float, lo: float, hi: float) -> float:
    u = min(max((x - lo) / (hi - lo), 1e-9), 1 - 1e-9)
    return math.log(u / (1 - u))


def _from_unit(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) / (1 + math.exp(-z))


def fit_constants(start: dict[str, float], bounds: dict[str, tuple[float, float]],
                  loss: Callable[[dict[str, float]], float], iterations: int = 300,
                  tolerance: float = 1e-10) -> tuple[dict[str, float], float]:
    """Minimise ``loss(params)`` over ``params`` within ``bounds`` (Nelder-Mead).

    Args:
        start: initial value of every parameter to fit.
        bounds: (low, high) of every parameter in ``start``.
        loss: the objective, e.g. ``log_error(predict(params), observed)``.
        iterations: at most this many simplex steps.
        tolerance: stop when the simplex's losses differ by less than this.

    Returns:
        (best parameters, their loss).

    Raises:
        ValueError: a parameter without bounds, or a start outside its bounds.
    """
    names = list(start)
    for n in names:
        if n not in bounds:
            raise ValueError(f"fit_constants: parameter {n!r} has no bounds")
        lo, hi = bounds[n]
        if not lo <= start[n] <= hi:
            raise ValueError(f"fit_constants: start {n}={start[n]} is outside [{lo}, {hi}]")

    def decode(z):
        return {n: _from_unit(v, *bounds[n]) for n, v in zip(names, z, strict=True)}

    def f(z):
        return loss(decode(z))

    x0 = [_to_unit(start[n], *bounds[n]) for n in names]
    best, value = _nelder_mead(f, x0, iterations, tolerance)
    return decode(best), value


def identified_directions(elasticities: Sequence[Sequence[float]], min_ratio: float = 0.2
                          ) -> list[list[float]]:
    """The directions in log-constant space that observations determine ([Note: identified
    directions]).

    Args:
        elasticities: one row per observation, one column per constant: d log(prediction)
            / d log(constant).
        min_ratio: keep singular directions whose singular value is at least this fraction
            of the largest.

    Returns:
        Orthonormal vectors (one entry per constant), best determined first; empty when no
        prediction depends on any constant.
    """
    import torch

    J = torch.tensor([list(r) for r in elasticities], dtype=torch.float64)
    if J.numel() == 0:
        return []
    _, s, vh = torch.linalg.svd(J, full_matrices=False)
    keep = [i for i in range(len(s)) if s[i] >= max(1e-3, min_ratio * float(s[0]))]
    return [vh[i].tolist() for i in keep]


def fit_directions(start: dict[str, float], bounds: dict[str, tuple[float, float]],
                   directions: Sequence[Sequence[float]],
                   loss: Callable[[dict[str, float]], float], iterations: int = 300,
                   tolerance: float = 1e-10) -> tuple[dict[str, float], float]:
    """Minimise ``loss`` moving the constants only along ``directions`` (vectors over
    ``start``'s names, in log space: ``log c = log start + sum_k a_k d_k``), each constant
    clipped to its bounds ([Note: identified directions]). Returns (best constants, loss)."""
    names = list(start)

    def decode(a):
        out = {}
        for j, n in enumerate(names):
            z = math.log(start[n]) + sum(ak * d[j] for ak, d in zip(a, directions, strict=True))
            lo, hi = bounds[n]
            out[n] = min(max(math.exp(z), lo), hi)
        return out

    if not directions:
        return dict(start), loss(dict(start))
    best, value = _nelder_mead(lambda a: loss(decode(a)), [0.0] * len(directions),
                               iterations, tolerance)
    return decode(best), value


def _nelder_mead(f, x0: list[float], iterations: int, tolerance: float
                 ) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (standard reflection / expansion / contraction / shrink)."""
    simplex = [x0] + [[v + (0.5 if i == j else 0.0) for j, v in enumerate(x0)]
                      for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tolerance:
            break
        centroid = [sum(x[i] for x in simplex[:-1]) / (len(simplex) - 1)
                    for i in range(len(x0))]
        worst = simplex[-1]

        def point(k, centroid=centroid, worst=worst):
            return [ci + k * (ci - wi) for ci, wi in zip(centroid, worst, strict=True)]

        reflect = point(1.0)
        fr = f(reflect)
        if fr < values[0]:
            expand = point(2.0)
            fe = f(expand)
            simplex[-1], values[-1] = (expand, fe) if fe < fr else (reflect, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflect, fr
        else:
            contract = point(-0.5)
            fc = f(contract)
            if fc < values[-1]:
                simplex[-1], values[-1] = contract, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, s, strict=True)]
                                    for s in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(len(values)), key=values.__getitem__)
    return simplex[i], values[i]
