"""``shardwise.shard``: zero-redundancy data parallelism applied to a module in place.

Example (launch with ``torchrun --nproc_per_node 4 train.py``)::

    import shardwise, torch
    env = shardwise.distributed.init()
    model = shardwise.shard(model, stage=3, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for batch in loader:
        loss = loss_fn(model(batch)); loss.backward()
        shardwise.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from shardwise.distributed.env import flight_recorder_active
from shardwise.distributed.mesh import ShardGroups, resolve_groups
from shardwise.shard.build import build_replicate, build_units, plan_groups
from shardwise.shard.discover import UnitPlan, plan_units
from shardwise.shard.engine_state import ZeroPolicy
from shardwise.shard.identity import call_identity
from shardwise.shard.memory import MemoryReport, MemoryTracker, build_memory_report
from shardwise.shard.precision import MixedPrecision, cast_floating
from shardwise.shard.offload.config import Offload
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.offload import guard_unwrapped_steps
from shardwise.shard.placed import PartialGrads, record_data_axes
from shardwise.shard.registry import attach_state, engine_states, extra_trackers, is_sharded
from shardwise.shard.scaled_gather import CODES_ATTR
from shardwise.shard.skippable import resolve_skippable
from shardwise.shard.state import ShardState
from shardwise.shard.state_dict import placement_has_model_axes, register_state_dict_hooks

__all__ = ["shard", "replicate", "no_sync", "memory_report", "engine_states"]


def _validate(module, stage, prefetch, bucket_mb, materialize) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"shard expects an nn.Module, got {type(module).__name__}")
    if is_sharded(module):
        raise ValueError(f"module {type(module).__name__} is already sharded; shard it once")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    if stage == 0 and not materialize:
        raise ValueError("materialize=False (planning on the meta device) needs stage 1, 2 "
                         "or 3; stage 0 replicates whole parameters")


def _check_plans(plans: list[UnitPlan]) -> None:
    """Refuse what the engine cannot shard, naming the module and parameter."""
    meta = None
    for plan in plans:
        where = plan.name or "<root>"
        dtypes = {}
        for e in plan.entries:
            p, name = e.param, e.fqns[0]
            if not p.is_floating_point():
                raise ValueError(f"parameter {name} of unit {where} has dtype {p.dtype}; "
                                 f"only floating-point parameters can be sharded")
            dtypes.setdefault(p.dtype, name)
            if meta is None:
                meta = (p.is_meta, name)
            elif meta[0] != p.is_meta:
                raise ValueError(f"parameter {name} is {'' if p.is_meta else 'not '}on the meta "
                                 f"device but {meta[1]} is{'' if meta[0] else ' not'}: build the "
                                 f"whole model on one device")
        if len(dtypes) > 1:
            names = ", ".join(f"{n} ({d})" for d, n in dtypes.items())
            raise ValueError(f"unit {where} mixes parameter dtypes: {names}; cast the module to "
                             f"one dtype or wrap the parts in separate units")












def _validate_comm(quant, stage: int, reshard_after_forward: bool, module: nn.Module) -> None:
    if quant is None:
        return
    if not isinstance(quant, CommQuant):
        raise ValueError(f"comm must be a shardwise.CommQuant, got {type(quant).__name__}")
    if quant.enabled and stage == 0:
        raise ValueError(f"comm={quant} needs stage 1, 2 or 3: stage 0 all-reduces whole "
                         f"gradients")
    if quant.hierarchy and not (stage == 3 and reshard_after_forward):
        raise ValueError(f"comm.hierarchy={quant.hierarchy} needs stage 3 with "
                         f"reshard_after_forward=True (got stage {stage}, reshard_after_forward="
                         f"{reshard_after_forward}): only then does backward gather again")
    lent = next((n for n, m in module.named_modules() if quant.hierarchy and quant.weights
                 and getattr(getattr(m, CODES_ATTR, None), "kind", None) == quant.weights), None)
    if lent is not None:
        raise ValueError(f"comm.hierarchy={quant.hierarchy} with comm.weights={quant.weights!r}: "
                         f"module {lent!r} is gathered as {quant.weights} codes and the "
                         f"secondary partition keeps compute-dtype rows, not codes "
                         f"(shard/scaled_gather.py); use one or the other")


def _register_casts(module: nn.Module, mp: MixedPrecision) -> None:
    """Cast the sharded module's floating inputs to the compute dtype, outputs as asked."""
    if mp.cast_inputs and mp.param_dtype is not None:
        def cast_in(mod, args, kwargs):
            return cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
        module.register_forward_pre_hook(cast_in, with_kwargs=True)
    if mp.output_dtype is not None:
        module.register_forward_hook(lambda mod, args, out: cast_floating(out, mp.output_dtype))


def shard(module: nn.Module, *, stage: int = 3, wrap=None, mesh=None,
          reshard_after_forward: bool = True, prefetch: int = 1,
          init_weights: Callable[[nn.Module], None] | None = None, bucket_mb: float = 25.0,
          sync_module_states: bool = True, materialize: bool = True,
          mixed_precision: MixedPrecision | None = None, comm: CommQuant | None = None,
          offload: Offload | None = None,
          device: torch.device | str | None = None, name: str | None = None,
          skippable: Iterable[nn.Module] | None = None,
          auto_skippable: bool = True) -> nn.Module:
    """Shard ``module`` for zero-redundancy data parallelism, in place.

    Args:
        module: the model (or a submodule, before its parent is sharded).
        stage: 0 plain data parallel (gradients all-reduced in buckets during backward);
            1 optimizer state sharded; 2 gradients sharded too; 3 parameters sharded too.
            Default 3.
        wrap: module classes (a class, a set) or a predicate ``(name, module) -> bool``
            selecting the modules that become units (one all-gather and one reduce-scatter
            each); the rest forms the root unit. Default None (one unit). Ignored at stage 0.
        mesh: None (the world), a ProcessGroup, a 1-D DeviceMesh (shard) or a 2-D DeviceMesh
            (replicate, shard) for hybrid sharding, or a :class:`ParallelMesh` (or a
            DeviceMesh whose dimension names are its axis names): sharded over
            ``dp_shard``, replicated over ``dp_replicate``, the other axes (``tp``, ...)
            left to tensor, pipeline and expert parallelism.
        reshard_after_forward: stage 3 frees gathered parameters after each unit's forward
            (True, default) or keeps them until its backward (False, the ZeRO-2-like middle).
        prefetch: units gathered ahead of the one computing, forward and backward
            (default 1; 0 disables).
        init_weights: for a module built on the meta device, a callable initialising one
            module's direct parameters and buffers (default: ``module.reset_parameters()``);
            see [Note: module-by-module init].
        bucket_mb: stage-0 gradient bucket size in MiB (default 25).
        sync_module_states: broadcast the first rank's parameters and buffers so every rank
            starts identical (default True; skipped for meta-device init, which is
            deterministic).
        materialize: for a meta-device model, initialise it (True, default) or keep the
            shards on the meta device (False): nothing is allocated, ``memory_report`` still
            gives every byte this rank would hold, and the model cannot run. For planning.
        mixed_precision: a :class:`MixedPrecision` policy (default None: compute in the
            parameters' dtype). Masters and optimizer state keep the parameters' dtype.
        comm: a :class:`CommQuant` policy: int8 / fp8 weight all-gathers, int8 / int4
            gradient reduce-scatters (blockwise scales, fp32 accumulation), and a
            hierarchical secondary partition (stage 3: ``hierarchy`` ranks per node keep a
            node-sharded copy after forward so the backward all-gather stays in the node).
            Default None: full-precision collectives.
        offload: an :class:`Offload` policy (CPU or disk) for fp32 masters and optimizer
            state; its directory is checked now, before any collective. Wrap the optimizer
            with ``shardwise.offload_optimizer(opt, model=model)``; stepping an unwrapped one
            raises. Default None.
        device: where a meta-device model is materialised (default None: the CPU); a model
            with real tensors stays where it is.
        name: what this call's gathers are called by, to tell it from other calls over
            modules whose parameters are named and shaped alike ([Note: gather identity];
            default None: its parameters' names and shapes).
        skippable: submodules that some ranks may not call in a forward (a vision tower on a
            text-only micro-batch), each a unit or holding units (make it one with
            ``wrap``): a rank that skips one still takes part in its collectives, with
            zero gradients ([Note: skipped units] in skippable.py). Default None: only the
            automatic ones.
        auto_skippable: also treat as skippable what the automatic rule finds: modules
            with ``shardwise_skippable = True``, and the towers and projectors of Hugging
            Face VLMs / audio LMs (``vision_tower``, ``vision_model``, ``visual``,
            ``multi_modal_projector``, ``connector``, ... under a config with a
            ``vision_config`` / ``audio_config`` and a placeholder token; see
            ``shardwise.shard.skippable.auto_skippable``). Default True.

    Returns:
        ``module``, whose ``named_parameters()`` now yield this rank's shards.

    Raises:
        ValueError: for bad arguments, or parameters the engine cannot shard (non-float,
            mixed dtypes in one unit, a mix of meta and real tensors), naming them; data
            axes that run along the tensor-parallel ranks of ``apply_tp``; a ``skippable``
            entry that is not a submodule, or neither a unit nor holding one, naming it.
    """
    _validate(module, stage, prefetch, bucket_mb, materialize)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"mixed_precision must be a shardwise.MixedPrecision, got "
                         f"{type(mixed_precision).__name__}")
    _validate_comm(comm, stage, reshard_after_forward, module)
    if offload is not None:
        if not isinstance(offload, Offload):
            raise ValueError(f"offload must be a shardwise.Offload, got "
                             f"{type(offload).__name__}")
        offload.validate()  # the directory, before any collective
    if stage == 0:  # the same call as replicate()
        return replicate(module, mesh=mesh, wrap=wrap, bucket_mb=bucket_mb,
                         mixed_precision=mixed_precision, init_weights=init_weights,
                         sync_module_states=sync_module_states, device=device, name=name,
                         skippable=skippable, auto_skippable=auto_skippable)
    return _build(module, ZeroPolicy.from_stage(stage), wrap, mesh, reshard_after_forward,
                  prefetch, init_weights, bucket_mb, sync_module_states, materialize,
                  mixed_precision, comm, offload, device, name, (skippable, auto_skippable))


def replicate(module: nn.Module, *, mesh=None, wrap=None, bucket_mb: float = 25.0,
              mixed_precision: MixedPrecision | None = None,
              init_weights: Callable[[nn.Module], None] | None = None,
              sync_module_states: bool = True,
              device: torch.device | str | None = None, name: str | None = None,
              skippable: Iterable[nn.Module] | None = None, auto_skippable: bool = True
              ) -> nn.Module:
    """Plain data parallelism, in place: every rank keeps whole parameters, gradients are
    all-reduced during backward (``shard(module, stage=0, ...)`` is this call).

    Args:
        module: the model (or a submodule, before its parent is sharded).
        mesh: as for :func:`shard` (the ranks that hold copies; ``dp_shard`` and
            ``dp_replicate`` both replicate here).
        wrap: with a compute dtype (``mixed_precision.param_dtype``): the modules whose
            parameters are cast and reduced together, as :func:`shard`'s units; ignored
            otherwise (gradients go in buckets). Default None.
        bucket_mb: gradient bucket size in MiB, in reverse registration order with a small
            first bucket as DDP (default 25; without a compute dtype).
        mixed_precision: a :class:`MixedPrecision` policy; with a ``param_dtype`` the
            parameters are cast per unit for compute and the gradients reduced in
            ``reduce_dtype`` (default None: the parameters' dtype, buckets).
        init_weights: for a meta-device model, the initialiser of one module's direct
            tensors (default: ``reset_parameters()``).
        sync_module_states: broadcast the first rank's parameters and buffers (default True).
        device: where a meta-device model is materialised (default None: the CPU).
        name: as for :func:`shard` (default None).
        skippable, auto_skippable: as for :func:`shard` (defaults None, True); stage 0's
            buckets need nothing of a rank that skips a module, units (with a compute
            dtype) do.

    Returns:
        ``module``, whose gradients are averaged over the data-parallel ranks in backward.

    Raises:
        ValueError: bad arguments, naming them.
    """
    _validate(module, 0, 1, bucket_mb, True)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"mixed_precision must be a shardwise.MixedPrecision, got "
                         f"{type(mixed_precision).__name__}")
    return _build(module, ZeroPolicy.from_stage(0), wrap, mesh, True, 1, init_weights,
                  bucket_mb, sync_module_states, True, mixed_precision, None, None, device,
                  name, (skippable, auto_skippable))


def _build(module, policy: ZeroPolicy, wrap, mesh, reshard_after_forward: bool,
           prefetch: int, init_weights, bucket_mb: float, sync_module_states: bool,
           materialize: bool, mixed_precision, comm, offload, device,
           name: str | None, skip: tuple = (None, True)) -> nn.Module:
    """Build and attach the engine state of one ``shard`` / ``replicate`` call."""
    # Stage 0 with a compute dtype runs as units over one-rank shard groups (see
    # replicated_groups); plain stage 0 keeps DDP-style buckets.
    as_units = policy.shard_optimizer or bool(mixed_precision and mixed_precision.param_dtype)
    plans, _ = plan_units(module, wrap if as_units else None, split_data_axes=as_units)
    _check_plans(plans)
    # [Note: skipped units]: checked before any collective
    skippable = resolve_skippable(module, skip[0], [p.module for p in plans] if as_units
                                  else None, skip[1])
    target = torch.device(device) if device is not None else None
    real = next((p.device for p in module.parameters() if not p.is_meta), None)
    groups = resolve_groups(mesh, (target or real or torch.device("cpu")).type)
    if flight_recorder_active():
        warnings.warn("torch's flight recorder records every collective of this Gloo process "
                      "group (TORCH_FR_BUFFER_SIZE unset); over a long CPU run its records "
                      "fragment the heap and resident memory grows every step. Set "
                      "TORCH_FR_BUFFER_SIZE=0 before init_process_group, or initialise with "
                      "shardwise.distributed.init(), which does (docs/engine.md, 'Memory over "
                      "long runs').", stacklevel=3)
    tracker = MemoryTracker()
    # What the call is, not how many came before ([Note: gather identity])
    state_id = call_identity(name, [(e.fqns[0], tuple(e.param.shape))
                                    for p in plans for e in p.entries])
    per_unit: list[ShardGroups] = []
    if as_units:
        groups, per_unit = plan_groups(plans, groups, replicated=not policy.shard_optimizer)
    params = [e.param for p in plans for e in p.entries]
    record_data_axes(params, groups, sharded=as_units)  # [Note: placement is data]
    if not as_units:
        state = build_replicate(module, plans[0].entries, groups, bucket_mb, tracker, init_weights,
                           sync_module_states, target)
        if any(placement_has_model_axes(p) for p in params):
            register_state_dict_hooks(module, state)
    else:
        units = build_units(module, plans, groups, tracker, init_weights,
                             sync_module_states, materialize, mixed_precision, target, comm,
                             per_unit, state_id)
        # [Note: partial gradients]: of the materialised parameters (a meta-device model's
        # parameters were replaced by real ones)
        partial = PartialGrads([sp.param for u in units for sp in u.params])
        state = ShardState(module, units, groups, policy, reshard_after_forward, prefetch,
                           tracker, offload, [partial] if partial else [], skippable)
        register_state_dict_hooks(module, state)
        if mixed_precision is not None:
            _register_casts(module, mixed_precision)
    if offload is not None:
        guard_unwrapped_steps([p for m in [module] for p in m.parameters()], offload)
    attach_state(module, state)
    return module


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, with no communication, inside this context.

    Use it for every micro-batch but the last of a gradient-accumulation step; the backward
    of the last micro-batch (outside the context) reduces the accumulated gradients. Inside
    the context gradients stay unsharded on every rank (memory: one full gradient copy).
    """
    states = engine_states(model)
    if not states:
        raise ValueError(f"no_sync needs a module passed to shardwise.shard, got an unsharded "
                         f"{type(model).__name__}")
    before = [s.sync for s in states]
    for s in states:
        s.sync = False
    try:
        yield
    finally:
        for s, b in zip(states, before):
            s.sync = b


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                  ) -> MemoryReport:
    """This rank's exact bytes of parameter shards, gradient shards, optimizer state and
    unsharded / communication buffers (current and peak).

    Args:
        model: a sharded model.
        optimizer: its optimizer, to count optimizer-state bytes (default None: 0).
    """
    states = engine_states(model)
    if not states:
        raise ValueError(f"memory_report needs a module passed to shardwise.shard, got an "
                         f"unsharded {type(model).__name__}")
    trackers = [s.tracker for s in states] + extra_trackers(model)
    return build_memory_report(trackers, list(model.parameters()), optimizer)
