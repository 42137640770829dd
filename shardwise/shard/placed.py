"""The engine's side of [Note: placement is data] (distributed/placement.py): it records its
data axes in every parameter's :class:`Placement`, and after its data-parallel reduction it
sums the gradients the record says are partial over model axes.

[Note: partial gradients] A parameter replicated over the tensor ranks inside a
sequence-parallel region (a norm weight) sees only this rank's tokens, and a KV head copied
to several tensor ranks gets a share of its gradient from each: their gradients are partial
sums over those axes (``Placement.partial_axes``). After backward has averaged every
gradient over the data ranks, one all-reduce per such group (all its parameters' gradients
flattened together) completes them, so every copy holds the whole gradient and the copies
stay identical. Summing after the data average equals averaging the sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.mesh import ShardGroups, axis_groups
from shardwise.distributed.placement import Axis, Placement, axis_of_group, placement_of, \
    set_placement

__all__ = ["data_axes", "record_data_axes", "PartialGrads", "model_piece", "global_shape",
           "own_data_axis", "unit_groups"]


def data_axes(groups: ShardGroups, sharded: bool) -> tuple[Axis | None, tuple[Axis, ...]]:
    """(the axis parameters are split over, the axes holding copies) of one ``shard`` call.

    Args:
        groups: the call's groups.
        sharded: stages 1-3 (parameters cut along dim 0 over ``groups.shard``); False for
            stage 0's buckets, where ``groups.shard`` holds whole copies too.
    """
    if not dist.is_initialized():
        return None, ()
    reps = []
    if groups.replicate is not None:
        name = "dp" if groups.shard is None else "dp_replicate"
        reps.append(axis_of_group(name, groups.replicate))
    shard = axis_of_group("dp_shard", groups.shard) if groups.shard is not None else None
    if not sharded and shard is not None:
        reps.append(shard)
        shard = None
    return shard, tuple(reps)


def record_data_axes(params: list[nn.Parameter], groups: ShardGroups, sharded: bool) -> None:
    """Add this ``shard`` call's data axes to every parameter's placement (a parameter with
    none gets a whole-tensor one first); a parameter whose placement names its own
    ``data_shard`` (experts: ``edp``) gets that axis instead ([Note: expert placement])."""
    call = data_axes(groups, sharded)
    for p in params:
        pl = placement_of(p) or Placement.replicated(p.shape)
        shard, reps = call
        if pl.data_shard is not None and dist.is_initialized():
            shard, reps = (pl.data_shard, ()) if sharded else (None, (pl.data_shard,))
        _check_disjoint(pl, [a for a in (shard, *reps) if a is not None])
        assert tuple(pl.model_shape()) == tuple(p.shape), (pl.describe(), tuple(p.shape))
        set_placement(p, pl.with_data(shard, reps))


def own_data_axis(module: nn.Module) -> bool:
    """Whether a direct parameter of ``module`` names its own ``data_shard`` (experts): the
    engine makes such a module a unit of its own, reduced over that axis."""
    return any(p is not None and getattr(placement_of(p), "data_shard", None) is not None
               for p in module._parameters.values())


def unit_groups(params: list[nn.Parameter], names: list[str], groups: ShardGroups,
                where: str) -> ShardGroups:
    """The groups a unit owning ``params`` communicates over: the shard call's ``groups``,
    or, when their placements name a ``data_shard`` axis, that axis alone with the gradient
    divided by the placement's ``data_degree`` ([Note: expert placement]).

    Raises:
        ValueError: parameters of one unit naming different data axes, naming two of them.
    """
    found: dict[object, tuple[Placement | None, str]] = {}
    for p, name in zip(params, names):
        pl = placement_of(p)
        axis = pl.data_shard if pl is not None else None
        found.setdefault(None if axis is None else axis.ranks, (pl, name))
    if len(found) > 1:
        (a, (_, n1)), (b, (_, n2)) = list(found.items())[:2]
        raise ValueError(f"unit {where} holds {n1} (reduced over "
                         f"{'the shard call' if a is None else f'ranks {list(a)}'}) and {n2} "
                         f"(reduced over {'the shard call' if b is None else f'ranks {list(b)}'})"
                         f": expert parameters must sit in a module of their own (apply_ep's "
                         f"experts module), not in a tied or shared module")
    pl = next(iter(found.values()))[0] if found else None
    if pl is None or pl.data_shard is None or not dist.is_initialized():
        return groups
    return axis_groups(pl.data_shard.group, pl.data_degree)


def _check_disjoint(pl: Placement, data: list[Axis]) -> None:
    """Data axes must not run along a model axis (e.g. shard over the world after
    ``apply_tp`` over part of it): the engine would average a tensor rank's pieces with
    another tensor rank's."""
    for axis in pl.model_axes():
        for d in data:
            shared = set(axis.ranks) & set(d.ranks)
            if len(shared) > 1:
                raise ValueError(f"parameters are laid out over the {axis.name} ranks "
                                 f"{list(axis.ranks)}, and this shard call would treat ranks "
                                 f"{sorted(shared)} of them as data-parallel ({d.name}): pass "
                                 f"mesh=<the ParallelMesh> (or a mesh of the data axes only)")


def global_shape(param: nn.Parameter) -> torch.Size:
    """The parameter's shape in the unsplit model (its own shape if nothing split it)."""
    pl = placement_of(param)
    return pl.shape if pl is not None else param.shape


def model_piece(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the global tensor ``full`` before data parallelism cuts it."""
    pl = placement_of(param)
    return pl.model_piece(full) if pl is not None else full


class PartialGrads:
    """Sums the partial gradients of a ``shard`` call's parameters over their model axes
    ([Note: partial gradients]); call it after the data-parallel reduction."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.by_group: dict[tuple, tuple[object, str, list[nn.Parameter]]] = {}
        for p in params:
            pl = placement_of(p)
            if pl is None or not p.requires_grad:
                continue
            for a in pl.partial_axes():
                key = (id(a.group), p.dtype)
                self.by_group.setdefault(key, (a.group, a.name, []))[2].append(p)

    def __bool__(self) -> bool:
        return bool(self.by_group)

    def __call__(self) -> None:
        for group, name, params in self.by_group.values():
            for p in params:
                if p.grad is None:  # every copy must send the same layout
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group, label=f"{name}.tp_grad_all_reduce")
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in
                                         zip(flat.split([g.numel() for g in grads]), grads)])
