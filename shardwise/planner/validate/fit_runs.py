"""Fit the hardware families' constants on the published runs marked ``role = "fit"``.

    python -m shardwise.planner.fit_runs

[Note: what is fitted] Per family, one constant: ``matmul_max``, the fraction of peak that
large matrix multiplies reach. The other constants of a family (the efficiency curve's
half-size, HBM and link efficiencies) are priors documented in data/hardware.toml: a first
fit that freed all five on the six Ampere fit runs drove the link and memory efficiencies to
1.0 and the half-size to its bound while barely lowering the error (the runs, all of large
multiplies and mostly compute-bound, cannot tell these apart from ``matmul_max``), so they
are not fitted on end-to-end step times; ``--calibrate`` measures them on the local machine.
Ampere fits on six runs (1.7B to 1T parameters, 8 to 3072 GPUs), Hopper on one (Llama 3
405B on 8192 H100); the power-capped H100 of torchtitan's runs is a device of its own (its
peak is not published) fitted on one run. The fit prices runs with the search's closed
forms (seconds instead of minutes; the reported predictions then use the simulated
schedule, which differs from them by at most a few percent on these runs). The fitted
values are written, rounded, into
data/hardware.toml and data/published_runs.toml; tests/test_planner_validation.py checks
that refitting reproduces them.

[Note: software constants] A few constants belong to a software version, not a device:
``STACK_FITS`` names each, the one published A/B pair that isolates it (its ``fit`` run)
and the runs of the same version that carry it (judged). torch's AsyncTP of December 2024
fused only part of its collectives (pattern matching that missed some graphs silently,
fixed in 2025: pytorch/pytorch#149946, pytorch/torchtitan#965), so its share is fitted on
torchtitan's Table 4 (2D + AsyncTP, 876 tokens/s/GPU, beside the 829 without) after the
families' constants, and judged on Table 5's 3D runs.
"""

from __future__ import annotations

import dataclasses

from shardwise.planner.calibrate.fit import fit_constants, log_error
from shardwise.planner.validate.runs import hardware_of, load_runs, predict

__all__ = ["fit_families", "fit_stack", "FAMILY_FITS", "STACK_FITS"]

FAMILY_FITS = {
    # family: parameters fitted on its fit runs
    "ampere": ("matmul_max",),
    "hopper": ("matmul_max",),
    "hopper_500w": ("matmul_max",),
}
STACK_FITS = {
    # workload field: (its fit run, the runs of the same software version carrying it)
    "overlap_tp_fraction": ("torchtitan-h100-70b-2d-fp8-asynctp",
                            ("torchtitan-h100-405b-3d-1f1b",
                             "torchtitan-h100-405b-3d-interleaved")),
}
_BOUNDS = {"matmul_max": (0.3, 1.0), "matmul_half_gflop": (0.05, 200.0),
           "memory_efficiency": (0.2, 1.0), "intra_efficiency": (0.2, 1.0),
           "inter_efficiency": (0.2, 1.0)}


def _overrides(params: dict[str, float]) -> dict:
    """Hardware fields from family constants (``matmul_half_gflop`` is in GFLOP)."""
    out = {}
    for k, v in params.items():
        if k == "matmul_half_gflop":
            out["matmul_half"] = v * 1e9
        else:
            out[k] = v
    return out


def _loss(runs, family: str, params: dict[str, float], base: dict[str, float]) -> float:
    merged = _overrides({**base, **params})
    predicted = [predict(r, {family: merged}, exact=False)[1] for r in runs]
    return log_error(predicted, [r.value for r in runs])


def _constants(hw) -> dict[str, float]:
    return {"matmul_max": hw.matmul_max, "matmul_half_gflop": hw.matmul_half / 1e9,
            "memory_efficiency": hw.memory_efficiency, "intra_efficiency": hw.intra_efficiency,
            "inter_efficiency": hw.inter_efficiency}


def fit_families(iterations: int = 150) -> dict[str, tuple[dict[str, float], float]]:
    """Fit every family on its fit runs ([Note: what is fitted]).

    Returns:
        {family: (all five constants, the fit's mean squared log error)}.
    """
    stack_runs = {fit_id for fit_id, _ in STACK_FITS.values()}
    runs = [r for r in load_runs() if r.role == "fit" and r.id not in stack_runs]
    results: dict[str, tuple[dict[str, float], float]] = {}
    for family, names in FAMILY_FITS.items():
        mine = [r for r in runs if hardware_of(r).family == family]
        current = _constants(hardware_of(mine[0]))
        start = {n: current[n] for n in names}
        base = {n: v for n, v in current.items() if n not in names}
        params, loss = fit_constants(start, {n: _BOUNDS[n] for n in names},
                                     lambda p, mine=mine, family=family, base=base:
                                     _loss(mine, family, p, base), iterations)
        results[family] = ({**base, **params}, loss)
    return results


def fit_stack(families: dict[str, tuple[dict[str, float], float]] | None = None,
              iterations: int = 60) -> dict[str, tuple[float, float]]:
    """Fit every software constant of ``STACK_FITS`` on its fit run ([Note: software
    constants]), with the families' constants ``families`` (default: the committed ones).

    Returns:
        {workload field: (fitted value, the fit's squared log error)}.
    """
    runs = {r.id: r for r in load_runs()}
    overrides = {f: _overrides(p) for f, (p, _) in families.items()} if families else None
    out = {}
    for name, (fit_id, _) in STACK_FITS.items():
        run = runs[fit_id]

        def loss(p, run=run, name=name):
            r = dataclasses.replace(run, stack={**run.stack, name: p[name]})
            return log_error([predict(r, overrides, exact=False)[1]], [r.value])

        params, value = fit_constants({name: run.stack.get(name, 0.5)}, {name: (0.0, 1.0)},
                                      loss, iterations)
        out[name] = (params[name], value)
    return out


def main() -> int:
    """Print every fitted constant and its fit's mean squared log error."""
    families = fit_families()
    for family, (params, loss) in families.items():
        print(family, {k: round(v, 4) for k, v in params.items()}, f"loss {loss:.5f}")
    for name, (value, loss) in fit_stack(families).items():
        print(name, round(value, 3), f"loss {loss:.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
