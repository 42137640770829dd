"""Training configuration: dataclasses, TOML files and ``--section.key`` overrides.

Every knob is a field of a section dataclass with a docstring beside it (units included); the
docstrings are what ``shardwise train --help`` prints. Values are resolved in this order,
later wins::

    defaults (the dataclasses below, identical to configs/debug.toml)
      <- a TOML file                    --config configs/debug.toml
      <- dotted command-line overrides  --train.steps 30 --parallel.stage 3 --log.dir runs/x

A new section (precision, checkpoint, ...) is one more frozen dataclass and one more field
of :class:`Config`; loading, type checking, ``--help`` and TOML output pick it up.

Bad input raises ``ValueError`` naming the key, the value and what was expected, before any
rank starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.train import config_io

__all__ = [
    "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "ParallelConfig", "LogConfig",
    "CheckpointConfig", "Config", "load_config", "validate", "resolve_world", "check_output_dir",
    "to_toml",
    "all_keys",
]


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train: a named config from ``shardwise.models`` plus shape overrides."""

    name: str = "debug"
    """Named model config (see shardwise.models.list_model_configs(): debug, small, ...)."""
    dim: int | None = None
    """Override: residual width in features (unset: the named config's value)."""
    n_layers: int | None = None
    """Override: number of transformer blocks (unset: the named config's value)."""
    n_heads: int | None = None
    """Override: number of query heads (unset: the named config's value)."""
    n_kv_heads: int | None = None
    """Override: number of key/value heads, must divide n_heads (unset: named config's)."""
    ffn_dim: int | None = None
    """Override: SwiGLU hidden width in features (unset: the named config's value)."""
    max_seq_len: int | None = None
    """Override: longest sequence the model accepts, in tokens (unset: named config's)."""
    tie_embeddings: bool | None = None
    """Override: share the embedding and output matrices (unset: the named config's value)."""


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are cut into windows."""

    source: str = "stdlib"
    """Corpus: "stdlib" (text shipped with Python) or a path to a text file or folder."""
    max_bytes: int | None = None
    """Cap on the corpus size in UTF-8 bytes (unset: 4 MiB for stdlib, no cap for a path)."""
    tokenizer: str = "byte"
    """Tokenizer: "byte" (256 ids) or "bpe" (trained on the corpus with `tokenizers`)."""
    bpe_vocab_size: int = 1024
    """Vocabulary size of the BPE tokenizer, in ids (only used with tokenizer = "bpe")."""
    seq_len: int = 128
    """Window length in tokens; at most the model's max_seq_len."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out for validation (0 < x < 1)."""
    seed: int = 0
    """Seed of the loader's shuffle of windows."""


@dataclass(frozen=True)
class TrainConfig:
    """How long to train and on how much data per step."""

    steps: int = 150
    """Optimizer steps to run."""
    batch_size: int = 4
    """Sequences per micro-batch on each rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (global batch = batch_size * grad_accum
    * world size sequences)."""
    seed: int = 0
    """Seed of the model initialisation (identical on every rank)."""
    eval_interval: int = 50
    """Validate every this many steps (0: only after the last step)."""
    eval_batches: int = 4
    """Micro-batches per rank in each validation pass."""
    log_interval: int = 10
    """Gather per-rank memory and refresh the progress bar every this many steps."""
    nonfinite: str = "stop"
    """A nan/inf loss or gradient before the optimizer step: "stop" (fail naming the first
    offending parameter and the step) or "skip" (drop the update, log it, continue)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, a warmup + cosine learning-rate schedule and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate (reached after warmup_steps)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2) decay rates of the moment estimates."""
    eps: float = 1e-8
    """AdamW epsilon added to the denominator."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to every parameter not matched by no_decay."""
    no_decay: tuple[str, ...] = ("norm", "bias")
    """Parameters whose name contains any of these substrings get no weight decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, as a fraction of lr (0 <= x <= 1), reached at the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value (0: no clipping)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks and how the model is spread over them."""

    nproc: int = 2
    """Local ranks to launch when not started by torchrun or SLURM (1: run in this process)."""
    stage: int = 3
    """ZeRO stage: 0 plain data parallel, 1 shard optimizer state, 2 + gradients, 3 + params."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer axis); dp_replicate * dp_shard = world size."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (-1: world size // dp_replicate)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (stage 3) and gather them again for backward."""
    prefetch: int = 1
    """Units whose parameters are gathered ahead of use (0: no prefetch)."""
    backend: str = "auto"
    """c10d backend: "auto" (nccl with CUDA, else gloo), "gloo" or "nccl"."""
    timeout_s: float = 600.0
    """Collective timeout in seconds; a collective that outlives it fails instead of hanging."""
    watchdog: str = "on"
    """Collective watchdog: "on" (hangs, divergence and dead ranks fail every rank with one
    report, docs/failures.md), "debug" (also compare every collective's shapes across ranks
    before it runs: slower) or "off"."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute and communication dtypes; masters and optimizer state stay fp32."""

    param_dtype: str = "fp32"
    """Dtype of gathered parameters and compute: "fp32", "bf16" or "fp16"."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in: "fp32", "bf16" or "fp16"."""
    loss_scale: float = 65536.0
    """fp16 only: initial dynamic loss scale (halved on overflow, the step skipped)."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: clean steps before the loss scale doubles."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic sharded checkpoints, resuming, and importing Hugging Face weights
    (docs/checkpoints.md)."""

    interval: int = 0
    """Save a checkpoint every this many steps and after the last one (0: never)."""
    dir: str = ""
    """Folder of the checkpoints step_<N> ("": <log.dir>/checkpoints)."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are deleted (0: keep all)."""
    resume: str = "none"
    """"auto" (latest complete checkpoint in the folder, else start fresh), "none", or a path."""
    async_save: bool = False
    """Write checkpoints in a background thread while training continues (--checkpoint.async)."""
    import_safetensors: str = ""
    """Start from Hugging Face Llama safetensors (a file or folder) instead of random init."""


@dataclass(frozen=True)
class LogConfig:
    """Where results go and how progress is shown."""

    dir: str = "runs/debug"
    """Output folder: config.toml, metrics.jsonl, loss.png, summary.json (created if missing)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <dir>/tb (needs the tensorboard package)."""
    plot: bool = True
    """Write the loss curve <dir>/loss.png at the end of the run."""


@dataclass(frozen=True)
class Config:
    """The whole run: one field per section (a TOML table / a --section.key prefix)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model to train."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Corpus, tokenizer and windows."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Steps, batch sizes, validation and logging cadence."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer, learning-rate schedule and clipping."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Ranks, ZeRO stage and data-parallel degrees."""
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    """Mixed precision."""
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    """Outputs and progress display."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints, resuming and weight import."""


# ----------------------------------------------------------------------------- loading


def all_keys() -> list[str]:
    """Every dotted key, ``["model.name", ..., "log.plot"]``, in declaration order."""
    return [f"{s}.{k}" for s, k, *_ in config_io.iter_fields(Config())]


def load_config(path: str | os.PathLike | None = None,
                overrides: dict[str, str] | None = None) -> Config:
    """Defaults <- TOML file <- command-line overrides, then :func:`validate`.

    Args:
        path: a TOML file (one table per section), or None for the defaults alone.
        overrides: ``{"train.steps": "30", ...}``, command-line strings.

    Returns:
        The validated :class:`Config` (world-size checks are :func:`resolve_world`'s).

    Raises:
        ValueError: unreadable or malformed TOML, unknown keys (with the closest valid key),
            wrong types, impossible values; each names the key and the value.
    """
    config = Config()
    if path is not None:
        origin = repr(str(path))
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"config file {origin} cannot be read: "
                             f"{exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {origin} is not valid TOML: {exc}") from None
        config = config_io.apply_overrides(config, config_io.flatten_toml(doc, config, origin),
                                           origin)
    if overrides:
        config = config_io.apply_overrides(config, overrides, "the command line", from_cli=True)
    validate(config)
    return config


def to_toml(config: Config, comments: bool = True) -> str:
    """The config as TOML (docstrings as comments) that :func:`load_config` reads back equal."""
    return config_io.to_toml(config, comments)


# ----------------------------------------------------------------------------- checks


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
    ("optim.lr", lambda v: 0 <= v < math.inf, "a finite number >= 0"),
    ("optim.betas", lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.eps", _positive, "a positive number"),
    ("optim.weight_decay", _non_negative, "a number >= 0"),
    ("optim.warmup_steps", _non_negative, "an int >= 0"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
    ("optim.grad_clip", _non_negative, "a number >= 0 (0 disables clipping)"),
    ("parallel.nproc", _positive, "a positive int (local ranks)"),
    ("parallel.stage", lambda v: v in (0, 1, 2, 3), "a ZeRO stage in 0..3"),
    ("parallel.dp_replicate", _positive, "a positive int"),
    ("parallel.dp_shard", lambda v: v == -1 or v > 0, "a positive int or -1 (infer)"),
    ("parallel.prefetch", _non_negative, "an int >= 0"),
    ("parallel.backend", lambda v: v in ("auto", "gloo", "nccl"), "'auto', 'gloo' or 'nccl'"),
    ("parallel.timeout_s", _positive, "a positive number of seconds"),
    ("parallel.watchdog", lambda v: v in ("on", "debug", "off"), "'on', 'debug' or 'off'"),
    ("precision.param_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.reduce_dtype", lambda v: v in _DTYPES, "'fp32', 'bf16' or 'fp16'"),
    ("precision.loss_scale", _positive, "a positive number"),
    ("precision.loss_scale_growth_interval", _positive, "a positive int (steps)"),
    ("log.dir", lambda v: v.strip() != "", "a non-empty path"),
    ("checkpoint.interval", _non_negative, "an int >= 0 (steps; 0 disables saving)"),
    ("checkpoint.keep_last", _non_negative, "an int >= 0 (0 keeps all)"),
    ("checkpoint.resume", lambda v: v.strip() != "", "'auto', 'none' or a checkpoint path"),
]


def _get(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def validate(config: Config) -> None:
    """Check every value that can be judged without the model, data or world size.

    Raises:
        ValueError: naming the first offending key, its value and what was expected.
    """
    for key, ok, expected in _RULES:
        value = _get(config, key)
        if not ok(value):
            raise ValueError(f"{key} must be {expected}, got {value!r}")


def resolve_world(config: Config, world_size: int) -> Config:
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
    shard = par.dp_shard
    if shard == -1:
        if world_size % par.dp_replicate != 0:
            raise ValueError(f"parallel.dp_replicate={par.dp_replicate} does not divide the world "
                             f"size {world_size}; expected a divisor of {world_size}")
        shard = world_size // par.dp_replicate
    if par.dp_replicate * shard != world_size:
        raise ValueError(f"parallel.dp_replicate * parallel.dp_shard = {par.dp_replicate} * "
                         f"{shard} = {par.dp_replicate * shard}, expected the world size "
                         f"{world_size}")
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
