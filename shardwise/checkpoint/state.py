"""What goes into a checkpoint and back: model and optimizer state as DTensors keyed by
parameter name, plus the JSON-side description (layout, hyper-parameters).

[Note: checkpoints of pipeline parts]
A pipeline rank holds a part of the model (:class:`~shardwise.parallel.pipeline.PipelinePart`)
whose tensors carry the unsplit model's names, so DCP writes every rank's tensors under the
whole model's keys and reads any layout back. Only the checks and the JSON side look across
ranks: the manifest's optimizer groups (and scalars) are the union of every pipeline rank's,
gathered when saving, and on load a checkpoint tensor held by another pipeline rank is neither
missing nor extra. The checkpoint of a pp 2 x dp 2 job is thus the checkpoint of the whole
model, loadable at pp 1, pp 4 or any other layout.

[Note: optimizer state by name]
``optimizer.state_dict()`` keys state by the position of a parameter in ``param_groups``,
which says nothing once the layout changes. We key it by the parameter's FQN instead:
``optim.<fqn>.<state key>``. A state tensor shaped like the parameter's local shard (Adam's
``exp_avg``, SGD's ``momentum_buffer``) is wrapped by the parameter's
:class:`~shardwise.shard.ShardedParamSpec` as the same global DTensor as the parameter, so DCP
reshards it exactly like the weights; anything else (``step``, a scalar) is stored whole
(identical on every rank; DCP keeps one copy). Stage 0 has no specs: its state is whole
anyway. The groups' hyper-parameters (lr, betas, weight_decay, ...) and the FQNs of their
members go to the manifest as JSON. On load, the targets are built from DCP's index: for every
``optim.<fqn>.<key>`` the checkpoint holds, an empty local shard (or a whole tensor) of the
saved dtype, so a fresh optimizer with no state yet can receive it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import jsonable
from shardwise.checkpoint.errors import CheckpointError
from shardwise.distributed.comm import objects as comm_objects
from shardwise.parallel.context import cp_context
from shardwise.parallel.pipeline.split import PipelinePart
from shardwise.parallel.expert import ep_context
from shardwise.parallel.tensor import tp_context
from shardwise.shard.registry import engine_states
from shardwise.sizes import nbytes

__all__ = ["param_names", "model_state", "optimizer_state", "layout_of", "model_info",
           "model_targets", "optimizer_targets", "load_optimizer", "tensor_nbytes"]


def _across_parts(model: nn.Module, value: Any) -> list[Any]:
    """``value`` of every pipeline rank holding a part of ``model`` ([Note: checkpoints of
    pipeline parts]); ``[value]`` for a whole model (collective over the pipeline group)."""
    if isinstance(model, PipelinePart) and model.groups.pp_size > 1:
        return comm_objects.all_gather_object(value, model.groups.pp,
                                              label="checkpoint.pipeline_parts")
    return [value]


def _merged_groups(model: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """Every pipeline rank's parameter names, per optimizer group (group i of the whole
    model is the union of every part's group i)."""
    parts = _across_parts(model, groups)
    if len({len(p) for p in parts}) > 1:
        raise ValueError(f"the pipeline ranks' optimizers have {[len(p) for p in parts]} "
                         f"parameter groups; every rank must build the same groups")
    return [[n for p in parts for n in p[i]] for i in range(len(groups))]


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the local tensors in a nested dict of (D)Tensors."""
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return nbytes(local)
    return 0


def _specs(model: nn.Module) -> dict:
    from shardwise.shard import sharded_param_specs

    return sharded_param_specs(model)


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of every optimizer parameter, in ``param_groups`` order (state-dict indices).

    Raises:
        ValueError: a parameter of the optimizer is not a parameter of ``model``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    if callable(getattr(optimizer, "model_params", None)):
        params = optimizer.model_params()  # offload: host masters stand in for parameters
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    out = []
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"optimizer parameter #{i} (shape {tuple(p.shape)}) is not a "
                             f"parameter of the model")
        out.append(names[id(p)])
    return out


def _is_sharded(spec, key: str, shape: torch.Size) -> bool:
    """Whether optimizer state ``key`` of shape ``shape`` is laid out like its parameter.

    For a 0-d parameter shapes cannot tell (rank 0 holds it, 0-d, as it holds ``step``), so
    the torch.optim convention decides: ``step`` is the only scalar state.
    """
    if spec is None:
        return False
    if len(spec.shape) == 0:
        return key != "step"
    return len(shape) > 0 and shape == spec.param.shape


def _wrap(spec, key: str, t: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t`` (local) as its global form: a DTensor for shard-shaped state, else whole."""
    local = t.detach().clone() if copy else t.detach()
    if _is_sharded(spec, key, t.shape):
        return spec.to_dtensor(local)  # 0-d: collective, every rank calls it in one order
    return local


def model_state(model: nn.Module, copy: bool) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (DTensors for sharded parameters), optionally copied."""
    sd = model.state_dict()
    if not copy:
        return {k: v.detach() for k, v in sd.items()}
    out = {}
    for k, v in sd.items():
        if hasattr(v, "to_local"):
            from torch.distributed.tensor import DTensor

            out[k] = DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements,
                                        run_check=False, shape=v.shape, stride=v.stride())
        else:
            out[k] = v.detach().clone()
    return out


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    copy: bool) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """The optimizer's tensors keyed by FQN and its JSON description ([Note: optimizer
    state by name]).

    Returns:
        ``({fqn: {key: tensor}}, {"class", "param_groups", "scalars"})``.
    """
    names = param_names(model, optimizer)
    specs = _specs(model)
    sd = optimizer.state_dict()
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx in sorted(sd["state"]):  # same order on every rank (0-d wraps are collective)
        fqn, spec = names[idx], specs.get(names[idx])
        for key in sorted(sd["state"][idx]):
            value = sd["state"][idx][key]
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[key] = _wrap(spec, key, value, copy)
            else:
                scalars.setdefault(fqn, {})[key] = jsonable.encode(value, f"{fqn}.{key}")
    groups = []
    members = _merged_groups(model, [[names[i] for i in g["params"]]
                                     for g in sd["param_groups"]])
    for gi, group in enumerate(sd["param_groups"]):
        hyper = {k: jsonable.encode(v, f"param_groups[{gi}].{k}")
                 for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": members[gi]})
    for part in _across_parts(model, scalars)[1:]:
        scalars.update(part)
    info = {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}
    return tensors, info


def layout_of(model: nn.Module) -> dict[str, Any]:
    """World size, ZeRO stage, data-parallel, context-parallel, tensor-parallel,
    expert-parallel and pipeline degrees of a model (``dp_shard`` without the cp ranks the
    engine also shards over)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    ctx = tp_context(model)
    tp = ctx.tp.size if ctx is not None else 1
    ep_ctx = ep_context(model)
    ep = ep_ctx.ep.size if ep_ctx is not None else 1
    cp_ctx = cp_context(model)
    cp = cp_ctx.cp if cp_ctx is not None else 1
    pp = model.groups.pp_size if isinstance(model, PipelinePart) else 1
    states = engine_states(model)
    if not states:
        return {"world_size": world, "stage": None, "dp_shard": None, "dp_replicate": None,
                "cp": cp, "tp": tp, "ep": ep, "pp": pp}
    s = states[-1]  # the outermost call (engine_states lists submodules' first)
    g = s.groups
    shard = g.shard_size // cp if g.shard_size % cp == 0 else g.shard_size
    return {"world_size": world, "stage": s.policy.zero, "dp_shard": shard,
            "dp_replicate": g.replicate_size, "cp": cp, "tp": tp, "ep": ep, "pp": pp}


def model_info(model: nn.Module) -> dict[str, Any]:
    """The model's class and, for shardwise Llama models, its full config."""
    import dataclasses

    cfg = getattr(model, "config", None)
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None
    return {"class": type(model).__name__, "config": config}


# ----------------------------------------------------------------------------- load side


def _dtype(props) -> torch.dtype:
    return props.dtype


def _check_shape(name: str, saved: torch.Size, want: torch.Size, path) -> None:
    if tuple(saved) != tuple(want):
        raise CheckpointError(f"checkpoint {path}: tensor {name} has shape {tuple(saved)}, the "
                              f"model expects {tuple(want)}: the checkpoint is from another "
                              f"model", path=path, file=".metadata", tensor=name)


def model_targets(model: nn.Module, metadata, path, strict: bool) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` checked against the checkpoint's index: same names, shapes.

    Raises:
        CheckpointError: a tensor the model has is missing from the checkpoint, has another
            shape, or (strict) the checkpoint has model tensors the model lacks.
    """
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    saved = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.")}
    whole = {k for part in _across_parts(model, sorted(sd)) for k in part}
    missing = [k for k in sd if k not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no tensor model.{missing[0]} (missing "
                              f"{len(missing)} of the model's {len(sd)} tensors, e.g. "
                              f"{missing[:3]}): it is from another model", path=path,
                              file=".metadata", tensor=f"model.{missing[0]}")
    extra = [k for k in saved if k not in whole]
    if strict and extra:
        raise CheckpointError(f"checkpoint {path} has tensors the model lacks: model.{extra[0]}"
                              f" ({len(extra)} in all, e.g. {extra[:3]}): it is from another "
                              f"model (pass strict=False to ignore them)", path=path,
                              file=".metadata", tensor=f"model.{extra[0]}")
    for k, v in sd.items():
        _check_shape(f"model.{k}", saved[k].size, v.shape, path)
    return sd


def _optim_entries(metadata) -> dict[str, dict[str, Any]]:
    """``{fqn: {key: TensorStorageMetadata}}`` of the optimizer tensors in the index."""
    out: dict[str, dict[str, Any]] = {}
    for k, md in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(k) if metadata.planner_data else None
        if path and len(path) == 3 and path[0] == "optim":
            out.setdefault(path[1], {})[path[2]] = md
    return out


def optimizer_targets(model: nn.Module, optimizer: torch.optim.Optimizer, metadata,
                      manifest: dict, path) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors to load the saved optimizer state into ([Note: optimizer state by
    name]).

    Raises:
        CheckpointError: the checkpoint's parameter groups do not match the optimizer's, or a
            state tensor's shape does not fit its parameter.
    """
    info = manifest.get("optimizer")
    if info is None:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (it was saved "
                              f"without an optimizer)", path=path, file="manifest.json")
    names = param_names(model, optimizer)
    mine, pos = [], 0
    for group in optimizer.param_groups:
        mine.append(names[pos:pos + len(group["params"])])
        pos += len(group["params"])
    mine = _merged_groups(model, mine)
    whole = {n for g in mine for n in g}
    saved = [g["params"] for g in info["param_groups"]]
    if [sorted(g) for g in saved] != [sorted(g) for g in mine]:
        diff = next((i for i, (a, b) in enumerate(zip(saved, mine)) if sorted(a) != sorted(b)),
                    min(len(saved), len(mine)))
        raise CheckpointError(f"checkpoint {path}: optimizer parameter groups differ: the "
                              f"checkpoint has {len(saved)} group(s), the optimizer "
                              f"{len(mine)}; group {diff} holds other parameters",
                              path=path, file="manifest.json")
    specs = _specs(model)
    params = dict(model.named_parameters())
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, entries in sorted(_optim_entries(metadata).items()):
        if fqn not in params and fqn in whole:
            continue  # another pipeline rank's parameter
        if fqn not in params:
            raise CheckpointError(f"checkpoint {path} has optimizer state for {fqn}, which is "
                                  f"not a parameter of the model", path=path, tensor=fqn)
        spec, param = specs.get(fqn), params[fqn]
        for key, md in sorted(entries.items()):
            targets.setdefault(fqn, {})[key] = _target(spec, param, md)
    return targets


def _target(spec, param: nn.Parameter, md) -> torch.Tensor:
    """An empty tensor to receive one saved optimizer tensor: this rank's rows of a
    parameter-shaped state (a DTensor), or the whole tensor."""
    dtype, size = _dtype(md.properties), md.size
    if spec is not None and len(size) > 0 and tuple(size) == tuple(spec.shape):
        local = torch.empty(spec.param.shape, dtype=dtype, device=param.device)
        return spec.to_dtensor(local)
    return torch.empty(size, dtype=dtype, device=param.device)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                   loaded: dict[str, dict[str, torch.Tensor]], manifest: dict) -> None:
    """Give the optimizer the loaded state and the saved hyper-parameters."""
    names = param_names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    specs = _specs(model)
    info = manifest["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for fqn, entries in loaded.items():
        spec = specs.get(fqn)
        st = state.setdefault(index[fqn], {})
        for key, value in entries.items():
            if spec is not None and (hasattr(value, "to_local") or (
                    len(spec.shape) == 0 and _is_sharded(spec, key, value.shape))):
                value = spec.to_local(value, f"optim.{fqn}.{key}")
            st[key] = value
    for fqn, entries in info.get("scalars", {}).items():
        if fqn in index:
            state.setdefault(index[fqn], {}).update(
                {k: jsonable.decode(v) for k, v in entries.items()})
    current = optimizer.state_dict()["param_groups"]
    groups, pos = [], 0
    for group, now in zip(optimizer.param_groups, current):
        members = names[pos:pos + len(group["params"])]
        # The saved group holding these parameters (a pipeline part holds some of them).
        saved = next(g["hyper"] for g in info["param_groups"] if set(members) <= set(g["params"]))
        hyper = {k: jsonable.decode(v) for k, v in saved.items()}
        groups.append({**{k: v for k, v in now.items() if k != "params"}, **hyper,
                       "params": [index[n] for n in members]})
        pos += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
