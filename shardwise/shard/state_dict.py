"""State dicts of sharded modules: DTensors for ``torch.distributed.checkpoint``, full tensors
for export.

``module.state_dict()`` returns, for every sharded parameter, a DTensor whose local tensor is
this rank's shard (``Shard(0)`` over the shard axis, ``Replicate()`` over the replicate axis
of a hybrid mesh); DCP saves it and reshards it on load to any other layout.
``module.load_state_dict()`` accepts such DTensors (any layout) or plain full tensors and
keeps only this rank's rows. 0-d parameters, which cannot be split along dim 0, appear as
plain tensors (the same value on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.distributed import comm

__all__ = ["register_state_dict_hooks", "full_state_dict"]


def _placements(state):
    return (Replicate(), Shard(0)) if state.groups.device_mesh.ndim == 2 else (Shard(0),)


def _scalar_value(state, u, i) -> torch.Tensor:
    value = u.shard_views[i].detach().reshape(-1)[:1].clone()
    if value.numel() == 0:
        value = torch.zeros(1, dtype=u.dtype, device=u.device)
    if state.groups.shard_size > 1:
        comm.broadcast(value, dist.get_global_rank(state.groups.shard, 0), state.groups.shard,
                       label="state_dict.scalar")
    return value.view(())


def _to_dtensors(state, module, sd, prefix, local_metadata) -> None:
    mesh = state.groups.device_mesh
    for u in state.units:
        for i, (e, p) in enumerate(zip(u.entries, u.layout.params)):
            keys = [prefix + f for f in e.fqns if prefix + f in sd]
            if not keys:
                continue
            if len(p.shape) == 0:
                value = _scalar_value(state, u, i)
            elif mesh is None:
                value = u.shard_views[i].detach()
            else:
                value = DTensor.from_local(u.shard_views[i].detach(), mesh, _placements(state),
                                           run_check=False, shape=p.shape,
                                           stride=torch.empty(p.shape, device="meta").stride())
            for k in keys:
                sd[k] = value


def _local_rows(state, u, i, key, value, error_msgs) -> torch.Tensor | None:
    p, r = u.layout.params[i], state.groups.shard_rank
    if isinstance(value, DTensor):
        same = (value.device_mesh == state.groups.device_mesh
                and tuple(value.placements) == _placements(state))
        if same and value.shape == p.shape:
            return value.to_local()
        value = value.full_tensor()
    if value.shape != p.shape:
        error_msgs.append(f"size mismatch for {key}: the checkpoint has shape "
                          f"{tuple(value.shape)}, the model expects {tuple(p.shape)}")
        return None
    if len(p.shape) == 0:
        return value if r == 0 else value.reshape(1)[:0]
    return value[p.row_offset(r):p.row_offset(r) + p.local_rows(r)]


def _from_dtensors(state, module, sd, prefix, local_metadata, strict, missing, unexpected,
                   error_msgs) -> None:
    for u in state.units:
        for i, e in enumerate(u.entries):
            for f in e.fqns:
                k = prefix + f
                if k in sd:
                    local = _local_rows(state, u, i, k, sd[k], error_msgs)
                    if local is not None:
                        sd[k] = local


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
            .to("cpu", copy=True) for p in lay.params]


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict as CPU tensors (collective: call on every rank).

    Gathers one unit at a time, so the transient memory is one unit's parameters.

    Args:
        model: a model with sharded parts (unsharded models work too).
        rank0_only: return the dict on rank 0 only (others get ``{}``); default False.

    Returns:
        ``{name: tensor}`` with the keys of ``model.state_dict()``.
    """
    from shardwise.shard.api import engine_states  # local: api imports this module

    paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    gathered: dict[str, torch.Tensor] = {}
    for state in engine_states(model):
        base = paths[id(state.module)]
        for u in getattr(state, "units", []):
            fulls = _gather_unit(u, f"{u.label}.full_state_dict")
            for e, t in zip(u.entries, fulls):
                for f in e.fqns:
                    gathered[f"{base}.{f}" if base else f] = t
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
