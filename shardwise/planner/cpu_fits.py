"""The fitted pieces of a CPU calibration: ``latency + per_unit * size`` fits, a kernel's
forward and backward fits, the crowded collectives of a world beyond the cores, and the
least-squares fit they come from ([Note: CPU kernels] in cpu_costs.py).

    fit = Fit(*fit_terms([((1.0, n), seconds) for n, seconds in rows]))
    fit(4096)   # seconds at size 4096
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Fit", "Kernel", "Crowd", "fit_terms"]


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
    crowded collectives] in cpu_stage.py).

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


def fit_terms(rows: list[tuple[tuple[float, ...], float]]) -> list[float]:
    """Non-negative coefficients ``c`` with ``seconds ~ sum(c_j x_j)``, least squares on the
    relative error, from ``((x_1, ..., x_k), seconds)`` rows (a term whose coefficient
    comes out negative is dropped and the rest refitted)."""
    k = len(rows[0][0])
    keep = list(range(k))
    while keep:
        a = torch.tensor([[x[j] / t for j in keep] for x, t in rows], dtype=torch.float64)
        sol = torch.linalg.lstsq(a, torch.ones(len(rows), 1, dtype=torch.float64)).solution
        coef = sol.flatten().tolist()
        if min(coef) >= 0:
            out = [0.0] * k
            for j, c in zip(keep, coef, strict=True):
                out[j] = c
            return out
        keep = [j for j, c in zip(keep, coef, strict=True) if c >= 0]
    return [0.0] * k
