"""Everything the trainer knows about parallelism, in one place.

The model is built on the meta device and sharded by the ZeRO engine with the run's stage,
mesh, precision, quantised communication and offload; the optimizer is wrapped when
optimizer state is offloaded; accumulation micro-batches run without gradient
communication; clipping is over the sharded gradients. The trainer calls these and
nothing else of the engine.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise import CommQuant, LossScaler, MixedPrecision, Offload
from shardwise.distributed import env as dist_env
from shardwise.distributed.mesh import ParallelDims
from shardwise.shard.offload import policy_of
from shardwise.train.config import Config
from shardwise.train.moe import apply_moe
from shardwise.train.pipeline import build_pipeline_model

__all__ = ["build_mixed_precision", "build_comm_quant", "build_offload", "validate_offload",
           "build_loss_scaler", "build_parallel_model", "wrap_optimizer", "no_sync",
           "clip_grad_norm_", "as_config_keys"]

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


def build_parallel_model(cfg: Config, model_cfg: Any, env: dist_env.DistEnv) -> nn.Module:
    """Build the model on the meta device and shard it with the ZeRO engine.

    Each rank initialises the model one module at a time and keeps only its shard, so no
    rank ever holds the whole model; the weights are bitwise those of eager init with
    ``train.seed`` (see docs/engine.md).

    Args:
        cfg: the run config (``parallel`` and ``precision`` sections, ``train.seed``).
        model_cfg: the model's :class:`~shardwise.models.LlamaConfig`.
        env: this process's place in the job.

    Returns:
        The sharded model (parameter names unchanged); its MoE layers, if any, have the
        ``[moe]`` settings and reduce their balance statistics over all ranks. With
        ``parallel.pp > 1``, this rank's pipeline part, its executor attached
        (:mod:`shardwise.train.pipeline`).
    """
    from shardwise.models import TransformerBlock, init_module_weights
    from shardwise.models import build_model as build

    par = cfg.parallel
    if par.pp > 1:  # split into stages, each piece sharded over its stage's data ranks
        return build_pipeline_model(cfg, model_cfg, env, dict(
            reshard_after_forward=par.reshard_after_forward, prefetch=par.prefetch,
            mixed_precision=build_mixed_precision(cfg), comm=build_comm_quant(cfg)))
    dims = ParallelDims(par.dp_replicate, par.dp_shard, env.world_size).resolved()
    mesh = dims.build_mesh(env.device.type) if dims.dp_replicate > 1 else None
    model = build(model_cfg, device="meta")
    torch.manual_seed(cfg.train.seed)
    model = shardwise.shard(model, stage=par.stage, wrap={TransformerBlock}, mesh=mesh,
                            reshard_after_forward=par.reshard_after_forward,
                            prefetch=par.prefetch, init_weights=init_module_weights,
                            mixed_precision=build_mixed_precision(cfg),
                            comm=build_comm_quant(cfg), offload=build_offload(cfg),
                            device=env.device)
    # Every rank is a data-parallel replica: balance over the global batch.
    return apply_moe(model, cfg)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context for accumulation micro-batches: backward without gradient communication."""
    return shardwise.no_sync(model)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient L2 norm to ``max_norm`` (``inf``: only measure it)."""
    return shardwise.clip_grad_norm_(model, max_norm)


def build_comm_quant(cfg: Config) -> CommQuant | None:
    """The ``[comm]`` section as an engine policy (None when nothing is quantised)."""
    c = cfg.comm
    q = CommQuant(weights=None if c.weights == "fp" else c.weights,
                  grads=None if c.grads == "fp" else c.grads, block_size=c.block_size,
                  hierarchy=c.hierarchy or None)
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
