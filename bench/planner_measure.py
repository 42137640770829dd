"""What planner_bench measures on each rank, besides ``memory_report``: the activations
saved for backward and the whole gradients autograd holds outside the engine's accounting.

Both are read by hooks around the first (memory-tracked) step only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SavedPeak", "WholeGrads", "parameter_storages"]


def parameter_storages(model: torch.nn.Module) -> set[int]:
    """Storages of the model's parameters: its own (shards, or whole parameters at stage
    0), and the engine's gathered full parameters (``graph_parameters``), which autograd
    saves as views (a linear saves its transposed weight) and ``memory_report`` already
    counts as parameters or gathered parameters."""
    from shardwise.shard.controls import graph_parameters

    tensors = list(model.parameters())
    try:
        tensors += graph_parameters(model)
    except ValueError:  # not sharded: only its own parameters
        pass
    out = set()
    for p in tensors:
        t = p.to_local() if hasattr(p, "to_local") else p
        out.add(t.untyped_storage()._cdata)
    return out


class SavedPeak:
    """The most bytes saved for backward alive at once: unique storages packed by
    ``saved_tensors_hooks``, leaving out parameter storages (``exclude``: whole, sharded or
    gathered parameters, and views of them such as a transposed weight) and leaf tensors
    that require grad (a pipeline stage's received activations)."""

    def __init__(self, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()
        self.live: dict[int, tuple[Any, int]] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is None):
            st = t.untyped_storage()
            if st._cdata not in self.exclude:
                self.live.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
                self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
                self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return t


class WholeGrads:
    """The most bytes of whole (unsharded) gradients on the engine's full parameters, read
    whenever a unit packs its gradients for reduction: at stage 1 every unit's at the end of
    backward, with accumulation (pipeline micro-batches) every unit's sum so far, at stages
    2/3 the packing unit's own. Autograd owns these tensors, so ``memory_report`` does not
    count them; the planner predicts them as ``full_grads``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from shardwise.shard.registry import engine_states

        self.units = [u for s in engine_states(model) for u in getattr(s, "units", [])]
        self.peak = 0

    def read(self) -> None:
        held = sum(sp.full.grad.untyped_storage().nbytes() for u in self.units
                   for sp in u.params if sp.full.grad is not None)
        self.peak = max(self.peak, held)

    def __enter__(self) -> "WholeGrads":
        for u in self.units:  # an instance attribute shadows Unit.pack_grads
            def pack(orig=u.pack_grads):
                self.read()
                return orig()
            u.pack_grads = pack
        return self

    def __exit__(self, *exc) -> None:
        for u in self.units:
            del u.pack_grads
