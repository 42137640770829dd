"""The trainer's pipeline parallelism: ``--parallel.pp N`` and the ``pp_*`` keys.

    shardwise train --parallel.nproc 4 --parallel.pp 2 --parallel.pp_schedule zb1 \\
        --parallel.pp_microbatches 4

    shardwise train --parallel.nproc 4 --parallel.pp 2 --parallel.tp 2   # pp x tp

    shardwise train --parallel.nproc 4 --parallel.pp 2 --parallel.ep 2 \\
        --model.name debug-moe                                           # MoE, EP x PP

    shardwise train --parallel.nproc 4 --parallel.pp 2 --parallel.cp 2   # pp x cp

    shardwise train --config configs/vla.toml --parallel.nproc 2 --parallel.pp 2   # a VLA

Any model that declares its pieces (``pipeline_pieces()``: the Transformer, the
vision-language-action model, whose batches shardwise/train/vla_pipeline.py cuts into
micro-batches) is built the same way.

Checks that refuse a pipeline before any rank starts, the world split into pipeline, data,
context and tensor ranks (one ParallelMesh: pp outermost, tp innermost, ep carved out of
each stage's data x cp ranks), the pipelined model (built on the meta device,
tensor-parallel over the mesh's tp axis, expert-parallel over its ep axis,
context-parallel over its cp axis, split, each piece sharded with the run's ZeRO stage over
its stage's data x cp ranks, experts over ``edp``, initialised with the unsplit model's
numbers, MoE balance statistics over the stage's data x cp ranks), and what the loop needs
from it: the step, validation, the global gradient norm and the data-parallel rank that
picks the batch. Under context parallelism the stages run on each cp rank's part of the
sequences: the loop shards the batch before the schedule, and every stage's RoPE tables
are at the part's global positions (the model's ``RotaryEmbedding``, shared by the
stages, carries the layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from shardwise.distributed.parallel_dims import ParallelDims
from shardwise.parallel.context import apply_cp, share_cp_context
from shardwise.parallel.expert import apply_ep
from shardwise.parallel.lowbit import share_low_precision_report
from shardwise.parallel.pipeline import (PipelineExecutor, PipelinePart, build_schedule,
                                         pipeline_grad_norm, schedule_spec, shard_stages,
                                         split_stages, stage_layer_counts)
from shardwise.parallel.pipeline.schedules import (TARGET_BUBBLE, default_microbatches,
                                                   expected_bubble, resolve_virtual)
from shardwise.parallel.tensor import apply_tp
from shardwise.shard.grad import get_total_norm
from shardwise.train.config.checks import sequence_parallel
from shardwise.train.lowbit import apply_matmul_precision
from shardwise.train.moe import apply_moe

__all__ = ["check_pipeline_config", "pipeline_world", "resolve_microbatches", "bubble_warning",
           "check_pipeline_model", "build_pipeline_model", "pipeline_of", "grad_norm",
           "describe_pipeline"]


SPLIT_BACKWARD = ("zb1", "zbv", "dualpipev")
"""Schedules whose backward is split into input- and weight-gradient passes."""


def check_pipeline_config(cfg: Any) -> None:
    """The pipeline keys on their own and with the rest of the config (no model, no world).

    Raises:
        ValueError: naming the key: an unknown schedule (with the closest name), a virtual
            the schedule cannot run, micro-batches below the schedule's need or not dividing
            ``train.batch_size``, or a feature pipelines do not run with yet.
    """
    par = cfg.parallel
    if par.pp == 1:
        return
    try:
        spec = schedule_spec(par.pp_schedule)
        resolve_virtual(spec, par.pp_virtual)
    except ValueError as exc:
        key = "parallel.pp_virtual" if "virtual" in str(exc) else "parallel.pp_schedule"
        raise ValueError(f"{key}: {exc}") from None
    m = resolve_microbatches(cfg)
    need = spec.min_microbatches(par.pp)
    if m < need:
        raise ValueError(f"parallel.pp_microbatches={m}: schedule {par.pp_schedule!r} at "
                         f"parallel.pp={par.pp} needs at least {need} micro-batches")
    if cfg.train.batch_size % m:
        raise ValueError(f"parallel.pp_microbatches={m} must divide train.batch_size="
                         f"{cfg.train.batch_size} (the sequences each data-parallel rank "
                         f"splits into micro-batches)")
    unsupported = [
        (cfg.train.grad_accum != 1, f"train.grad_accum={cfg.train.grad_accum} (the pipeline's "
                                    "micro-batches are the accumulation: set grad_accum 1)"),
        (cfg.precision.param_dtype == "fp16", "precision.param_dtype='fp16' (use bf16)"),
        (cfg.offload.device != "none", f"offload.device={cfg.offload.device!r}"),
        (bool(cfg.checkpoint.import_safetensors), "checkpoint.import_safetensors"),
        # The split-backward schedules run two backward passes through a block (input
        # gradients, then weight gradients); torch's selective checkpoint allows one
        # ("Trying to backward an extra time", found by bench/planner_choice.py).
        (cfg.train.activation_checkpoint == "selective" and par.pp_schedule in SPLIT_BACKWARD,
         f"train.activation_checkpoint='selective' under parallel.pp_schedule="
         f"{par.pp_schedule!r} (split backward: use 'full', or a schedule without W passes)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"parallel.pp={par.pp} does not run with {what} yet")


def resolve_microbatches(cfg: Any) -> int:
    """``parallel.pp_microbatches``, 0 replaced by the default chosen for throughput
    (:func:`~shardwise.parallel.pipeline.schedules.default_microbatches`: the fewest, at
    least pp x virtual and dividing ``train.batch_size``, that leave at most a quarter of the
    ranks' time idle)."""
    par = cfg.parallel
    if par.pp_microbatches:
        return par.pp_microbatches
    return default_microbatches(par.pp_schedule, par.pp, cfg.train.batch_size, par.pp_virtual)


_IDLE_WARNING = 1 / 3
"""A pipeline expected to idle more than this share of its ranks' time is warned about."""


def bubble_warning(cfg: Any) -> str | None:
    """A warning when the run's micro-batches leave the pipeline mostly idle (more than a
    third of the ranks' time, simulated with unit costs), naming the expected bubble and
    what would bring it under a quarter; None otherwise (and for pp 1)."""
    par = cfg.parallel
    if par.pp == 1:
        return None
    m = resolve_microbatches(cfg)
    bubble = expected_bubble(par.pp_schedule, par.pp, m, par.pp_virtual)
    if bubble <= _IDLE_WARNING:
        return None
    batch = cfg.train.batch_size
    here = default_microbatches(par.pp_schedule, par.pp, batch, par.pp_virtual)
    if here != m and expected_bubble(par.pp_schedule, par.pp, here, par.pp_virtual) < bubble:
        how = (f"; parallel.pp_microbatches={here} (micro-batches of {batch // here} "
               f"sequence{'s' if batch // here > 1 else ''}) would idle "
               f"{expected_bubble(par.pp_schedule, par.pp, here, par.pp_virtual):.0%}")
    else:
        bigger = next((k * batch for k in (2, 4, 8, 16, 32) if expected_bubble(
            par.pp_schedule, par.pp, default_microbatches(par.pp_schedule, par.pp, k * batch,
                                                          par.pp_virtual),
            par.pp_virtual) <= TARGET_BUBBLE), None)
        how = (f"; more micro-batches shrink it: with train.batch_size={bigger} the default "
               f"micro-batches idle at most {TARGET_BUBBLE:.0%}" if bigger else "")
    who = "parallel.pp_microbatches" if par.pp_microbatches else "the default"
    return (f"pipeline: {m} micro-batch{'es' if m > 1 else ''} of schedule "
            f"{par.pp_schedule!r} at pp {par.pp} ({who}) leave{'s' if m == 1 else ''} an "
            f"expected {bubble:.0%} of "
            f"the ranks' time idle (the bubble, simulated with unit costs){how}")


def pipeline_world(cfg: Any, world_size: int) -> int:
    """The data-parallel world: ``world_size / parallel.pp``.

    Raises:
        ValueError: ``parallel.pp`` does not divide the world size.
    """
    pp = cfg.parallel.pp
    if world_size % pp:
        raise ValueError(f"parallel.pp={pp} must divide the world size {world_size} (pp x "
                         f"dp_replicate x dp_shard x cp x tp ranks)")
    return world_size // pp


def _layout(cfg: Any) -> tuple[int, int, tuple[int, ...] | None]:
    par = cfg.parallel
    v = resolve_virtual(schedule_spec(par.pp_schedule), par.pp_virtual)
    return par.pp, v, tuple(par.pp_layers_per_stage) or None


def check_pipeline_model(cfg: Any, model_cfg: Any) -> None:
    """The split against the model's shape, before any rank starts.

    Raises:
        ValueError: fewer layers than pp x virtual stages, or a ``pp_layers_per_stage`` list
            of the wrong length or sum (naming the values).
    """
    if cfg.parallel.pp == 1:
        if cfg.parallel.pp_layers_per_stage:
            raise ValueError(f"parallel.pp_layers_per_stage="
                             f"{list(cfg.parallel.pp_layers_per_stage)} needs parallel.pp > 1")
        return
    pp, v, layers = _layout(cfg)
    try:
        stage_layer_counts(model_cfg.n_layers, pp * v, layers)
    except ValueError as exc:
        key = "parallel.pp_layers_per_stage" if layers else "model.n_layers"
        raise ValueError(f"{key}: {exc} (parallel.pp={pp} x virtual={v})") from None


def build_pipeline_model(cfg: Any, model_cfg: Any, env: Any, shard_kwargs: dict) -> PipelinePart:
    """This rank's stages, sharded, initialised, with their executor (``pipeline_of``);
    tensor-parallel inside each stage when ``parallel.tp > 1``, expert-parallel when
    ``parallel.ep > 1``, context-parallel when ``parallel.cp > 1`` (the part answers
    ``cp_context``); MoE layers with the ``[moe]`` settings, balancing over the stage's
    data x cp ranks.

    Args:
        cfg: the run config.
        model_cfg: the model's config (any model that declares its pieces,
            ``pipeline_pieces()``: a LlamaConfig's Transformer, a VLAConfig's
            VisionLanguageAction).
        env: this process's place in the job.
        shard_kwargs: the engine settings every piece is sharded with (precision, comm,
            prefetch...).

    Returns:
        The :class:`PipelinePart` (parameter names as in the unsplit model).
    """
    from shardwise.models import ModelBlock, build_model, init_module_weights
    from shardwise.parallel import checkpoint_activations, compile_blocks

    par = cfg.parallel
    pp, v, layers = _layout(cfg)
    schedule = build_schedule(par.pp_schedule, pp, resolve_microbatches(cfg), v)
    dims = ParallelDims(par.dp_replicate, par.dp_shard, env.world_size, pp=pp, cp=par.cp,
                        tp=par.tp, ep=par.ep)
    mesh = dims.build_mesh(env.device.type)
    model = build_model(model_cfg, device="meta")
    apply_matmul_precision(model, cfg)  # first, on the whole model (the composition order)
    if par.tp > 1:  # on the whole model, before the split (the composition order)
        apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel(par))
    # The executor's loss is then the vocab-parallel cross-entropy (default_loss).
    if par.ep > 1:  # after TP, before the split: each stage's experts split over its ep ranks
        apply_ep(model, mesh)
    if par.cp > 1:  # before the split: the stages' attention and RoPE carry the layout
        apply_cp(model, mesh["cp"], impl=par.cp_impl, load_balance=par.cp_load_balance)
    part = split_stages(model, mesh, v, layers, placement=schedule.placement)
    share_cp_context(model, part)  # the loop shards each batch by the part's layout
    share_low_precision_report(model, part)  # the start lines describe the whole model's
    # Checkpointing and compile wrap each block of this rank's stages (every tower's: a VLA's
    # vision blocks too), before sharding (the composition order of
    # shardwise.train.parallelize).
    t = cfg.train
    checkpoint_activations(part, t.activation_checkpoint, blocks=ModelBlock)
    if t.compile:
        compile_blocks(part, ModelBlock, backend=t.compile_backend)
    torch.manual_seed(cfg.train.seed)
    shard_stages(part, stage=par.stage, init_weights=init_module_weights, device=env.device,
                 **shard_kwargs)
    # The ranks of one stage whose tokens make the global micro-batch: its data x cp ranks
    # (dp_cp, the data ranks' group at cp 1), and under sequence parallelism its data x cp x
    # tensor ranks, the data x cp ranks the replicas ([Note: balance losses in a pipeline]);
    # the executor adds each forward's balance losses.
    if par.tp > 1 and sequence_parallel(par):
        apply_moe(part, cfg, (mesh.group("dp_cp"), mesh.group("tp")),
                  replicas=dims.degree("dp_cp"))
    else:
        apply_moe(part, cfg, mesh.group("dp_cp"))
    part.executor = PipelineExecutor(part, schedule,
                                     keep_gathered=not par.reshard_after_forward)
    return part


def pipeline_of(model: nn.Module) -> PipelineExecutor | None:
    """The executor of a pipelined model, None for a whole one."""
    return getattr(model, "executor", None) if isinstance(model, PipelinePart) else None


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The global gradient norm (over the pipeline ranks too when pipelined)."""
    if isinstance(model, PipelinePart):
        return pipeline_grad_norm(model)
    return get_total_norm(model)


def describe_pipeline(cfg: Any, model: nn.Module) -> str | None:
    """The line a pipelined run opens with (None for pp 1)."""
    pipe = pipeline_of(model)
    if pipe is None:
        return None
    s = pipe.schedule
    par = dataclasses.asdict(cfg.parallel)
    size = cfg.train.batch_size // s.microbatches
    return (f"pipeline: pp {s.pp}, schedule {s.name}, {s.microbatches} micro-batch"
            f"{'es' if s.microbatches > 1 else ''} of {size} sequence{'s' if size > 1 else ''}"
            f", {s.virtual} stage(s) per "
            f"rank; layers per stage {list(model.layer_counts)}; ZeRO stage {par['stage']} "
            f"inside each stage; expected bubble "
            f"{expected_bubble(s.name, s.pp, s.microbatches, s.virtual):.0%}")
