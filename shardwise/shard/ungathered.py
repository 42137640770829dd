"""Placeholders for parameters whose unit is not gathered, so a misuse is named, not garbled.

[Note: ungathered placeholders] A unit's parameters are full only while the unit computes
(between its forward pre- and post-hooks, and in its backward). Between steps its modules
hold the sharded Parameters; during the model's forward they hold these placeholders
instead: tensors with the full parameter's shape, dtype and device but no data, whose every
operation raises a ``ValueError`` naming the parameter and its unit. The case they catch is
a module whose parameters another module reads directly instead of calling it, e.g.
``nn.MultiheadAttention`` reading ``out_proj.weight``: wrapped as a unit of its own, that
module never runs its forward, so its parameters are never gathered, and without the
placeholder the reader would compute with a shard and fail with a raw shape error (or, at
one rank, silently work). Metadata (``.shape``, ``.dtype``, ``.device``) stays readable.
"""

from __future__ import annotations

import torch

__all__ = ["UngatheredParameter"]


class UngatheredParameter(torch.Tensor):
    """Stands for parameter ``name`` of unit ``unit`` while that unit is not gathered."""

    unit: str
    param_name: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, unit: str, name: str) -> UngatheredParameter:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                device=like.device,
                                                requires_grad=like.requires_grad)
        t.unit, t.param_name = unit, name
        return t

    def __repr__(self) -> str:  # printing must not run an op
        return (f"UngatheredParameter({self.param_name!r} of unit {self.unit!r}, "
                f"{tuple(self.shape)})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        found = next((a for a in (*args, *(kwargs or {}).values())
                      if isinstance(a, UngatheredParameter)), None)
        name, unit = (found.param_name, found.unit) if found is not None else ("?", "?")
        raise ValueError(
            f"parameter {name!r} of unit {unit!r} was used ({func}) while its unit is not "
            f"gathered: a module read it outside the forward of that unit (for example "
            f"nn.MultiheadAttention reads out_proj.weight directly). Wrap the module that "
            f"reads it, or an ancestor of both, instead of {unit!r} "
            f"(shardwise.shard(..., wrap=...)).")
