"""Checks on a run's configuration that need no model, data or ranks, and the world-size
resolution of the data-parallel degrees. Each failure names the key, the value and what was
expected (see docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import typing
from pathlib import Path
from typing import Any

from shardwise.train.pipeline import check_pipeline_config, pipeline_world

__all__ = ["validate", "resolve_world", "check_output_dir"]


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


_DTYPES = ("fp32", "bf16", "fp16")

# (key, predicate, what was expected). Checked in order; the first failure is reported.
_RULES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("model.dim", lambda v: v is None or v > 0, "a positive int"),
    ("model.n_layers", lambda v: v is None or v > 0, "a positive int"),
    ("model.n_heads", lambda v: v is None or v > 0, "a positive int"),
    ("model.n_kv_heads", lambda v: v is None or v > 0, "a positive int"),
    ("model.ffn_dim", lambda v: v is None or v > 0, "a positive int"),
    ("model.max_seq_len", lambda v: v is None or v > 0, "a positive int"),
    ("model.num_experts", lambda v: v is None or v >= 0, "an int >= 0 (0: dense)"),
    ("model.top_k", lambda v: v is None or v > 0, "a positive int"),
    ("model.num_shared_experts", lambda v: v is None or v >= 0, "an int >= 0"),
    ("model.moe_ffn_dim", lambda v: v is None or v > 0, "a positive int"),
    ("model.moe_every", lambda v: v is None or v > 0, "a positive int"),
    ("model.router_score", lambda v: v in (None, "softmax", "sigmoid"),
     "'softmax' or 'sigmoid'"),
    ("data.max_bytes", lambda v: v is None or v > 0, "a positive int (bytes)"),
    ("data.tokenizer", lambda v: v in ("byte", "bpe"), "'byte' or 'bpe'"),
    ("data.bpe_vocab_size", lambda v: v >= 256, "an int >= 256 (the byte alphabet)"),
    ("data.seq_len", _positive, "a positive int (tokens)"),
    ("data.val_fraction", lambda v: 0 < v < 1, "a fraction strictly between 0 and 1"),
    ("train.steps", _positive, "a positive int"),
    ("train.batch_size", _positive, "a positive int (sequences per rank)"),
    ("train.grad_accum", _positive, "a positive int"),
    ("train.eval_interval", _non_negative, "an int >= 0"),
    ("train.eval_batches", _positive, "a positive int"),
    ("train.log_interval", _positive, "a positive int"),
    ("train.nonfinite", lambda v: v in ("stop", "skip"), "'stop' or 'skip'"),
    ("train.sync_debug", lambda v: v in ("off", "warn", "error"), "'off', 'warn' or 'error'"),
    ("optim.lr", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("optim.betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.eps", _positive, "a positive number"),
    ("optim.weight_decay", _non_negative, "a number >= 0"),
    ("optim.warmup_steps", _non_negative, "an int >= 0"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    ("optim.grad_clip", _non_negative, "a number >= 0 (0 disables clipping)"),
    ("optim.schedule_horizon", lambda v: v in ("keep", "extend"), "'keep' or 'extend'"),
    ("parallel.nproc", _positive, "a positive int (local ranks)"),
    ("parallel.stage", lambda v: v in (0, 1, 2, 3), "a ZeRO stage in 0..3"),
    ("parallel.dp_replicate", _positive, "a positive int"),
    ("parallel.dp_shard", lambda v: v == -1 or v > 0, "a positive int or -1 (infer)"),
    ("parallel.prefetch", _non_negative, "an int >= 0"),
    ("parallel.backend", lambda v: v in ("auto", "gloo", "nccl"), "'auto', 'gloo' or 'nccl'"),
    ("parallel.timeout_s", _positive, "a positive number of seconds"),
    ("parallel.watchdog", lambda v: v in ("on", "debug", "off"), "'on', 'debug' or 'off'"),
    ("parallel.pp", _positive, "a positive int (pipeline ranks)"),
    ("parallel.pp_microbatches", _non_negative, "an int >= 0 (0: the schedule's fewest)"),
    ("parallel.pp_virtual", _non_negative, "an int >= 0 (0: the schedule's own)"),
    ("parallel.pp_layers_per_stage", lambda v: all(c > 0 for c in v),
     "positive layer counts, one per stage (e.g. 3,2,2)"),
    ("precision.param_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.reduce_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.loss_scale", _positive, "a positive number"),
    ("precision.loss_scale_growth_interval", _positive, "a positive int (steps)"),
    ("comm.weights", lambda v: v in ("fp", "int8", "fp8"), "'fp', 'int8' or 'fp8'"),
    ("comm.grads", lambda v: v in ("fp", "int8", "int4"), "'fp', 'int8' or 'int4'"),
    ("comm.block_size", _positive, "a positive int (elements)"),
    ("comm.hierarchy", _non_negative, "an int >= 0 (ranks per node; 0: off)"),
    ("offload.device", lambda v: v in ("none", "cpu", "disk"), "'none', 'cpu' or 'disk'"),
    ("offload.buffer_mb", _positive, "a positive number of MiB"),
    ("offload.budget_mb", _non_negative, "a number of MiB >= 0 (0: everything)"),
    ("log.dir", lambda v: v.strip() != "", "a non-empty path"),
    ("checkpoint.interval", _non_negative, "an int >= 0 (steps; 0 disables saving)"),
    ("checkpoint.keep_last", _non_negative, "an int >= 0 (0 keeps all)"),
    ("checkpoint.resume", lambda v: v.strip() != "", "'auto', 'none' or a checkpoint path"),
    ("moe.capacity_factor", lambda v: v is None or 0 < v < math.inf,
     "unset (dropless) or a finite number > 0"),
    ("moe.aux_loss_coef", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("moe.z_loss_coef", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("moe.balance", lambda v: v in ("aux", "bias", "none"), "'aux', 'bias' or 'none'"),
    ("moe.bias_update_rate", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
]


def _get(config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _combinations(config) -> None:
    """Cross-field checks: what one key allows depends on another."""
    par, comm, off = config.parallel, config.comm, config.offload
    if par.stage == 0 and (comm.weights != "fp" or comm.grads != "fp" or comm.hierarchy):
        raise ValueError(f"comm.weights={comm.weights!r}, comm.grads={comm.grads!r}, "
                         f"comm.hierarchy={comm.hierarchy} need parallel.stage 1, 2 or 3, got 0")
    if comm.hierarchy and not (par.stage == 3 and par.reshard_after_forward):
        raise ValueError(f"comm.hierarchy={comm.hierarchy} needs parallel.stage 3 with "
                         f"parallel.reshard_after_forward true")
    if off.device == "disk" and not off.path.strip():
        raise ValueError("offload.device='disk' needs offload.path, the directory for the "
                         "optimizer-state files, got ''")
    resume = config.checkpoint.resume
    if config.log.overwrite and resume != "none":
        raise ValueError(f"log.overwrite=true removes the run that checkpoint.resume={resume!r} "
                         "would continue; expected one of the two")
    if off.device != "none" and par.stage == 0:
        raise ValueError(f"offload.device={off.device!r} needs parallel.stage 1, 2 or 3 "
                         f"(sharded masters), got 0")
    check_pipeline_config(config)


def validate(config) -> None:
    """Check every value that can be judged without the model, data or world size.

    Raises:
        ValueError: naming the first offending key, its value and what was expected.
    """
    for key, ok, expected in _RULES:
        value = _get(config, key)
        if not ok(value):
            raise ValueError(f"{key} must be {expected}, got {value!r}")
    _combinations(config)


def resolve_world(config, world_size: int):
    """Fill in ``parallel.dp_shard = -1`` and check the degrees multiply to the world size.

    Args:
        config: a validated config.
        world_size: number of ranks in the job.

    Returns:
        The config with ``parallel.dp_shard`` resolved.

    Raises:
        ValueError: if ``dp_replicate * dp_shard != world_size``.
    """
    par = config.parallel
    world_size = pipeline_world(config, world_size)  # the data ranks: pp splits the world
    shard = par.dp_shard
    if shard == -1:
        if world_size % par.dp_replicate != 0:
            raise ValueError(f"parallel.dp_replicate={par.dp_replicate} does not divide the world "
                             f"size {world_size}; expected a divisor of {world_size}")
        shard = world_size // par.dp_replicate
    if par.dp_replicate * shard != world_size:
        pp = f" / parallel.pp={par.pp}" if par.pp > 1 else ""
        raise ValueError(f"parallel.dp_replicate * parallel.dp_shard = {par.dp_replicate} * "
                         f"{shard} = {par.dp_replicate * shard}, expected the world size "
                         f"{world_size}{pp}")
    hierarchy = config.comm.hierarchy
    if hierarchy and shard % hierarchy:
        raise ValueError(f"comm.hierarchy={hierarchy} must divide parallel.dp_shard={shard} "
                         f"(ranks per node inside each shard group)")
    return dataclasses.replace(config, parallel=dataclasses.replace(par, dp_shard=shard))


def check_output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove it is writable by writing and removing a probe file.

    Returns:
        The folder as a :class:`Path`.

    Raises:
        ValueError: naming the folder when it cannot be created or written.
    """
    folder = Path(path).expanduser()
    # Host and pid in the name: ranks of several nodes may probe one shared folder at once.
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok", encoding="ascii")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"log.dir {str(path)!r} cannot be written: {exc.strerror or exc}; "
                         "expected a folder this user can create files in") from None
    return folder
