"""The trainer's config as a planner layout, and back: what ``--parallel.plan auto`` chooses.

    cfg = plan_start(cfg, model_cfg, world_size)   # preflight: the planner's best layout
    gcfg = plan_group(cfg, model_cfg, ranks, n0)   # one fault-tolerant replica group's
    ranked = rank_layouts(cfg, model_cfg, world_size, hw)  # the layouts the trainer can build

[Note: layouts the trainer plans] A planner :class:`~shardwise.planner.Layout` maps onto
these config keys (``PLAN_KEYS``): ``zero`` <-> ``parallel.stage``, ``dp_replicate`` /
``dp_shard`` / ``cp`` / ``tp``, ``sp`` <-> ``parallel.sequence_parallel``, ``microbatch``
<-> ``train.batch_size``, ``pp_microbatches`` <-> ``train.grad_accum``, ``ac`` <->
``train.activation_checkpoint``, ``pp`` and the ``pp_*`` keys <-> the schedule, ``ep`` <->
``parallel.ep``, ``cp_impl`` <-> ``parallel.cp_impl``. The context-parallel implementation
and load balance (``parallel.cp_impl``, fixed in the search and priced as configured;
``cp_load_balance``, priced as zigzag), the expert-parallel degree, offload and quantised
communication stay as configured (the user's choice of attention algorithm, of where experts
live, of numerics and of host memory), and so does the low-bit matmul recipe
(``precision.matmul``, priced as the planner's ``matmul_recipe``; its ``matmul_skip``
patterns are not priced: every block linear the recipe takes counts as converted); ``ep``
composes with every pipeline layout the search offers (EP x PP). The global batch
(``batch_size x grad_accum x dp_replicate x dp_shard`` sequences: cp, like tp, does not
multiply it), the sequence length, optimizer and learning-rate schedule are never changed:
only how the same batch is split. Keys the user set (``parallel.plan_fixed``) are fixed in
the search. A layout the planner ranks is kept only if the trainer's own checks accept it
(heads, vocabulary and widths divisible by tp, sequence parallelism and the cp chunks
dividing the sequence, the cp implementation fitting the key/value heads, checkpointing of
dense models).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.cost_model import CostModel, Estimate
from shardwise.planner.hardware import get_hardware
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.search import search
from shardwise.planner.workload import Workload
from shardwise.train.config import Config, resolve_world, validate
from shardwise.train.config.checks import (PLAN_KEYS, check_model_combinations,
                                           check_sequence_split, sequence_parallel)
from shardwise.train.context import validate_cp
from shardwise.train.parallelize import validate_ep, validate_tp
from shardwise.train.pipeline import (check_pipeline_config, check_pipeline_model,
                                      pipeline_world, resolve_microbatches)
from shardwise.parallel.pipeline import schedule_spec
from shardwise.parallel.pipeline.schedules import resolve_virtual

__all__ = ["layout_of", "with_layout", "planner_inputs", "plan_constraints", "rank_layouts",
           "plan_start", "plan_group", "describe", "trainer_keys", "estimate"]

_TOP = 12  # ranked layouts the trainer considers (beyond: none was ever faster here)


def layout_of(cfg: Config) -> Layout:
    """The resolved config's layout (``parallel.dp_shard`` already resolved). With a
    pipeline, ``train.batch_size`` is split into the schedule's micro-batches; without, the
    micro-batches are ``train.grad_accum`` micro-batches of ``batch_size``."""
    par, t = cfg.parallel, cfg.train
    common = dict(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp, tp=par.tp,
                  ep=par.ep, zero=par.stage, ac=t.activation_checkpoint,
                  sp=sequence_parallel(par) and par.tp > 1,
                  offload="cpu" if cfg.offload.device == "cpu" else "none",
                  comm_weights=cfg.comm.weights, comm_grads=cfg.comm.grads,
                  cp_impl=par.cp_impl)
    if par.pp == 1:
        return Layout(microbatch=t.batch_size, pp_microbatches=t.grad_accum, **common)
    m = resolve_microbatches(cfg)
    v = resolve_virtual(schedule_spec(par.pp_schedule), par.pp_virtual)
    return Layout(pp=par.pp, pp_schedule=par.pp_schedule, pp_virtual=v,
                  microbatch=max(1, t.batch_size // m), pp_microbatches=m, **common)


def with_layout(cfg: Config, L: Layout) -> Config:
    """``cfg`` with the layout keys of ``L`` (the other keys unchanged)."""
    par = dataclasses.replace(cfg.parallel, stage=L.zero, dp_replicate=L.dp_replicate,
                              dp_shard=L.dp_shard, cp=L.cp, tp=L.tp, ep=L.ep,
                              sequence_parallel=L.sp if L.tp > 1 else None, pp=L.pp,
                              cp_impl=L.cp_impl)
    if L.pp > 1:  # the schedule's micro-batches are the accumulation
        par = dataclasses.replace(par, pp_schedule=L.pp_schedule,
                                  pp_microbatches=L.pp_microbatches, pp_virtual=L.pp_virtual)
        batch, accum = L.microbatch * L.pp_microbatches, 1
    else:
        par = dataclasses.replace(par, pp_microbatches=0, pp_virtual=0,
                                  pp_layers_per_stage=())
        batch, accum = L.microbatch, L.pp_microbatches
    train = dataclasses.replace(cfg.train, batch_size=batch, grad_accum=accum,
                                activation_checkpoint=L.ac)
    return dataclasses.replace(cfg, parallel=par, train=train)


def trainer_keys(L: Layout) -> dict[str, Any]:
    """The layout as the config keys it sets (for plan_history.jsonl)."""
    out = {"parallel.stage": L.zero, "parallel.dp_replicate": L.dp_replicate,
           "parallel.dp_shard": L.dp_shard, "parallel.cp": L.cp, "parallel.tp": L.tp,
           "parallel.sequence_parallel": L.sp, "parallel.pp": L.pp, "parallel.ep": L.ep,
           "parallel.cp_impl": L.cp_impl}
    if L.pp > 1:
        out.update({"parallel.pp_schedule": L.pp_schedule,
                    "parallel.pp_microbatches": L.pp_microbatches,
                    "parallel.pp_virtual": L.pp_virtual,
                    "train.batch_size": L.microbatch * L.pp_microbatches,
                    "train.grad_accum": 1})
    else:
        out.update({"train.batch_size": L.microbatch, "train.grad_accum": L.pp_microbatches})
    out["train.activation_checkpoint"] = L.ac
    return out


def describe(L: Layout) -> str:
    """A layout in a few words: ``"tp 2 (sp) x dp_shard 1, stage 0, batch 8 x 1, ac none"``."""
    parts = [f"pp {L.pp} ({L.pp_schedule})"] if L.pp > 1 else []
    parts += [f"tp {L.tp}" + (" (sp)" if L.sp else "")] if L.tp > 1 else []
    parts += [f"cp {L.cp} ({L.cp_impl})"] if L.cp > 1 else []
    if L.dp_replicate > 1:
        parts.append(f"dp_replicate {L.dp_replicate}")
    parts.append(f"dp_shard {L.dp_shard}" + (f" (ep {L.ep})" if L.ep > 1 else ""))
    return (" x ".join(parts) + f", stage {L.zero}, batch {L.microbatch} x "
            f"{L.pp_microbatches}, ac {L.ac}")


def planner_inputs(cfg: Config, model_cfg: Any, hw=None):
    """(ModelSpec, Hardware, Workload) of the run, as the planner prices it.

    Args:
        hw: the device (default: ``parallel.plan_hardware`` from the catalogue).

    Raises:
        ValueError: ``parallel.plan_hardware`` unknown, or ``local`` without a calibration
            (naming the command that writes one).
    """
    par = cfg.parallel
    if hw is None:
        try:
            hw = get_hardware(par.plan_hardware, calibration=par.plan_calibration or None)
        except ValueError as exc:
            raise ValueError(f"parallel.plan='auto': {exc}") from None
    L = layout_of(cfg)
    matmul = cfg.precision.matmul  # the trainer's "bf16": no low-bit matmuls
    wl = Workload(seq_len=cfg.data.seq_len,
                  global_batch=L.dp * L.microbatch * L.pp_microbatches,
                  compute_dtype=cfg.precision.param_dtype, param_dtype="fp32",
                  matmul_recipe="none" if matmul == "bf16" else matmul,
                  optimizer="adamw", prefetch=par.prefetch,
                  reshard_after_forward=par.reshard_after_forward)
    return from_llama_config(model_cfg, cfg.model.name), hw, wl


def plan_constraints(cfg: Config) -> dict[str, Any]:
    """The planner's fixed keys: what the trainer cannot build or must not change, plus the
    layout keys the user set (``parallel.plan_fixed``)."""
    L = layout_of(cfg)
    fixed: dict[str, Any] = {"ep": L.ep, "offload": L.offload, "cp_impl": L.cp_impl,
                             "comm_weights": L.comm_weights, "comm_grads": L.comm_grads}
    if cfg.model.num_experts or cfg.train.compile:
        fixed["ac"] = L.ac  # checkpointing is refused with experts; compile keeps its graphs
    if cfg.parallel.pp_layers_per_stage:
        fixed["pp"] = L.pp  # a hand-made split belongs to its degree
    # Keys that are one layout field each prune the search; every fixed key is also
    # checked on the resulting config (_keeps_fixed), which covers the batch split.
    names = {"parallel.stage": "zero", "parallel.dp_replicate": "dp_replicate",
             "parallel.dp_shard": "dp_shard", "parallel.cp": "cp", "parallel.tp": "tp",
             "parallel.sequence_parallel": "sp", "parallel.pp": "pp",
             "train.activation_checkpoint": "ac"}
    for key in cfg.parallel.plan_fixed:
        if key in names:
            fixed[names[key]] = getattr(L, names[key])
    return fixed


def _value(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _keeps_fixed(cfg: Config, new: Config) -> bool:
    """Whether ``new`` keeps every ``parallel.plan_fixed`` key of ``cfg`` (sequence
    parallelism aside: unset and false both mean off without tp, the search fixed it)."""
    return all(_value(new, k) == _value(cfg, k) for k in cfg.parallel.plan_fixed
               if k != "parallel.sequence_parallel")


def _buildable(cfg: Config, model_cfg: Any, world_size: int) -> bool:
    """Whether the trainer's own checks accept ``cfg`` (see [Note: layouts the trainer
    plans])."""
    if cfg.parallel.tp > 1 and cfg.parallel.stage == 0:
        # Stage-0 replicas under tensor parallelism keep tp-local tensors in state_dict, so
        # their checkpoints cannot be resumed in another layout: a switch needs that.
        return False
    try:
        validate(cfg)
        check_sequence_split(resolve_world(cfg, world_size))
        check_model_combinations(cfg, model_cfg)
        check_pipeline_config(cfg)
        check_pipeline_model(cfg, model_cfg)
        pipeline_world(cfg, world_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tp across nodes: a warning, said at launch
            validate_tp(cfg, model_cfg, world_size)
        validate_ep(cfg, model_cfg)
        validate_cp(cfg, model_cfg)
    except ValueError:
        return False
    return True


def rank_layouts(cfg: Config, model_cfg: Any, world_size: int, hw=None) -> list[Estimate]:
    """The fitting layouts the trainer can build for this run, fastest first.

    Args:
        cfg: the resolved config (its layout fixes the global batch).
        model_cfg: the model's LlamaConfig (vocabulary included).
        world_size: ranks of the job.
        hw: the device to price on (default: ``parallel.plan_hardware``).

    Returns:
        Estimates (at most 12); empty when nothing fits the constraints.
    """
    spec, hw, wl = planner_inputs(cfg, model_cfg, hw)
    result = search(spec, hw, wl, world_size, plan_constraints(cfg),
                    top=_TOP, exact=True)
    out = []
    for est in result.ranked:
        if len(out) >= _TOP or not est.fits:
            break
        new = with_layout(cfg, est.layout)
        if _keeps_fixed(cfg, new) and _buildable(new, model_cfg, world_size):
            out.append(est)
    return out


def estimate(cfg: Config, model_cfg: Any, world_size: int, L: Layout, hw=None) -> Estimate:
    """The planner's estimate of one layout of this run (default device: the config's)."""
    spec, hw, wl = planner_inputs(cfg, model_cfg, hw)
    return CostModel(spec, hw, wl).estimate(L)


def plan_start(cfg: Config, model_cfg: Any, world_size: int) -> Config:
    """The config with the planner's best layout (``parallel.plan = "auto"``); unchanged
    with ``plan = "off"``.

    Args:
        cfg: the config, world-resolved.
        model_cfg: the model (with the tokenizer's vocabulary).
        world_size: ranks of the job.

    Returns:
        The config to train with.

    Raises:
        ValueError: no calibration for ``local``, or no layout the trainer can build fits
            the constraints and the device's memory (naming the fixed keys).
    """
    if cfg.parallel.plan != "auto":
        return cfg
    ranked = rank_layouts(cfg, model_cfg, world_size)
    if not ranked:
        fixed = ", ".join(cfg.parallel.plan_fixed) or "none"
        L = layout_of(cfg)
        batch = L.dp * L.microbatch * L.pp_microbatches
        raise ValueError(f"parallel.plan='auto': no layout of {world_size} ranks fits "
                         f"{cfg.parallel.plan_hardware!r} memory with the fixed keys ({fixed}) "
                         f"and a global batch of {batch} sequences; expected fewer fixed keys "
                         f"(parallel.plan_fixed) or parallel.plan='off'")
    return with_layout(cfg, ranked[0].layout)


#: What a fault-tolerant replica group's layout keeps: one replica sharded over the group's
#: ranks, no tensor, context or pipeline parallelism (offload, experts and compile stay as
#: configured, and fault tolerance refuses them).
_GROUP_FIXED = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.tp",
                "parallel.pp")


def plan_group(cfg: Config, model_cfg: Any, ranks: int, n0: int) -> Config:
    """The config one fault-tolerant replica group of ``ranks`` ranks trains with, ``n0``
    being its original size: one replica sharded over its ranks, with the group's tokens per
    step fixed at ``n0 x batch_size x grad_accum`` sequences (each rank accumulates
    ``n0 / ranks`` times the configured micro-batches:
    [Note: a resized group trains the same data] in shardwise/train/fault_tolerant/resize.py).
    With ``parallel.plan = "auto"`` the planner chooses the ZeRO stage, activation
    checkpointing and micro-batch size with its accumulation for these ranks, once (the live
    re-planner is not used under fault tolerance).

    Raises:
        ValueError: ``ranks`` not dividing ``n0``; or, planning, no layout fits (named).
    """
    if ranks < 1 or n0 % ranks:
        raise ValueError(f"a replica group of {ranks} ranks must divide its original size "
                         f"n0={n0}")
    par = dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=ranks)
    train = dataclasses.replace(cfg.train, grad_accum=cfg.train.grad_accum * (n0 // ranks))
    gcfg = dataclasses.replace(cfg, parallel=par, train=train)
    if par.plan != "auto":
        return gcfg
    fixed = tuple(k for k in PLAN_KEYS if k in _GROUP_FIXED or k in par.plan_fixed)
    gcfg = dataclasses.replace(gcfg, parallel=dataclasses.replace(par, plan_fixed=fixed))
    return plan_start(gcfg, model_cfg, ranks)
