"""Checks on a run's configuration that need no model, data or ranks, and the world-size
resolution of the data-parallel degrees. Each failure names the key, the value and what was
expected (see docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import socket
import typing
from pathlib import Path
from typing import Any

from shardwise.parallel.lowbit.recipes import RECIPE_NAMES, RECIPES

__all__ = ["validate", "resolve_world", "check_output_dir", "sequence_parallel",
           "check_sequence_split", "check_model_combinations", "AC_POLICIES",
           "COMPILE_BACKENDS", "CP_IMPLS", "CP_LOAD_BALANCES", "PLAN_KEYS"]

# Kept equal to shardwise.parallel.AC_POLICIES by tests/test_activation_checkpoint.py, and
# the cp choices to shardwise.parallel.context's by tests/test_cp_train.py (this module
# stays free of torch imports: the command line loads configs before torch).
AC_POLICIES = ("none", "full", "selective")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
CP_IMPLS = ("ring", "ulysses", "hybrid")
CP_LOAD_BALANCES = ("zigzag", "none")
PLAN_KEYS = ("parallel.stage", "parallel.dp_replicate", "parallel.dp_shard", "parallel.cp",
             "parallel.tp", "parallel.sequence_parallel", "parallel.pp",
             "parallel.pp_schedule", "parallel.pp_microbatches", "parallel.pp_virtual",
             "train.batch_size", "train.grad_accum", "train.activation_checkpoint")
"""The config keys of a layout that ``parallel.plan = "auto"`` chooses (see plan_fixed)."""


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


_DTYPES = ("fp32", "bf16", "fp16")
_MATMULS = ("bf16",) + RECIPE_NAMES

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
    ("train.activation_checkpoint", lambda v: v in AC_POLICIES, "'none', 'full' or 'selective'"),
    ("train.compile_backend", lambda v: v in COMPILE_BACKENDS,
     "'inductor', 'aot_eager' or 'eager'"),
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
    ("parallel.tp", _positive, "a positive int (tensor-parallel degree)"),
    ("parallel.cp", _positive, "a positive int (context-parallel degree)"),
    ("parallel.cp_impl", lambda v: v in CP_IMPLS, "'ring', 'ulysses' or 'hybrid'"),
    ("parallel.cp_load_balance", lambda v: v in CP_LOAD_BALANCES, "'zigzag' or 'none'"),
    ("parallel.ep", _positive, "a positive int (expert-parallel degree)"),
    ("parallel.prefetch", _non_negative, "an int >= 0"),
    ("parallel.backend", lambda v: v in ("auto", "gloo", "nccl"), "'auto', 'gloo' or 'nccl'"),
    ("parallel.timeout_s", _positive, "a positive number of seconds"),
    ("parallel.watchdog", lambda v: v in ("on", "debug", "off"), "'on', 'debug' or 'off'"),
    ("parallel.plan", lambda v: v in ("off", "auto"), "'off' or 'auto'"),
    ("parallel.replan_threshold", lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    ("parallel.replan_steps", _positive, "a positive int (steps measured per layout)"),
    ("parallel.plan_hardware", lambda v: v.strip() != "", "a device name (e.g. local, h100)"),
    ("parallel.ft_min_groups", _positive, "a positive int (replica groups)"),
    ("parallel.ft_timeout_s", _positive, "a positive number of seconds"),
    ("parallel.ft_heartbeat_ms", _positive, "a positive int (milliseconds)"),
    ("parallel.ft_max_restarts", _non_negative, "an int >= 0"),
    ("parallel.ft_lighthouse", lambda v: v == "" or v.startswith(("http://", "https://")),
     "'' (start one) or a quorum server address such as http://host:29510"),
    ("parallel.pp", _positive, "a positive int (pipeline ranks)"),
    ("parallel.pp_microbatches", _non_negative, "an int >= 0 (0: the schedule's fewest)"),
    ("parallel.pp_virtual", _non_negative, "an int >= 0 (0: the schedule's own)"),
    ("parallel.pp_layers_per_stage", lambda v: all(c > 0 for c in v),
     "positive layer counts, one per stage (e.g. 3,2,2)"),
    ("precision.param_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.reduce_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.loss_scale", _positive, "a positive number"),
    ("precision.loss_scale_growth_interval", _positive, "a positive int (steps)"),
    ("precision.matmul", lambda v: v in _MATMULS, "'bf16' (no low-bit matmuls) or a recipe: "
     "'fp8_tensorwise', 'fp8_rowwise', 'fp8_rowwise_gw_hp', 'fp8_blockwise', 'mxfp8', 'nvfp4'"),
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
    matmul = RECIPES.get(config.precision.matmul)
    if comm.hierarchy and comm.weights == "fp8" and matmul and matmul.gathers_weight_codes:
        raise ValueError(f"comm.hierarchy={comm.hierarchy} with comm.weights='fp8' and "
                         f"precision.matmul={matmul.name!r}: the secondary partition keeps "
                         f"compute-dtype rows, not the fp8 codes the layers are gathered in; "
                         f"expected comm.hierarchy=0, comm.weights='fp' or another "
                         f"precision.matmul")
    if off.device == "disk" and not off.path.strip():
        raise ValueError("offload.device='disk' needs offload.path, the directory for the "
                         "optimizer-state files, got ''")
    resume = config.checkpoint.resume
    if config.log.overwrite and resume != "none":
        raise ValueError(f"log.overwrite=true removes the run that checkpoint.resume={resume!r} "
                         "would continue; expected one of the two")
    if par.sequence_parallel and par.tp == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the "
                         "activations between tensor-parallel regions), got tp 1")
    if par.ep > 1 and par.tp > 1 and not sequence_parallel(par):
        raise ValueError(f"parallel.ep={par.ep} with parallel.tp={par.tp} needs sequence "
                         f"parallelism (each tensor rank dispatches its own sequence shard); "
                         f"got parallel.sequence_parallel=false")
    if off.device != "none" and par.stage == 0:
        raise ValueError(f"offload.device={off.device!r} needs parallel.stage 1, 2 or 3 "
                         f"(sharded masters), got 0")
    _check_plan(config)
    _check_fault_tolerant(config)


def _check_fault_tolerant(config) -> None:
    """``parallel.fault_tolerant``: replica groups of data-parallel ranks only, for now."""
    par = config.parallel
    if not par.fault_tolerant:
        return
    others = [f"parallel.{k}={getattr(par, k)}" for k in ("tp", "cp", "pp") if getattr(par, k) > 1]
    if config.offload.device != "none":
        others.append(f"offload.device={config.offload.device!r}")
    if config.precision.param_dtype == "fp16":
        others.append("precision.param_dtype='fp16' (its loss scale is not healed)")
    if config.train.compile:
        others.append("train.compile=true")
    if others:
        raise ValueError(f"parallel.fault_tolerant=true trains replica groups of data-parallel "
                         f"ranks (ZeRO inside each group); it does not combine with "
                         f"{', '.join(others)} yet; expected tp, cp, pp 1, no "
                         f"offload, bf16 or fp32 compute, no compile (docs/failures.md)")
    if par.ft_min_groups > par.dp_replicate:
        raise ValueError(f"parallel.ft_min_groups={par.ft_min_groups} is more than the "
                         f"parallel.dp_replicate={par.dp_replicate} replica groups; no step "
                         f"could commit")


def _check_plan(config) -> None:
    """``parallel.plan_fixed`` names layout keys; ``plan = "auto"`` prices what it can."""
    par = config.parallel
    for key in par.plan_fixed:
        if key not in PLAN_KEYS:
            close = difflib.get_close_matches(key, PLAN_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"parallel.plan_fixed names {key!r}{hint}; expected keys among "
                             f"{', '.join(PLAN_KEYS)}")
    if par.plan == "auto" and config.offload.device == "disk":
        raise ValueError("parallel.plan='auto' prices offload.device 'none' or 'cpu', got "
                         "'disk'; expected parallel.plan='off' with disk offload")


def validate(config) -> None:
    """Check every value that can be judged without the model, data or world size.

    Raises:
        ValueError: naming the first offending key, its value and what was expected.
    """
    for key, ok, expected in _RULES:
        value = _get(config, key)
        if not ok(value):
            raise ValueError(f"{key} must be {expected}, got {value!r}{_suggest(key, value)}")
    _combinations(config)


def sequence_parallel(par) -> bool:
    """Whether a ``[parallel]`` section runs sequence parallelism (unset: when tp > 1)."""
    return par.tp > 1 if par.sequence_parallel is None else bool(par.sequence_parallel)


_CHOICES = {"train.activation_checkpoint": AC_POLICIES, "train.compile_backend": COMPILE_BACKENDS,
            "parallel.cp_impl": CP_IMPLS, "parallel.cp_load_balance": CP_LOAD_BALANCES}


def _suggest(key: str, value: Any) -> str:
    """`` (did you mean 'selective'?)`` for a near miss of a key with named choices."""
    close = difflib.get_close_matches(str(value), _CHOICES.get(key, ()), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_model_combinations(config, model_cfg) -> None:
    """Checks that need the model's shape (its :class:`~shardwise.models.LlamaConfig`).

    Raises:
        ValueError: ``train.compile`` or ``train.activation_checkpoint`` with an MoE model
            (routing with data-dependent shapes and balance statistics in forward).
    """
    t = config.train
    asked = [f"train.compile={str(t.compile).lower()}" if t.compile else "",
             f"train.activation_checkpoint={t.activation_checkpoint!r}"
             if t.activation_checkpoint != "none" else ""]
    asked = [a for a in asked if a]
    if asked and model_cfg.num_experts > 0:
        raise ValueError(f"{' and '.join(asked)} need a dense model; model "
                         f"{config.model.name!r} has MoE layers (num_experts="
                         f"{model_cfg.num_experts}), whose routing has data-dependent shapes "
                         "and whose balance statistics are all-reduced in forward (no "
                         "compiled graph, and a recompute would count them twice); expected "
                         "a dense model or the defaults (compile false, activation_checkpoint "
                         "'none')")


def check_sequence_split(config) -> None:
    """Shapes against the degrees, once the degrees fit the world (:func:`resolve_world`
    first: a degree the ranks cannot hold is the first thing to say).

    Raises:
        ValueError: ``data.seq_len`` not divisible by the context-parallel chunks (``2 x
            parallel.cp`` for zigzag, ``parallel.cp`` otherwise), or each cp rank's part not
            divisible by ``parallel.tp`` under sequence parallelism.
    """
    par, seq_len = config.parallel, config.data.seq_len
    if par.cp > 1:
        zigzag = par.cp_load_balance == "zigzag"
        chunks = 2 * par.cp if zigzag else par.cp
        if seq_len % chunks:
            how = (f"2 x parallel.cp = 2 x {par.cp} = {chunks}" if zigzag
                   else f"parallel.cp={par.cp}")
            raise ValueError(f"data.seq_len={seq_len} must be divisible by {how} "
                             f"(parallel.cp_load_balance={par.cp_load_balance!r} cuts every "
                             f"sequence, training and validation, into {chunks} equal "
                             f"chunks); change data.seq_len or parallel.cp")
    local = seq_len // par.cp
    if sequence_parallel(par) and local % par.tp:
        if par.cp > 1:
            raise ValueError(f"data.seq_len={seq_len} / parallel.cp={par.cp} = {local} "
                             f"positions per context-parallel rank must be divisible by "
                             f"parallel.tp={par.tp} with sequence parallelism (each tensor "
                             f"rank holds a tp-th of them); set parallel.sequence_parallel="
                             f"false or change data.seq_len")
        raise ValueError(f"data.seq_len={seq_len} must be divisible by parallel.tp="
                         f"{par.tp} with sequence parallelism (each tensor rank holds "
                         f"seq_len / tp positions); set parallel.sequence_parallel=false or "
                         f"change data.seq_len")


def resolve_world(config, world_size: int):
    """Fill in ``parallel.dp_shard = -1`` and check the degrees multiply to the world size.

    Args:
        config: a validated config.
        world_size: number of ranks in the job.

    Returns:
        The config with ``parallel.dp_shard`` resolved.

    Raises:
        ValueError: if ``dp_replicate * dp_shard * cp * tp != world_size / pp``, naming each
            degree; ``ep`` or ``comm.hierarchy`` not dividing ``dp_shard x cp``.
    """
    par = config.parallel
    if world_size % par.pp:  # pp is the outermost axis: the rest splits world / pp
        raise ValueError(f"parallel.pp={par.pp} must divide the world size {world_size} (pp x "
                         f"dp_replicate x dp_shard x cp x tp ranks)")
    world_size //= par.pp
    per_pp = f" / parallel.pp={par.pp}" if par.pp > 1 else ""
    # The degrees besides dp_shard, named only when above 1 (dp_replicate always).
    inner = [(f"parallel.{k}", getattr(par, k)) for k in ("cp", "tp") if getattr(par, k) > 1]
    shard, others = par.dp_shard, par.dp_replicate * par.cp * par.tp
    names = " * ".join(["parallel.dp_replicate"] + [n for n, _ in inner])
    degrees = " * ".join(str(d) for d in [par.dp_replicate] + [d for _, d in inner])
    if shard == -1:
        if world_size % others != 0:
            what = f"{names} = {degrees} = {others}" if inner else f"{names}={others}"
            raise ValueError(f"{what} does not divide the world size {world_size}{per_pp}; "
                             f"expected a divisor of {world_size}")
        shard = world_size // others
    if others * shard != world_size:
        all_names = " * ".join(["parallel.dp_replicate", "parallel.dp_shard"]
                               + [n for n, _ in inner])
        all_degrees = " * ".join(str(d) for d in [par.dp_replicate, shard]
                                 + [d for _, d in inner])
        raise ValueError(f"{all_names} = {all_degrees} = {others * shard}, expected the "
                         f"world size {world_size}{per_pp}")
    data = shard * par.cp  # the ranks parameters are sharded over, experts carved from
    data_name = (f"parallel.dp_shard x parallel.cp = {shard} x {par.cp} = {data}"
                 if par.cp > 1 else f"parallel.dp_shard={shard}")
    if data % par.ep:
        raise ValueError(f"parallel.ep={par.ep} must divide {data_name} (the experts are "
                         f"spread over the data ranks of a replica)")
    hierarchy = config.comm.hierarchy
    if hierarchy and data % hierarchy:
        raise ValueError(f"comm.hierarchy={hierarchy} must divide {data_name} (ranks per "
                         f"node inside each shard group)")
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
