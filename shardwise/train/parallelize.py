"""Everything the trainer knows about parallelism, in one place.

Composition order (docs/design.md, "The trainer"): the model is built on the meta device ->
``apply_low_precision`` (``precision.matmul``'s low-bit recipe in the blocks' linears) ->
``apply_tp`` (tensor + sequence parallelism over the mesh's ``tp`` axis) -> ``apply_ep``
(MoE experts split over ``ep``, their tokens dispatched by all-to-all) -> ``apply_cp``
(attention over sequences split across the ``cp`` axis, RoPE at global positions) ->
activation checkpointing -> compile -> sharded by the ZeRO engine over the data axes
(``dp_shard x cp``; experts over ``edp``) with the run's stage, precision, quantised
communication and offload, which materialises it module by module. The optimizer is
wrapped when optimizer state is offloaded; accumulation micro-batches run without gradient
communication; clipping is over the sharded gradients; the loss is vocab-parallel under
tensor parallelism. The trainer calls these and nothing else of the engine.

Batch semantics (every layout): ``train.batch_size`` sequences per data-parallel rank per
micro-batch; the global batch is ``batch_size x grad_accum x dp_replicate x dp_shard``; the
tensor and context-parallel ranks of one data rank see the same sequences
(:func:`data_rank`), and each cp rank feeds its part of them
(:func:`shardwise.train.context.local_sequences`).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise import CommQuant, LossScaler, MixedPrecision, Offload
from shardwise.distributed import env as dist_env
from shardwise.distributed.mesh import ParallelDims
from shardwise.parallel.lowbit.recipes import RECIPES
from shardwise.parallel.tensor import default_plan, tp_context, vocab_parallel_cross_entropy
from shardwise.shard.offload import policy_of
from shardwise.train.config import Config
from shardwise.train.config.checks import sequence_parallel
from shardwise.train.freeze import apply_freeze
from shardwise.train.context import describe_cp
from shardwise.train.lowbit import apply_matmul_precision, describe_matmul
from shardwise.train.moe import apply_moe
from shardwise.train.pipeline import build_pipeline_model

__all__ = ["build_mixed_precision", "build_comm_quant", "build_offload", "validate_offload",
           "build_loss_scaler", "build_parallel_model", "wrap_optimizer", "no_sync",
           "clip_grad_norm_", "as_config_keys", "parallel_dims", "data_rank", "cross_entropy",
           "validate_tp", "validate_ep", "describe_layout", "layout_record",
           "apply_matmul_precision", "describe_matmul"]

# The engine names its arguments (Offload(path='/x')); a trainer user wrote config keys.
_OFFLOAD_KEYS = {"device": "offload.device", "path": "offload.path",
                 "buffer_mb": "offload.buffer_mb", "prefetch": "offload.prefetch"}
_OFFLOAD_ARG = re.compile(r"Offload\((\w+)=(.+?)\)(?=[\s:;,]|$)")


def as_config_keys(message: str) -> str:
    """An engine error restated with the config keys the user wrote:
    ``Offload(path='/x') does not exist`` -> ``offload.path = '/x' does not exist``."""
    return _OFFLOAD_ARG.sub(lambda m: f"{_OFFLOAD_KEYS[m[1]]} = {m[2]}"
                            if m[1] in _OFFLOAD_KEYS else m[0], message)


@contextlib.contextmanager
def _in_config_keys() -> Iterator[None]:
    try:
        yield
    except ValueError as exc:
        raise ValueError(as_config_keys(str(exc))) from None


def build_mixed_precision(cfg: Config) -> MixedPrecision | None:
    """The ``[precision]`` section as an engine policy (None for plain fp32)."""
    p = cfg.precision
    if p.param_dtype == "fp32" and p.reduce_dtype == "fp32":
        return None
    return MixedPrecision(param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype)


def build_loss_scaler(cfg: Config) -> LossScaler:
    """Dynamic loss scaling for fp16 compute; a pass-through otherwise."""
    p = cfg.precision
    return LossScaler(init_scale=p.loss_scale, growth_interval=p.loss_scale_growth_interval,
                      enabled=p.param_dtype == "fp16")


def parallel_dims(cfg: Config, world_size: int) -> ParallelDims:
    """The run's degrees (``parallel.pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``,
    ``ep``), resolved."""
    par = cfg.parallel
    return ParallelDims(par.dp_replicate, par.dp_shard, world_size, pp=par.pp, cp=par.cp,
                        tp=par.tp, ep=par.ep).resolved()


def data_rank(cfg: Config, env: dist_env.DistEnv) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): what the
    loader, validation and token counts use. Tensor and context-parallel ranks of one data
    rank share it."""
    dims = parallel_dims(cfg, env.world_size)
    ranks = dims.axis_ranks("dp", env.rank)
    return ranks.index(env.rank), len(ranks)


def data_leader(cfg: Config, env: dist_env.DistEnv) -> bool:
    """Whether this rank speaks for its data rank: the first of the tensor and
    context-parallel ranks that share its batches."""
    dims = parallel_dims(cfg, env.world_size)
    return all(dims.axis_ranks(axis, env.rank)[0] == env.rank for axis in ("tp", "cp"))


def build_parallel_model(cfg: Config, model_cfg: Any, env: dist_env.DistEnv) -> nn.Module:
    """Build the model on the meta device, apply tensor, expert and context parallelism,
    checkpoint and compile its blocks as ``train.activation_checkpoint`` and
    ``train.compile`` ask, and shard it with the ZeRO engine (the composition order of the
    module doc).

    Each rank initialises the model one module at a time and keeps only its shard, so no
    rank ever holds the whole model; the weights are bitwise those of eager init with
    ``train.seed`` at any layout (see docs/engine.md).

    Args:
        cfg: the run config (``parallel`` and ``precision`` sections, ``train.seed``,
            ``train.activation_checkpoint``, ``train.compile``, ``train.compile_backend``).
        model_cfg: the model's :class:`~shardwise.models.LlamaConfig`.
        env: this process's place in the job.

    Returns:
        The sharded model (parameter names unchanged); its MoE layers, if any, have the
        ``[moe]`` settings and reduce their balance statistics over every rank that routes
        its own tokens (the data and context-parallel ranks, and the tensor ranks under
        sequence parallelism).
        With ``parallel.pp > 1``, this rank's pipeline part, its executor attached
        (:mod:`shardwise.train.pipeline`).
    """
    from shardwise.models import ModelBlock, init_module_weights
    from shardwise.models import build_model as build

    par = cfg.parallel
    dims = parallel_dims(cfg, env.world_size)
    # The fixed composition order (docs/design.md), each step leaving a plain nn.Module:
    # build on meta -> tensor / sequence parallelism -> expert parallelism -> context
    # parallelism -> activation checkpointing -> compile -> pipeline split -> shard ->
    # materialise (inside shard). EP after TP: each tensor rank dispatches its own sequence
    # shard. CP after TP: its all-to-all degree is bounded by the key/value heads each
    # tensor rank holds; before checkpointing and compile: its attention is a custom
    # operator both recompute and trace like any other. Checkpointing before
    # compile: the compiled graph then holds the recompute (one graph per block). Compile
    # before shard: compile_blocks replaces each block's forward, and the engine's hooks,
    # installed by shard on the block's __call__, run eagerly around the compiled graph
    # ([Note: collectives outside compiled regions]). A pipeline takes the same steps,
    # splitting after EP (shardwise.train.pipeline).
    if dims.pp > 1:  # split into stages, each piece sharded over its stage's data ranks
        return build_pipeline_model(cfg, model_cfg, env, dict(
            reshard_after_forward=par.reshard_after_forward, prefetch=par.prefetch,
            mixed_precision=build_mixed_precision(cfg), comm=build_comm_quant(cfg)))
    mesh = (dims.build_mesh(env.device.type)
            if dims.dp_replicate > 1 or dims.tp > 1 or dims.ep > 1 or dims.cp > 1 else None)
    model = build(model_cfg, device="meta")
    apply_matmul_precision(model, cfg)  # first: every later step sees plain modules
    if dims.tp > 1:  # before sharding: the engine shards each tensor rank's pieces
        shardwise.apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel(par))
    if dims.ep > 1:  # after TP, before ZeRO (experts sharded over edp)
        shardwise.apply_ep(model, mesh)
    if dims.cp > 1:  # after TP (it reads the heads per tensor rank), before AC and compile
        shardwise.apply_cp(model, mesh["cp"], impl=par.cp_impl, load_balance=par.cp_load_balance)
    t = cfg.train
    # every tower's repeated blocks (a VLA's vision and decoder blocks, a decoder's blocks)
    shardwise.checkpoint_activations(model, t.activation_checkpoint, blocks=ModelBlock)
    if t.compile:
        shardwise.compile_blocks(model, ModelBlock, backend=t.compile_backend)
    apply_freeze(model, cfg.model.freeze)  # before shard: frozen units get no gradient state
    torch.manual_seed(cfg.train.seed)
    model = shardwise.shard(model, stage=par.stage, wrap={ModelBlock}, mesh=mesh,
                            reshard_after_forward=par.reshard_after_forward,
                            prefetch=par.prefetch, init_weights=init_module_weights,
                            mixed_precision=build_mixed_precision(cfg),
                            comm=build_comm_quant(cfg), offload=build_offload(cfg),
                            device=env.device)
    # Balance over the global batch: under sequence parallelism every rank routes its own
    # tokens and the data ranks (x cp: every rank holding other tokens) are the replicas;
    # otherwise the data and cp ranks route them (dp_cp is dp's group at cp 1).
    if dims.tp > 1 and sequence_parallel(par):
        return apply_moe(model, cfg, None, replicas=dims.degree("dp_cp"))
    return apply_moe(model, cfg, mesh.group("dp_cp") if mesh is not None else None)


def cross_entropy(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor
                  ) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model``'s logits: vocab-parallel (the full logits
    never gathered) when tensor parallelism returns vocab-sharded logits."""
    ctx = tp_context(model)
    if ctx is not None and ctx.loss_parallel:
        return vocab_parallel_cross_entropy(logits, targets, ctx.tp.group)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _local_ranks(world_size: int) -> int:
    """Ranks per node as the launcher says (torchrun, SLURM), else the whole job."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit():
            return int(value)
    return world_size


def validate_tp(cfg: Config, model_cfg: Any, world_size: int) -> None:
    """Tensor-parallel checks that need the model's shape, before any rank starts; warns when
    a tensor-parallel group would span nodes.

    Raises:
        ValueError: heads, KV heads, vocabulary or feed-forward width not divisible by
            ``parallel.tp``; a model the built-in plan does not cover (MoE, latent
            attention); each message names ``parallel.tp``.
    """
    tp = cfg.parallel.tp
    if tp == 1:
        return
    from shardwise.models import build_model as build

    try:
        default_plan(build(model_cfg, device="meta"), tp)
    except ValueError as exc:
        raise ValueError(f"parallel.tp={tp}: {exc}") from None
    local = _local_ranks(world_size)
    if tp > local:
        warnings.warn(f"parallel.tp={tp} is more than the {local} ranks of a node: every "
                      f"layer's collectives will cross nodes (tensor parallelism wants the "
                      f"fastest links; keep tp within a node)", stacklevel=2)


def validate_ep(cfg: Config, model_cfg: Any) -> None:
    """Expert-parallel checks that need the model's shape, before any rank starts.

    Raises:
        ValueError: ``parallel.ep > 1`` for a model without MoE layers, or a number of
            experts not divisible by it; each message names ``parallel.ep``.
    """
    ep = cfg.parallel.ep
    if ep == 1:
        return
    if not model_cfg.is_moe:
        raise ValueError(f"parallel.ep={ep} needs a mixture-of-experts model; {cfg.model.name!r}"
                         f" has no MoE layers (num_experts={model_cfg.num_experts}); expected "
                         f"e.g. --model.name debug-moe, or parallel.ep=1")
    if model_cfg.num_experts % ep:
        raise ValueError(f"parallel.ep={ep} must divide the number of experts "
                         f"(model.num_experts={model_cfg.num_experts}): every ep rank holds "
                         f"the same number of experts")


def describe_layout(cfg: Config, world_size: int) -> str:
    """The layout in words for the start line, e.g. ``"tp 2 (sequence parallel) x dp_shard
    2, ZeRO stage 3"``, ``"pp 2 x tp 2 (sequence parallel) x dp_shard 1, ZeRO stage 3"``,
    ``"dp_shard 4 (ep 2)"`` with expert parallelism or ``"cp 2 (ring, zigzag) x dp_shard
    2, ZeRO stage 3"`` with context parallelism."""
    dims, par = parallel_dims(cfg, world_size), cfg.parallel
    parts = [f"pp {dims.pp}"] if dims.pp > 1 else []  # outermost first ([Note: rank order])
    if dims.tp > 1:
        parts.append(f"tp {dims.tp}" + (" (sequence parallel)" if sequence_parallel(par)
                                        else ""))
    parts += describe_cp(dims, par)
    if dims.dp_replicate > 1:
        parts.append(f"dp_replicate {dims.dp_replicate}")
    ep = f"ep {dims.ep}" + (" over dp_shard x cp" if dims.cp > 1 else "")
    parts.append(f"dp_shard {dims.dp_shard}" + (f" ({ep})" if dims.ep > 1 else ""))
    return " x ".join(parts) + f", ZeRO stage {par.stage}"


def layout_record(cfg: Config, world_size: int) -> dict[str, Any]:
    """The layout for ``summary.json``: every degree, sequence parallelism, the stage, and
    with cp > 1 the context-parallel implementation and load balance."""
    dims, par = parallel_dims(cfg, world_size), cfg.parallel
    record = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
              "cp": dims.cp, "tp": dims.tp, "ep": dims.ep,
              "sequence_parallel": sequence_parallel(par) and dims.tp > 1,
              "stage": par.stage}
    if dims.cp > 1:
        record.update(cp_impl=par.cp_impl, cp_load_balance=par.cp_load_balance)
    return record


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context for accumulation micro-batches: backward without gradient communication."""
    return shardwise.no_sync(model)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient L2 norm to ``max_norm`` (``inf``: only measure it)."""
    return shardwise.clip_grad_norm_(model, max_norm)


def build_comm_quant(cfg: Config) -> CommQuant | None:
    """The ``[comm]`` section as an engine policy (None when nothing is quantised)."""
    c, recipe = cfg.comm, RECIPES.get(cfg.precision.matmul)
    # [Note: fp8 weight gathers]: with codes, what the recipe keeps high goes unquantised in
    # every shard call, a pipeline's embedding and head pieces too (bitwise the fp gather)
    rest = c.weights == "fp8" and recipe is not None and recipe.gathers_weight_codes
    q = CommQuant(weights=None if c.weights == "fp" else c.weights,
                  grads=None if c.grads == "fp" else c.grads, block_size=c.block_size,
                  hierarchy=c.hierarchy or None, rest_unquantised=rest)
    return q if q.enabled else None


def build_offload(cfg: Config) -> Offload | None:
    """The ``[offload]`` section as an engine policy (None: no offload).

    Raises:
        ValueError: a policy the engine refuses, naming the ``offload.*`` key.
    """
    o = cfg.offload
    if o.device == "none":
        return None
    with _in_config_keys():
        return Offload(device=o.device, path=o.path or None, buffer_mb=o.buffer_mb,
                       budget_bytes=int(o.budget_mb * 2**20) if o.budget_mb else None,
                       prefetch=o.prefetch)


def validate_offload(cfg: Config) -> None:
    """The engine's own check of the offload directory, before any rank starts.

    Raises:
        ValueError: a missing, read-only or unwritable ``offload.path`` (named as the key).
    """
    offload = build_offload(cfg)
    if offload is not None:
        with _in_config_keys():
            offload.validate()


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module):
    """The optimizer itself, or its offloading wrapper when ``[offload]`` asks for one.

    Raises:
        ValueError: the wrapper's checks (room in ``offload.path``, ``offload.buffer_mb``
            large enough for the largest parameter's state), naming the key.
    """
    if policy_of(model) is None:
        return optimizer
    with _in_config_keys():
        return shardwise.offload_optimizer(optimizer, model=model)
