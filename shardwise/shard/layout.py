"""Where each parameter's rows live: dim-0 sharding arithmetic for one unit.

[Note: unit layout] Every parameter of shape ``(rows, *rest)`` is split along dim 0 the way
``torch.chunk`` (and DTensor's ``Shard(0)``) splits it: ``chunk = ceil(rows / n)`` rows per
rank, so rank ``r`` holds rows ``[r * chunk, min((r + 1) * chunk, rows))`` (possibly none).
The unit packs, per rank, every parameter's *padded* chunk (``chunk * row_numel`` elements)
back to back into one flat shard buffer of ``shard_numel`` elements, so that

* one ``all_gather_into_tensor`` of the flat shard buffers gives a rank-major
  ``(n, shard_numel)`` tensor whose column block ``[offset, offset + padded)`` holds the
  parameter's padded rows in order: the full parameter is the first ``rows`` rows of that
  block read rank by rank;
* one ``reduce_scatter_tensor`` of the same layout returns each rank its own gradient rows.

Padding rows (at most ``n - 1`` per parameter) are zero and never belong to any parameter.
Trainable parameters come first so that the gradient layout is a prefix of the shard layout.
A 0-d parameter is laid out as one row of one element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ParamLayout", "UnitLayout", "build_layout"]


@dataclass(frozen=True)
class ParamLayout:
    """Placement of one parameter inside its unit's flat buffers."""

    shape: torch.Size
    rows: int
    row_numel: int
    chunk_rows: int
    offset: int

    @property
    def padded_numel(self) -> int:
        """Elements of this parameter in every rank's flat shard (padding included)."""
        return self.chunk_rows * self.row_numel

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Rows of this parameter that ``rank`` holds (0 when beyond the last row)."""
        return max(0, min(self.chunk_rows, self.rows - rank * self.chunk_rows))

    def local_shape(self, rank: int) -> torch.Size:
        """Shape of ``rank``'s shard; a 0-d parameter lives on rank 0 only."""
        if len(self.shape) == 0:
            return torch.Size([]) if rank == 0 else torch.Size([0])
        return torch.Size([self.local_rows(rank), *self.shape[1:]])

    def row_offset(self, rank: int) -> int:
        """Index of ``rank``'s first row in the full parameter."""
        return min(rank * self.chunk_rows, self.rows)


@dataclass(frozen=True)
class UnitLayout:
    """All parameters of a unit laid out for a group of ``world`` ranks."""

    params: tuple[ParamLayout, ...]
    world: int
    shard_numel: int
    grad_numel: int

    @property
    def full_numel(self) -> int:
        """Elements of the padded unsharded buffer (``world * shard_numel``)."""
        return self.world * self.shard_numel


def build_layout(shapes: list[torch.Size], trainable: list[bool], world: int) -> UnitLayout:
    """Lay out parameters of the given shapes for ``world`` ranks.

    Args:
        shapes: full shapes, trainable parameters first.
        trainable: whether each parameter gets a gradient (must be a prefix of True).
        world: ranks in the shard group.

    Returns:
        The :class:`UnitLayout`.
    """
    assert world >= 1 and len(shapes) == len(trainable)
    assert trainable == sorted(trainable, reverse=True), "trainable parameters must come first"
    params, offset, grad_numel = [], 0, 0
    for shape, train in zip(shapes, trainable):
        rows = shape[0] if len(shape) else 1
        row_numel = math.prod(shape[1:]) if len(shape) else 1
        chunk = -(-rows // world)
        p = ParamLayout(torch.Size(shape), rows, row_numel, chunk, offset)
        params.append(p)
        offset += p.padded_numel
        if train:
            grad_numel = offset
    return UnitLayout(tuple(params), world, offset, grad_numel)
