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
import os
from dataclasses import dataclass
from pathlib import Path

from shardwise.compat import tomllib
from shardwise.train.config import io as config_io
from shardwise.train.config.sections import (CommConfig, MoEConfig, OffloadConfig,
                                             ParallelConfig, PrecisionConfig, VLADataConfig)

__all__ = [
    "CommConfig", "OffloadConfig", "PrecisionConfig", "MoEConfig", "VLADataConfig",
    "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "ParallelConfig", "LogConfig",
    "CheckpointConfig", "Config", "load_config", "validate", "resolve_world", "check_output_dir",
    "to_toml",
    "all_keys", "PLAN_KEYS",
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
    num_experts: int | None = None
    """Override: routed experts per MoE feed-forward, 0 for dense (unset: named config's)."""
    top_k: int | None = None
    """Override: routed experts each token visits (unset: the named config's value)."""
    num_shared_experts: int | None = None
    """Override: always-on experts per MoE layer, DeepSeek style (unset: named config's)."""
    moe_ffn_dim: int | None = None
    """Override: hidden width of each expert in features (unset: the named config's value)."""
    moe_every: int | None = None
    """Override: MoE feed-forward in every n-th block, others dense (unset: named config's)."""
    router_score: str | None = None
    """Override: router scores, "softmax" or "sigmoid" (unset: the named config's value)."""
    freeze: tuple[str, ...] = ()
    """Submodules trained frozen, e.g. vision (a VLA's vision tower): no gradient, no
    reduction, no optimizer state."""


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
    """Sequences per micro-batch on each data-parallel rank (the tp and cp ranks of one data
    rank share them)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (global batch = batch_size * grad_accum
    * dp_replicate * dp_shard sequences; tp and cp do not multiply it)."""
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
    activation_checkpoint: str = "none"
    """Recompute activations in backward instead of keeping them: "none", "full" (each
    transformer block keeps only its input) or "selective" (blocks also keep matmul and
    attention outputs; norms, RoPE and activations are recomputed). Dense models only."""
    compile: bool = False
    """Compile each transformer block with torch.compile (one graph per block; the sharding
    engine's communication stays outside the graphs). Dense models only."""
    compile_backend: str = "inductor"
    """torch.compile backend when compile is true: "inductor" (generated kernels; needs a C++
    compiler on CPU, Triton on GPU), "aot_eager" (traced, no code generation) or "eager"."""
    sync_debug: str = "off"
    """On CUDA, torch.cuda.set_sync_debug_mode around each step's forward, backward, norm,
    clipping and optimizer step (not the step's one statistics read): "off", "warn" or
    "error" (a host sync there raises). For checking that a step never waits for the GPU."""


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
    schedule_horizon: str = "keep"
    """Resuming with another train.steps than the checkpoint's run: "keep" (the learning rate
    continues the schedule the checkpoint was trained with: resuming stays bitwise) or
    "extend" (re-plan warmup + cosine over the new train.steps)."""


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
    """Output folder: config.toml, metrics.jsonl, loss.png, summary.json (created if missing).
    Left at this default, a run never reuses a folder that holds an earlier run: it writes to
    runs/debug-2, runs/debug-3, ... instead; a folder you name must not hold a run (see
    overwrite and checkpoint.resume)."""
    overwrite: bool = False
    """Let this run replace the run already in log.dir (its config.toml, metrics, plot,
    summary, tb/ and <log.dir>/checkpoints are removed first); false: refuse such a folder."""
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
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    """Quantised communication and hierarchical partitions."""
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    """CPU / disk offload of optimizer state."""
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    """Mixture-of-experts routing and load balancing."""
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    """Outputs and progress display."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints, resuming and weight import."""
    vla: VLADataConfig = dataclasses.field(default_factory=VLADataConfig)
    """Vision-language-action demonstrations and evaluation (VLA models only)."""


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
    given: set[str] = set(overrides or {})
    if path is not None:
        origin = repr(str(path))
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"config file {origin} cannot be read: "
                             f"{exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {origin} is not valid TOML: {exc}") from None
        values = config_io.flatten_toml(doc, config, origin)
        given |= set(values)
        config = config_io.apply_overrides(config, values, origin)
    if overrides:
        config = config_io.apply_overrides(config, overrides, "the command line", from_cli=True)
    config = _derive_plan_fixed(config, given)
    validate(config)
    return config


def _value(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _derive_plan_fixed(config: Config, given: set[str]) -> Config:
    """With ``parallel.plan = "auto"`` and ``plan_fixed`` not given: the layout keys the
    user set in the TOML or on the command line become the planner's constraints."""
    par = config.parallel
    if par.plan != "auto" or "parallel.plan_fixed" in given:
        return config
    # dp_shard -1 ("the rest"), an unset sequence_parallel and pp_microbatches /
    # pp_virtual 0 ("the schedule's own") leave the planner free.
    free = {"parallel.dp_shard": -1, "parallel.sequence_parallel": None,
            "parallel.pp_microbatches": 0, "parallel.pp_virtual": 0}
    fixed = tuple(k for k in PLAN_KEYS if k in given
                  and not (k in free and _value(config, k) == free[k]))
    return dataclasses.replace(config, parallel=dataclasses.replace(par, plan_fixed=fixed))


def to_toml(config: Config, comments: bool = True) -> str:
    """The config as TOML (docstrings as comments) that :func:`load_config` reads back equal."""
    return config_io.to_toml(config, comments)


# The value checks live in checks.py (imported last: they read the dataclasses above).
from shardwise.train.config.checks import (PLAN_KEYS, check_output_dir,  # noqa: E402
                                           resolve_world, validate)
