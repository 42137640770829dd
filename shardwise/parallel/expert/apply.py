"""``apply_ep``: expert parallelism applied to a model in place, after ``apply_tp`` and before
``shardwise.shard``.

    mesh = ParallelDims(world_size=4, ep=2).build_mesh()        # dp_shard 4, ep 2, edp 2
    model = shardwise.apply_ep(model, mesh)                     # experts split over ep
    model = shardwise.shard(model, stage=3, wrap={TransformerBlock}, mesh=mesh)

Each MoE layer's experts (the built-in :class:`~shardwise.models.experts.GroupedExperts`,
or a Hugging Face experts module of stacked 3-D parameters called as ``experts(hidden,
top_k_index, top_k_weights)``) keep the ``E / ep`` experts of this ep rank, and their
forward becomes dispatch -> local experts -> combine ([Note: expert dispatch] in
dispatch.py). Every expert parameter gets a :class:`~shardwise.distributed.placement.
Placement` ([Note: expert placement]): dim 0 split over ``ep``, ZeRO-sharded over ``edp``,
its gradient summed over ``edp`` and divided by the data-parallel degree ``edp x ep``.
Names and ``state_dict()`` keys are those of the unsplit model.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.mesh import ParallelMesh
from shardwise.distributed.placement import Axis, Placement, placement_of, set_placement
from shardwise.models.experts import GroupedExperts
from shardwise.parallel.blocks import FORWARD_COLLECTIVES_ATTR
from shardwise.parallel.expert.dispatch import ExpertGroup, dispatch_compute_combine
from shardwise.parallel.expert.hf import FusedExpertsEP
from shardwise.parallel.tensor.api import tp_context
from shardwise.shard.registry import engine_states

__all__ = ["apply_ep", "ep_context", "share_ep_context", "EPContext", "expert_modules"]

_CTX_ATTR = "_shardwise_ep_context"


@dataclass(frozen=True)
class EPContext:
    """What :func:`apply_ep` recorded on the model.

    Attributes:
        ep: the expert-parallel axis.
        edp: the data ranks holding the same experts.
        layers: the names of the experts modules it parallelised.
    """

    ep: Axis
    edp: Axis
    layers: tuple[str, ...]


class GroupedExpertsEP:
    """Expert-parallel forward of :class:`GroupedExperts` (mixed in before it): the same
    ``(x_sorted, counts) -> y`` contract over the whole layer's experts, computed by the
    local ones after a dispatch."""

    def forward(self, x, counts):  # noqa: ANN001, ANN201 - GroupedExperts' signature
        return dispatch_compute_combine(x, counts, self._shardwise_ep, super().forward)


@functools.lru_cache(maxsize=None)
def _ep_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s forward (cached: one class per experts class)."""
    return type(f"{mixin.__name__}_{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})


def _fused(module: nn.Module) -> bool:
    """A Hugging Face experts module: ``num_experts`` stacked along dim 0 of every direct
    parameter, called as ``(hidden_states, top_k_index, top_k_weights)``."""
    e = getattr(module, "num_experts", None)
    params = [p for p in module._parameters.values() if p is not None]
    if not isinstance(e, int) or isinstance(e, bool) or e < 1 or not params:
        return False
    if any(p.dim() < 2 or p.shape[0] != e for p in params):
        return False
    try:
        args = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(args) == 3 and all(a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)
                                  for a in args)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules ``apply_ep`` parallelises, in ``named_modules()`` order."""
    out = []
    for name, m in model.named_modules():
        if any(name.startswith(f"{n}.") for n, _ in out):
            continue
        if isinstance(m, GroupedExperts) or _fused(m):
            out.append((name, m))
    return out


def _axis(name: str, mesh) -> Axis:  # noqa: ANN001
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 1:
        return Axis(name, tuple(int(r) for r in mesh.mesh.tolist()), mesh.get_group())
    raise ValueError(f"{name} mesh must be a 1-D DeviceMesh (e.g. ParallelMesh['{name}']), "
                     f"got {mesh!r}")


def _axes(ep_mesh, edp_mesh) -> tuple[Axis, Axis]:  # noqa: ANN001
    if not dist.is_initialized():
        raise ValueError("apply_ep needs torch.distributed initialised; call "
                         "shardwise.distributed.init() first")
    if isinstance(ep_mesh, ParallelMesh):
        if edp_mesh is not None:
            raise ValueError("edp_mesh is taken from the ParallelMesh; pass one or the other")
        return (Axis("ep", tuple(ep_mesh.ranks("ep")), ep_mesh.group("ep")),
                Axis("edp", tuple(ep_mesh.ranks("edp")), ep_mesh.group("edp")))
    ep = _axis("ep", ep_mesh)
    if edp_mesh is None:
        raise ValueError("apply_ep with a DeviceMesh of the ep ranks needs edp_mesh= (the data "
                         "ranks that hold the same experts, mesh['edp']); or pass the "
                         "ParallelMesh")
    edp = _axis("edp", edp_mesh)
    if set(ep.ranks) & set(edp.ranks) != {dist.get_rank()}:
        raise ValueError(f"the ep ranks {list(ep.ranks)} and edp ranks {list(edp.ranks)} must "
                         f"meet in this rank alone")
    return ep, edp


def _cut(name: str, module: nn.Module, attr: str, ep: Axis, edp: Axis) -> None:
    """Keep this ep rank's experts of ``module.<attr>`` and record its placement."""
    p = module._parameters[attr]
    pl = placement_of(p) or Placement.replicated(p.shape)
    if pl.splits or pl.data_shard is not None:
        raise ValueError(f"{name}.{attr} is already laid out ({pl.describe()}): experts are "
                         f"not split by tensor parallelism, and apply_ep runs once")
    pl = replace(pl, splits=((0, ep),), norm_reduce=pl.norm_reduce + (ep,), data_shard=edp,
                 data_degree=edp.size * ep.size)
    if p.is_meta:
        p.data = p.data.new_empty(pl.local_shape())
    else:
        p.data = pl.local_piece(p.detach()).contiguous().clone()
    set_placement(p, pl)


def _check_model(model: nn.Module) -> None:
    if engine_states(model):
        raise ValueError(f"{type(model).__name__} is already sharded: apply_ep goes before "
                         f"shardwise.shard")
    if hasattr(model, _CTX_ATTR):
        raise ValueError(f"{type(model).__name__} is already expert-parallel; apply_ep once")
    ctx = tp_context(model)
    if ctx is not None and ctx.tp.size > 1 and not ctx.sequence_parallel:
        raise ValueError(f"apply_ep after apply_tp over {ctx.tp.size} ranks needs "
                         f"sequence_parallel=True: each tensor rank dispatches its own "
                         f"sequence shard (without it every tensor rank would send the same "
                         f"tokens)")


def apply_ep(model: nn.Module, ep_mesh, edp_mesh=None) -> nn.Module:  # noqa: ANN001
    """Split the experts of every MoE layer of ``model`` over the expert-parallel ranks.

    Apply it after :func:`~shardwise.parallel.apply_tp` (if any) and before
    :func:`shardwise.shard` with the same mesh; see the module doc.

    Args:
        model: a shardwise MoE ``Transformer`` or a Hugging Face MoE decoder whose experts
            are stacked 3-D parameters; on the meta device or real.
        ep_mesh: the job's :class:`~shardwise.distributed.mesh.ParallelMesh` (its ``ep`` and
            ``edp`` axes), or the 1-D DeviceMesh of the ep ranks (``mesh["ep"]``).
        edp_mesh: with a DeviceMesh ``ep_mesh``, the 1-D DeviceMesh of the data ranks that
            hold the same experts (``mesh["edp"]``); default None.

    Returns:
        ``model``.

    Raises:
        ValueError: torch.distributed not initialised, a bad mesh, a model already sharded
            or expert-parallel, no experts to split, a number of experts not divisible by
            the ep degree (naming the layer), or tensor parallelism without sequence
            parallelism.
    """
    ep, edp = _axes(ep_mesh, edp_mesh)
    _check_model(model)
    found = expert_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no experts apply_ep can split (neither "
                         f"GroupedExperts nor stacked Hugging Face experts)")
    for name, m in found:
        e = m.num_experts if not isinstance(m, GroupedExperts) else m.w1.shape[0]
        if e % ep.size:
            raise ValueError(f"{name}: num_experts={e} is not divisible by ep={ep.size}")
    for name, m in found:
        fused = not isinstance(m, GroupedExperts)
        e = m.num_experts if fused else m.w1.shape[0]
        for attr, p in list(m._parameters.items()):
            if p is not None:
                _cut(name, m, attr, ep, edp)
        m._shardwise_ep = ExpertGroup(ep, e, name)
        # compile_blocks refuses a block holding it: the all-to-alls run in the forward
        setattr(m, FORWARD_COLLECTIVES_ATTR, "expert-parallel dispatch / combine all-to-alls")
        m.__class__ = _ep_class(FusedExpertsEP if fused else GroupedExpertsEP, type(m))
        if fused:  # Hugging Face's forward routes over self.num_experts local experts
            m.num_experts = e // ep.size
    setattr(model, _CTX_ATTR, EPContext(ep, edp, tuple(n for n, _ in found)))
    return model


def ep_context(model: nn.Module) -> EPContext | None:
    """What :func:`apply_ep` recorded on ``model`` (None if it was not applied)."""
    return getattr(model, _CTX_ATTR, None)


def share_ep_context(model: nn.Module, part: nn.Module) -> None:
    """Let ``part`` (a piece of ``model`` that is run on its own, e.g. a pipeline rank's
    stages) answer :func:`ep_context` as ``model`` does. A no-op when ``model`` is not
    expert-parallel."""
    ctx = ep_context(model)
    if ctx is not None:
        setattr(part, _CTX_ATTR, ctx)
