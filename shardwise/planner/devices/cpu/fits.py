"""The fitted pieces of a CPU calibration: ``latency + per_unit * size`` fits, a kernel's
forward and backward fits, the crowded collectives of a world beyond the cores, and the
least-squares fit they come from ([Note: CPU kernels] in costs.py).

    fit = Fit(*fit_terms([((1.0, n), seconds) for n, seconds in rows]))
    fit(4096)   # seconds at size 4096
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Fit", "Kernel", "Crowd", "fit_terms", "least_squares"]


@dataclass(frozen=True)
class Fit:
    """``latency + per_unit * size`` seconds (0 for an empty size)."""

    latency: float
    per_unit: float

    def __call__(self, size: float) -> float:
        return 0.0 if size <= 0 else self.latency + self.per_unit * size


@dataclass(frozen=True)
class Kernel:
    """One kernel's forward and backward fits."""

    fwd: Fit
    bwd: Fit


@dataclass(frozen=True)
class Crowd:
    """Collectives of groups smaller than a world of more ranks than cores, measured with
    every rank of the world running, each call after ``gap_s`` seconds of compute ([Note:
    crowded collectives] in step.py).

    Attributes:
        collectives: kind -> group size -> fit of seconds against payload bytes.
        comm_cpu: group size -> CPU seconds over seconds of those collectives.
        gap_s: the compute each rank ran before each call (what its peers' turns on
            the cores last).
    """

    collectives: dict[str, dict[int, Fit]]
    comm_cpu: dict[int, float] = field(default_factory=dict)
    gap_s: float = 0.0

    def blend(self, other: "Crowd", gap_s: float) -> "Crowd":
        """This crowd and ``other`` (a longer gap) interpolated linearly at ``gap_s``,
        clamped to the two measured gaps (the group sizes both measured)."""
        span = other.gap_s - self.gap_s
        w = min(1.0, max(0.0, (gap_s - self.gap_s) / span)) if span > 0 else 1.0

        def mix(a: float, b: float) -> float:
            return a + w * (b - a)

        colls = {k: {g: Fit(mix(f.latency, other.collectives[k][g].latency),
                            mix(f.per_unit, other.collectives[k][g].per_unit))
                     for g, f in v.items() if g in other.collectives.get(k, {})}
                 for k, v in self.collectives.items()}
        cpu = {g: mix(v, other.comm_cpu[g]) for g, v in self.comm_cpu.items()
               if g in other.comm_cpu}
        return Crowd({k: v for k, v in colls.items() if v}, cpu, mix(self.gap_s, other.gap_s))


def least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` minimising ``|a x - b|`` for a few columns, by modified Gram-Schmidt in plain
    Python floats.

    [Note: reproducible fits] LAPACK's least squares (torch.linalg.lstsq on MKL) rounds
    differently with the memory alignment of its inputs, so the same calibration refitted
    twice gave factors one ulp apart and every prediction built on them moved in its last
    bits from run to run. A handful of columns needs no LAPACK; this runs the same
    operations in the same order every time.
    """
    n, k = len(a), len(a[0])
    q = [[a[i][j] for i in range(n)] for j in range(k)]  # columns
    r = [[0.0] * k for _ in range(k)]
    for j in range(k):
        for i in range(j):
            r[i][j] = sum(q[i][t] * q[j][t] for t in range(n))
            q[j] = [q[j][t] - r[i][j] * q[i][t] for t in range(n)]
        r[j][j] = math.sqrt(sum(v * v for v in q[j]))
        if r[j][j] > 0:
            q[j] = [v / r[j][j] for v in q[j]]
    y = [sum(q[j][t] * b[t] for t in range(n)) for j in range(k)]
    x = [0.0] * k
    for j in reversed(range(k)):  # R x = Q^T b; a column of zeros gets a zero
        rest = y[j] - sum(r[j][i] * x[i] for i in range(j + 1, k))
        x[j] = rest / r[j][j] if r[j][j] > 0 else 0.0
    return x


def fit_terms(rows: list[tuple[tuple[float, ...], float]]) -> list[float]:
    """Non-negative coefficients ``c`` with ``seconds ~ sum(c_j x_j)``, least squares on the
    relative error, from ``((x_1, ..., x_k), seconds)`` rows (a term whose coefficient
    comes out negative is dropped and the rest refitted)."""
    k = len(rows[0][0])
    keep = list(range(k))
    while keep:
        coef = least_squares([[x[j] / t for j in keep] for x, t in rows], [1.0] * len(rows))
        if min(coef) >= 0:
            out = [0.0] * k
            for j, c in zip(keep, coef, strict=True):
                out[j] = c
            return out
        keep = [j for j, c in zip(keep, coef, strict=True) if c >= 0]
    return [0.0] * k
