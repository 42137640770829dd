"""Checkpoint harnesses shared by the tests of every layout (tensor, expert, pipeline
parallelism): a model's whole state gathered for comparison, saved after training, loaded
at another layout, trained and saved again, exported and imported as safetensors.

A test passes its own module-level ``build(seed, degree, stage) -> (model, optimizer,
mesh)`` and ``train(model, optimizer, mesh, steps)``; the functions here are what every
layout does with them, so each test states only what differs (its degrees and checks).
Run them on ranks with :func:`shardwise.testing.run_ranks` (all module-level: picklable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise import checkpoint

__all__ = ["full_optimizer_state", "whole_state", "assert_same_states", "save_trained",
           "load_train_save", "save_fresh", "import_whole", "assert_same_files"]

Build = Callable[[int, int, int], tuple[nn.Module, torch.optim.Optimizer, Any]]
Train = Callable[[nn.Module, torch.optim.Optimizer, Any, int], None]


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every optimizer state tensor as the whole (unsharded, unsplit) tensor, by parameter
    name and key (collective); a parameter the engine does not shard keeps its own."""
    from shardwise.checkpoint.state import param_names
    from shardwise.shard import sharded_param_specs

    names, specs, out = param_names(model, opt), sharded_param_specs(model), {}
    for idx, st in sorted(opt.state_dict()["state"].items()):
        spec = specs.get(names[idx])
        for key, v in sorted(st.items()):
            if spec is not None and key != "step":
                v = spec.to_dtensor(v)
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{names[idx]}.{key}"] = v.clone()
    return out


def whole_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(whole weights, whole optimizer state) (collective)."""
    return shardwise.full_state_dict(model), full_optimizer_state(model, opt)


def assert_same_states(got: Sequence[dict], want: Sequence[dict], where: str) -> None:
    """Every dict of ``got`` bitwise equal to its counterpart in ``want``."""
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys(), where
        for k in a:
            assert torch.equal(a[k], b[k]), (where, k)


def save_trained(build: Build, train: Train, path: str, degree: int, stage: int, steps: int,
                 describe: Callable[[nn.Module], Any] | None = None):
    """Build at ``degree`` / ``stage`` (seed 0), train ``steps``, save at ``path``.

    Returns:
        (its whole state, ``describe(model)`` or None)
    """
    model, opt, mesh = build(0, degree, stage)
    train(model, opt, mesh, steps)
    checkpoint.save(path, model, opt, step=steps)
    return whole_state(model, opt), (describe(model) if describe else None)


def load_train_save(build: Build, train: Train, path: str, degree: int, stage: int,
                    out: str | None):
    """Build at ``degree`` / ``stage`` (seed 1: every weight must come from the checkpoint),
    load ``path``; with ``out``, train one step and save there.

    Returns:
        (the whole state loaded, whether the load resharded, the whole state after the
        step or None)
    """
    model, opt, mesh = build(1, degree, stage)
    info = checkpoint.load(path, model, opt)
    loaded = whole_state(model, opt)
    if out is None:
        return loaded, info.resharded, None
    train(model, opt, mesh, 1)
    checkpoint.save(out, model, opt, step=3)
    return loaded, info.resharded, whole_state(model, opt)


def save_fresh(build: Build, path: str, degree: int, stage: int) -> None:
    """Save the untrained model built at ``degree`` / ``stage`` (seed 0)."""
    model, opt, _ = build(0, degree, stage)
    checkpoint.save(path, model, opt, step=0)


def import_whole(build: Build, path: str, degree: int) -> dict:
    """Safetensors at ``path`` imported into a model built at ``degree``, stage 3 (seed 1;
    each rank reads its piece), gathered back whole."""
    from shardwise.checkpoint.export import import_safetensors

    model, _, _ = build(1, degree, 3)
    import_safetensors(path, model)
    return shardwise.full_state_dict(model)


def assert_same_files(folders: dict[Any, Path]) -> list[str]:
    """Every folder holds the same file names with the same bytes as the first one.

    Returns:
        The file names.
    """
    first, *rest = folders.values()
    files = sorted(p.name for p in Path(first).iterdir())
    for key, folder in folders.items():
        assert sorted(p.name for p in Path(folder).iterdir()) == files, key
        for name in files:
            assert (Path(folder) / name).read_bytes() == (Path(first) / name).read_bytes(), \
                (key, name)
    return files
