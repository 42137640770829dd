"""Placement: one record per parameter saying how it is laid out over the mesh.

[Note: placement is data] Each parameter of a parallelised model carries one
:class:`Placement`: its global (unsplit) shape, which tensor dims are split over which mesh
axes (in nesting order: the first split cuts the global tensor, the next cuts that piece,
...), which axes hold identical copies, which axes its gradient is reduced over and which
axes its squared norm is summed over. ``apply_tp`` writes the tensor-parallel part; the ZeRO
engine adds its data axes (``dp_shard`` splits dim 0 of what tensor parallelism left,
innermost; ``dp_replicate`` holds copies). Everything downstream reads this record and
nothing re-derives it: the engine's gradient reductions, ``clip_grad_norm_`` (each element
counted exactly once), the state dict (one global DTensor over the axes the record names),
``full_state_dict``, HF export and the planner.

Splits follow ``torch.chunk`` (and DTensor's ``Shard``): ``ceil(n / k)`` rows per rank, the
last ones possibly shorter or empty.

Gradients are *averaged* over data axes (each data rank's loss is a mean over its own batch)
and *summed* over every other axis in ``grad_reduce`` (the ranks hold partial sums of one
gradient: a norm weight under sequence parallelism sees only this rank's tokens; a KV head
copied to several tensor ranks gets a share from each).

[Note: expert placement] Expert parallelism (``apply_ep``) splits an expert parameter's
dim 0 (the experts) over ``ep`` and names ``edp`` (the data ranks holding the same experts)
as its ``data_shard``: the ZeRO engine shards and reduces it over ``edp`` instead of the
shard call's ``dp_shard``. Its gradient is *summed* over ``edp`` and divided by
``data_degree``, the full data-parallel degree ``edp x ep``, not by the ``edp`` size: the
all-to-all's backward has already summed the contributions of the ``ep`` ranks' tokens, so
dividing by ``edp`` alone would weight expert gradients ``ep`` times too heavily (the
classic EP scaling bug).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.parallel_dims import DATA_AXES

__all__ = ["Axis", "Placement", "placement_of", "set_placement", "axis_of_group",
           "chunk_range"]

_ATTR = "_shardwise_placement"


@dataclass(frozen=True)
class Axis:
    """One mesh axis as this rank sees it.

    Attributes:
        name: the axis name ("tp", "dp_shard", "tp_kv", ...).
        ranks: global ranks of this rank's group along the axis, in axis order.
        group: their process group (None for a one-rank axis without torch.distributed).
    """

    name: str
    ranks: tuple[int, ...]
    group: object = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's coordinate along the axis."""
        me = dist.get_rank() if dist.is_initialized() else self.ranks[0]
        return self.ranks.index(me)

    @property
    def is_data(self) -> bool:
        """Whether ranks along this axis see different batches (gradients averaged)."""
        return self.name in DATA_AXES


def axis_of_group(name: str, group) -> Axis:
    """The :class:`Axis` ``name`` over an existing process group (None: this rank alone)."""
    if group is None or not dist.is_initialized():
        return Axis(name, (dist.get_rank() if dist.is_initialized() else 0,), None)
    return Axis(name, tuple(dist.get_process_group_ranks(group)), group)


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``index`` when ``length`` is split like ``torch.chunk``."""
    step = -(-length // parts) if parts else length
    start = min(index * step, length)
    return start, min(start + step, length)


@dataclass(frozen=True)
class Placement:
    """How one parameter is laid out (see [Note: placement is data]).

    Attributes:
        shape: the global shape: the parameter's shape in the unsplit model.
        splits: ``(tensor dim, axis)`` pairs in nesting order (outermost cut first).
        replicas: axes over which this rank's piece is held identically by every rank.
        grad_reduce: axes the gradient is reduced over (averaged over data axes, summed
            over the others).
        norm_reduce: axes the squared gradient norm is summed over: each element of the
            global gradient is counted on exactly one rank of them.
        data_shard: the data axis the ZeRO engine splits this parameter over in place of its
            shard call's ``dp_shard`` (expert parameters: ``edp``); None: the call's axes.
        data_degree: the number of data-parallel ranks whose losses the gradient averages,
            when it is not the size of the data axes it is reduced over (expert parameters:
            ``edp x ep``, see [Note: expert placement]); None: those axes' size.
    """

    shape: torch.Size
    splits: tuple[tuple[int, Axis], ...] = ()
    replicas: tuple[Axis, ...] = ()
    grad_reduce: tuple[Axis, ...] = ()
    norm_reduce: tuple[Axis, ...] = ()
    data_shard: Axis | None = None
    data_degree: int | None = None

    @staticmethod
    def replicated(shape) -> "Placement":
        """A whole parameter on every rank (nothing split, nothing to reduce)."""
        return Placement(torch.Size(shape))

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every axis the parameter is laid out over: copies first, then splits in order."""
        return self.replicas + tuple(a for _, a in self.splits)

    def axis(self, name: str) -> Axis | None:
        """The axis called ``name`` in this record, if any."""
        return next((a for a in (*self.axes, *self.grad_reduce, *self.norm_reduce)
                     if a.name == name), None)

    def local_range(self, upto: int | None = None) -> list[tuple[int, int, int]]:
        """``(dim, start, stop)`` of this rank's piece after the first ``upto`` splits (all
        by default), in global coordinates, one entry per split."""
        bounds = {d: (0, s) for d, s in enumerate(self.shape)}
        out = []
        for dim, axis in self.splits[:upto]:
            lo, hi = bounds[dim]
            a, b = chunk_range(hi - lo, axis.size, axis.index)
            bounds[dim] = (lo + a, lo + b)
            out.append((dim, lo + a, lo + b))
        return out

    def local_shape(self, upto: int | None = None) -> torch.Size:
        """This rank's shape after the first ``upto`` splits (all by default)."""
        shape = list(self.shape)
        for dim, a, b in self.local_range(upto):
            shape[dim] = b - a
        return torch.Size(shape)

    def local_piece(self, full: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """This rank's piece (a view) of the global tensor ``full``."""
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"expected a tensor of the global shape {tuple(self.shape)}, got "
                             f"{tuple(full.shape)}")
        bounds = {dim: (a, b) for dim, a, b in self.local_range(upto)}  # the innermost wins
        out = full
        for dim, (a, b) in bounds.items():
            out = out.narrow(dim, a, b - a)
        return out

    def model_axes(self) -> tuple[Axis, ...]:
        """Axes not owned by data parallelism (tensor, pipeline, expert)."""
        return tuple(a for a in self.axes if not a.is_data)

    def partial_axes(self) -> tuple[Axis, ...]:
        """Axes the gradient is *summed* over after data-parallel averaging (non-data axes
        of ``grad_reduce`` with more than one rank)."""
        return tuple(a for a in self.grad_reduce if not a.is_data and a.size > 1)

    def model_splits(self) -> int:
        """How many leading splits belong to model axes (data splits come innermost)."""
        return sum(1 for _, a in self.splits if not a.is_data)

    def model_shape(self) -> torch.Size:
        """The shape of this rank's piece before data parallelism cuts it."""
        return self.local_shape(self.model_splits())

    def model_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the global ``full`` before data parallelism cuts it."""
        return self.local_piece(full, self.model_splits())

    def with_data(self, shard: Axis | None, replicas: tuple[Axis, ...] = ()) -> "Placement":
        """This record once the ZeRO engine owns the parameter: ``shard`` (when given)
        splits dim 0 of the model piece, innermost; ``replicas`` hold copies; the gradient
        is averaged over all of them and the norm summed over ``shard``. Data axes already
        present are replaced. A 0-d parameter lives on the shard group's first rank (the
        others hold nothing), so ``shard`` holds it rather than splitting it."""
        keep = [(d, a) for d, a in self.splits if not a.is_data]
        reps = [a for a in replicas] + [a for a in self.replicas if not a.is_data]
        grad = [a for a in self.grad_reduce if not a.is_data] + list(replicas)
        norm = [a for a in self.norm_reduce if not a.is_data]
        if shard is not None:
            if len(self.shape):
                keep.append((0, shard))
            else:
                reps.append(shard)
            grad.append(shard)
            norm.append(shard)
        return replace(self, splits=tuple(keep), replicas=tuple(reps), grad_reduce=tuple(grad),
                       norm_reduce=tuple(norm))

    def describe(self) -> str:
        """E.g. ``"(4096, 4096) dim0/tp dim0/dp_shard, copies over dp_replicate"``."""
        parts = [f"{tuple(self.shape)}"]
        parts += [f"dim{d}/{a.name}" for d, a in self.splits]
        if self.replicas:
            parts.append("copies over " + ", ".join(a.name for a in self.replicas))
        return " ".join(parts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def placement_of(param: nn.Parameter | torch.Tensor) -> Placement | None:
    """The :class:`Placement` recorded on ``param`` (None for a parameter nothing laid out)."""
    return getattr(param, _ATTR, None)


def set_placement(param: nn.Parameter | torch.Tensor, placement: Placement | None) -> None:
    """Record ``placement`` on ``param`` (it travels with the Parameter object)."""
    if placement is None:
        if hasattr(param, _ATTR):
            delattr(param, _ATTR)
        return
    setattr(param, _ATTR, placement)
