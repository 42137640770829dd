"""State dicts of sharded modules: DTensors for ``torch.distributed.checkpoint``, full tensors
for export.

``module.state_dict()`` returns, for every sharded parameter, a DTensor of the parameter's
global (unsplit) shape whose local tensor is this rank's shard, over the axes its
:class:`~shardwise.distributed.placement.Placement` names ([Note: placement is data]):
``Shard(d)`` for each split (tensor-parallel ones, then ``Shard(0)`` over ``dp_shard``),
``Replicate()`` for each axis holding copies (``dp_replicate``, the tensor ranks of a norm
weight, the ranks sharing a KV head); DCP saves it (each copy once) and reshards it on load
to any other layout. ``module.load_state_dict()`` accepts such DTensors (any layout) or
plain full tensors and keeps only this rank's piece. 0-d parameters, which cannot be split
along dim 0, appear as plain tensors (the same value on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.distributed import comm
from shardwise.distributed.comm import dims as comm_dims
from shardwise.distributed.parallel_dims import product_mesh
from shardwise.distributed.placement import Placement, placement_of
from shardwise.shard.registry import engine_states

__all__ = ["ShardedParamSpec", "sharded_param_specs", "register_state_dict_hooks",
           "full_state_dict", "placement_has_model_axes", "gather_model_pieces"]


def placement_has_model_axes(param: nn.Parameter) -> bool:
    """Whether tensor (or another model) parallelism laid ``param`` out."""
    pl = placement_of(param)
    return pl is not None and any(a.size > 1 for a in pl.model_axes())


@dataclass
class ShardedParamSpec:
    """How one sharded parameter (and any tensor shaped like its shard, e.g. optimizer
    state) maps between this rank's local rows and the global tensor.

    Attributes:
        param: the sharded ``nn.Parameter`` (what the optimizer sees).
        shape: the global shape.
        mesh: the DeviceMesh of the DTensor form (None without torch.distributed).
        placements: ``(Shard(0),)`` or ``(Replicate(), Shard(0))`` on a hybrid mesh.
        row_offset, local_rows: this rank's rows of dim 0 of its model piece.
        shard_group: the data group the rows are split over.
        placement: the parameter's record (None: a whole tensor split by rows only).
    """

    param: nn.Parameter
    shape: torch.Size
    mesh: object
    placements: tuple
    row_offset: int
    local_rows: int
    shard_group: object = None
    placement: Placement | None = None

    def to_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """Wrap a tensor shaped like this rank's shard as the global DTensor (collective for
        0-d parameters, which become a plain tensor holding the first rank's value)."""
        if len(self.shape) == 0:
            value = local.detach().reshape(-1)[:1].clone()
            if value.numel() == 0:
                value = torch.zeros(1, dtype=local.dtype, device=local.device)
            if comm.group_size(self.shard_group) > 1:
                comm.broadcast(value, dist.get_global_rank(self.shard_group, 0),
                               self.shard_group, label="state_dict.scalar")
            return value.view(())
        if self.mesh is None:
            return local.detach()
        return DTensor.from_local(local.detach(), self.mesh, self.placements, run_check=False,
                                  shape=self.shape,
                                  stride=torch.empty(self.shape, device="meta").stride())

    def to_local(self, value: torch.Tensor, key: str = "") -> torch.Tensor:
        """This rank's rows of ``value`` (a DTensor of any layout, or a full tensor).

        Raises:
            ValueError: when ``value``'s global shape is not this parameter's.
        """
        if isinstance(value, DTensor):
            if (value.device_mesh == self.mesh and tuple(value.placements) == self.placements
                    and value.shape == self.shape):
                return value.to_local()
            value = value.full_tensor()
        if value.shape != self.shape:
            raise ValueError(f"size mismatch for {key}: the checkpoint has shape "
                             f"{tuple(value.shape)}, the model expects {tuple(self.shape)}")
        if len(self.shape) == 0:
            return value if self.row_offset == 0 else value.reshape(1)[:0]
        if self.placement is not None:
            value = self.placement.model_piece(value)
        return value[self.row_offset:self.row_offset + self.local_rows]


def _layout(state, pl: Placement, device_type: str) -> tuple[object, tuple]:
    """The DTensor mesh and placements of a parameter laid out as ``pl``: one mesh dimension
    per axis of more than one rank (copies first, then splits in nesting order), built once
    per state from the existing groups."""
    axes = [a for a in pl.axes if a.size > 1 and a.group is not None]
    if not axes:
        axes = [a for a in pl.axes if a.group is not None][-1:]
    if not axes:
        return None, ()
    cache = state.meshes
    key = (device_type, tuple((a.name, a.ranks) for a in axes))
    if key not in cache:
        cache[key] = product_mesh(device_type, tuple(a.name for a in axes),
                                  [list(a.ranks) for a in axes], [a.group for a in axes])
    split = {id(a): d for d, a in pl.splits}
    return cache[key], tuple(Shard(split[id(a)]) if id(a) in split else Replicate()
                             for a in axes)


def _spec(state, param: nn.Parameter, row_offset: int, local_rows: int,
          shard_group) -> ShardedParamSpec:
    pl = placement_of(param)
    mesh, placements = _layout(state, pl, param.device.type)
    return ShardedParamSpec(param, pl.shape, mesh, placements, row_offset, local_rows,
                            shard_group, pl)


def _specs_of_state(state) -> list[tuple[list[str], ShardedParamSpec]]:
    # Whole copies (stage 0 in buckets) are DTensors only when model-parallel.
    return [(r.fqns, _spec(state, r.param, r.row_offset, r.local_rows, r.shard_group))
            for r in state.param_rows()
            if not r.whole or placement_has_model_axes(r.param)]


def sharded_param_specs(model: nn.Module) -> dict[str, ShardedParamSpec]:
    """Every sharded parameter of ``model`` by its name in ``model.named_parameters()`` (tied
    parameters appear under each of their names)."""

    paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out: dict[str, ShardedParamSpec] = {}
    for state in engine_states(model):
        base = paths[id(state.module)]
        for fqns, spec in _specs_of_state(state):
            for f in fqns:
                out[f"{base}.{f}" if base else f] = spec
    return out


def _to_dtensors(state, module, sd, prefix, local_metadata) -> None:
    for fqns, spec in _specs_of_state(state):
        keys = [prefix + f for f in fqns if prefix + f in sd]
        if keys:
            value = spec.to_dtensor(spec.param)
            for k in keys:
                sd[k] = value


def _from_dtensors(state, module, sd, prefix, local_metadata, strict, missing, unexpected,
                   error_msgs) -> None:
    for fqns, spec in _specs_of_state(state):
        for f in fqns:
            k = prefix + f
            if k in sd:
                try:
                    sd[k] = spec.to_local(sd[k], k)
                except ValueError as exc:
                    error_msgs.append(str(exc))


def register_state_dict_hooks(module: nn.Module, state) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict()`` speak DTensors (see module doc)."""
    module.register_state_dict_post_hook(
        lambda m, sd, prefix, meta: _to_dtensors(state, m, sd, prefix, meta))
    module.register_load_state_dict_pre_hook(
        lambda *a: _from_dtensors(state, *a))
    module.register_load_state_dict_post_hook(lambda m, incompatible: state.mark_stale())


def _gather_unit(u, label: str) -> list[torch.Tensor]:
    lay, n = u.layout, u.layout.world
    tmp = torch.empty(lay.full_numel, dtype=u.dtype, device=u.device)
    comm.all_gather_into_tensor(tmp, u.shard_buf, u.groups.gather, label=label)
    g = tmp.view(n, lay.shard_numel)
    return [g[:, p.offset:p.offset + p.padded_numel].reshape(-1)[:p.numel].view(p.shape)
            for p in lay.params]


def gather_model_pieces(t: torch.Tensor, placement: Placement | None,
                        label: str = "tp_full_state_dict") -> torch.Tensor:
    """The global tensor from this rank's model piece ``t`` (collective over the model
    axes that split it, innermost first; axes holding copies, like the ranks sharing a KV
    head, are not gathered, so every element appears once)."""
    if placement is None:
        return t
    for dim, axis in reversed([(d, a) for d, a in placement.splits if not a.is_data]):
        t = comm_dims.all_gather_dim(t, dim, axis.group, label=f"{axis.name}.{label}")
    return t


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict as CPU tensors (collective: call on every rank).

    Every parameter appears with its original name and global shape: data-parallel shards
    are gathered one unit at a time, then tensor-parallel pieces one tensor at a time (KV
    heads copied over several tensor ranks appear once), so the transient memory is one
    unit's parameters plus one global tensor.

    Args:
        model: a model with sharded parts (unsharded models work too).
        rank0_only: return the dict on rank 0 only (others get ``{}``); default False.

    Returns:
        ``{name: tensor}`` with the keys of ``model.state_dict()``.
    """

    paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    gathered: dict[str, torch.Tensor] = {}
    for state in engine_states(model):
        base = paths[id(state.module)]
        for u in state.units:
            fulls = _gather_unit(u, f"{u.label}.full_state_dict")
            for sp, t in zip(u.params, fulls):
                t = gather_model_pieces(t, placement_of(sp.param)).to("cpu", copy=True)
                for f in sp.fqns:
                    gathered[f"{base}.{f}" if base else f] = t
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in gathered and placement_has_model_axes(p):
            gathered[name] = gather_model_pieces(p.detach(), placement_of(p)).to("cpu",
                                                                                   copy=True)
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if k in gathered:
            out[k] = gathered[k]
        else:
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[k] = v.detach().to("cpu", copy=True)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out
