"""Everything that can fail on user input, checked before any rank trains.

``shardwise train`` runs :func:`preflight` in the launching process (local ranks) or on every
rank before the first training collective (torchrun / SLURM), so a bad value, an unwritable
output folder or a corpus that is too small ends the run with one line naming the value,
not a traceback from every rank.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.train.config import io as config_io
from shardwise.train.resume_checks import check_fault_spec, check_resume
from shardwise.train.config import Config, check_output_dir, resolve_world, to_toml
from shardwise.train.config.checks import check_model_combinations, check_sequence_split
from shardwise.train.context import validate_cp
from shardwise.train.metrics import require_tensorboard
from shardwise.train.rundir import choose_log_dir, clear_run, renamed_note
from shardwise.train.moe import check_moe
from shardwise.train.plan_layout import plan_group, plan_start
from shardwise.train.vla import (build_vla_data, check_vla, check_vla_data, is_vla,
                                 vla_model_config)
from shardwise.train.pipeline import bubble_warning, check_pipeline_config, check_pipeline_model

__all__ = ["TokenData", "build_model_config", "build_data", "preflight", "config_lines",
           "announce", "save_tokenizer"]


@dataclass(frozen=True)
class TokenData:
    """Tokenised corpus, split; built once and handed to every rank.

    Attributes:
        train_ids: 1-D int64 token ids of the training split.
        val_ids: 1-D int64 token ids of the held-out validation split.
        vocab_size: number of ids the tokenizer can produce.
        corpus_bytes: UTF-8 size of the corpus text.
        tokenizer_json: the tokenizer as the text of its ``save`` file (a BPE vocabulary and
            merges, or the byte tokenizer's marker), written into the run folder as
            ``tokenizer.json`` so ``shardwise generate`` reads it instead of training it again.
    """

    train_ids: torch.Tensor
    val_ids: torch.Tensor
    vocab_size: int
    corpus_bytes: int
    tokenizer_json: str = ""


def build_model_config(cfg: Config, vocab_size: int | None = None):  # -> LlamaConfig
    """The named model config with the ``[model]`` overrides applied, checked against the data.

    Args:
        cfg: the run config.
        vocab_size: the tokenizer's vocabulary size (None: keep the named config's).

    Returns:
        A :class:`shardwise.models.LlamaConfig`.

    Raises:
        ValueError: unknown model name or shape field, an invalid shape, or ``data.seq_len``
            longer than the model's ``max_seq_len``.
    """
    from shardwise.models import get_model_config, list_model_configs

    overrides = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)
                 if f.name not in ("name", "freeze") and getattr(cfg.model, f.name) is not None}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        if cfg.model.name in list_model_configs(multimodal=True) \
                and is_vla(base := get_model_config(cfg.model.name)):  # [model]: its decoder
            return vla_model_config(base, overrides)
        model_cfg = get_model_config(cfg.model.name, **overrides)
    except ValueError as exc:
        raise ValueError(f"model: {_planner_only(cfg.model.name) or exc}") from None
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds max_seq_len="
                         f"{model_cfg.max_seq_len} of model {cfg.model.name!r}; expected "
                         f"data.seq_len <= {model_cfg.max_seq_len}, or a larger model.max_seq_len")
    return model_cfg


def _planner_only(name: str) -> str | None:
    """Why ``name`` cannot be trained, when it is a shape only the planner's catalogue has
    (a published model ``shardwise.models`` cannot build), else None."""
    from shardwise.models import list_model_configs
    from shardwise.planner.catalogue import get_model_spec, planner_only_models

    if name not in planner_only_models():
        return None
    spec = get_model_spec(name)
    parts = [f"{spec.mlp} feed-forward", spec.norm, f"{spec.position} positions"]
    if spec.is_mla:
        parts.append("multi-head latent attention")
    if spec.n_experts:
        parts.append(f"{spec.n_experts} experts")
    return (f"{name!r} is a published shape the planner prices ({', '.join(parts)}) that "
            f"shardwise.models cannot build; price it with `shardwise plan --model {name}`, "
            f"or train one of the registry's models: {', '.join(list_model_configs())}")


def build_data(cfg: Config, world_size: int) -> TokenData:
    """Load the corpus, tokenize it, split off validation, check there is enough of both.

    Args:
        cfg: the run config (``data`` and ``train`` sections).
        world_size: ranks that will each take ``train.batch_size`` windows per micro-batch.

    Returns:
        The :class:`TokenData`.

    Raises:
        ValueError: a source with no text, or too few tokens for one global batch in either
            split (naming the source, the token counts and the batch that was asked for).
    """
    from shardwise.data import build_tokenizer, load_corpus, split_tokens

    d = cfg.data
    text = load_corpus(d.source, max_bytes=d.max_bytes)
    if not text.strip():
        raise ValueError(f"data.source {d.source!r} has no text (only whitespace); expected a "
                         "corpus with at least one global batch of tokens")
    try:
        if d.tokenizer == "bpe":
            tokenizer = build_tokenizer("bpe", vocab_size=d.bpe_vocab_size, text=text)
        else:
            tokenizer = build_tokenizer(d.tokenizer)
    except ImportError:
        raise ValueError(f"data.tokenizer = {d.tokenizer!r} needs the 'tokenizers' package, "
                         "which is not installed; run: pip install 'shardwise[bpe]' (or use "
                         "--data.tokenizer byte)") from None
    ids = tokenizer.encode(text)
    train_ids, val_ids = split_tokens(ids, val_fraction=d.val_fraction)
    # A window is seq_len inputs plus the next token as the last target.
    need = world_size * cfg.train.batch_size * (d.seq_len + 1)
    for split, split_ids in (("training", train_ids), ("validation", val_ids)):
        if split_ids.numel() < need:
            raise ValueError(
                f"data.source {d.source!r} is too small: its {split} split has "
                f"{split_ids.numel():,} tokens ({ids.numel():,} in all, val_fraction="
                f"{d.val_fraction}), fewer than one global batch of {world_size} ranks x "
                f"{cfg.train.batch_size} sequences x {d.seq_len + 1} tokens = {need:,}; "
                "expected more text, or a smaller train.batch_size / data.seq_len")
    return TokenData(train_ids, val_ids, tokenizer.vocab_size, len(text.encode("utf-8")),
                     _saved_text(tokenizer))


def _saved_text(tokenizer: Any) -> str:
    """What ``tokenizer.save`` writes, as text (a string travels to the ranks; the BPE
    backend object need not)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        tokenizer.save(path)
        return path.read_text(encoding="utf-8")


def save_tokenizer(cfg: Config, data: Any) -> Path | None:
    """Write the run's tokenizer as ``<log.dir>/tokenizer.json`` (rank 0 or the launcher,
    after :func:`announce`); None when ``data`` carries none (the VLA's episodes)."""
    text = getattr(data, "tokenizer_json", "")
    if not text:
        return None
    path = Path(cfg.log.dir) / "tokenizer.json"
    path.write_text(text, encoding="utf-8")
    return path


def preflight(cfg: Config, world_size: int, verify_checkpoint: bool = True
              ) -> tuple[Config, TokenData]:
    """Every check that depends on user input, run before any rank trains.

    Args:
        cfg: a validated config (:func:`shardwise.train.config.load_config`).
        world_size: ranks in the job.
        verify_checkpoint: with ``checkpoint.resume = "auto"``, check every file of the
            newest checkpoints here and resume from the newest intact one (pinned in the
            returned config); False (one rank of a torchrun job, where every rank runs this):
            the ranks verify together when they load.

    Returns:
        The config with world-dependent values resolved (``parallel.dp_shard``, and
        ``log.dir`` when the default folder holds an earlier run: see
        :mod:`shardwise.train.rundir`), and the prepared data.

    Raises:
        ValueError: degrees that do not fit the world size, NCCL without CUDA, a named
            ``log.dir`` that holds an earlier run, an unwritable ``log.dir``, an offload
            directory that is missing or read-only,
            TensorBoard asked for but missing, a bad model name / shape / seq_len, a corpus
            with no or too little text, a bad ``$SHARDWISE_FAULT``, a ``checkpoint.resume``
            that is missing or was saved from another model shape or vocabulary, ``[moe]``
            settings for a model without MoE layers, heads / vocabulary / widths not
            divisible by ``parallel.tp``, ``parallel.ep`` for a dense model or not dividing
            the number of experts, compile or activation checkpointing with an MoE model, a
            pipeline the model or the config cannot take, ``data.seq_len`` not cut into
            ``parallel.cp``'s equal chunks, a ``parallel.cp_impl`` the key/value heads cannot
            take, context parallelism with multi-head latent attention.
    """
    cfg = resolve_world(cfg, world_size)  # the layout first, then the shapes against it
    if cfg.parallel.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend = 'nccl' needs CUDA, which is not available here; "
                         "expected 'gloo' or 'auto'")
    model_cfg = build_model_config(cfg)  # cheap shape / seq_len / [moe] checks first
    vla = is_vla(model_cfg)
    shape = model_cfg.decoder if vla else model_cfg  # the decoder's checks, for a VLA too
    if vla:
        check_vla(cfg, model_cfg)
        if cfg.parallel.sequence_parallel is None:  # samples of different lengths: off
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
                cfg.parallel, sequence_parallel=False))
    check_sequence_split(cfg)  # after a VLA's sequence parallelism is resolved (off)
    check_moe(cfg, shape)
    check_model_combinations(cfg, shape)
    check_pipeline_config(cfg)
    check_pipeline_model(cfg, shape)
    check_fault_spec()
    if cfg.log.tensorboard:
        require_tensorboard()
    cfg = choose_log_dir(cfg)
    check_output_dir(cfg.log.dir)
    from shardwise.train.parallelize import validate_offload  # the engine's directory check
    validate_offload(cfg)
    if vla:  # demonstrations made once, here, before any rank starts
        data = build_vla_data(cfg)
    else:
        data = build_data(cfg, cfg.parallel.dp_replicate * cfg.parallel.dp_shard)
    model_cfg = build_model_config(cfg, data.vocab_size)
    shape = model_cfg.decoder if vla else model_cfg
    if vla:
        check_vla_data(cfg, data, model_cfg)
    # --parallel.plan auto: the planner's layout (same global batch), then the checks below.
    # Under fault tolerance each replica group plans its own ranks as it starts (a group
    # may come back smaller): checked here for the groups' full size.
    if cfg.parallel.fault_tolerant:
        plan_group(cfg, model_cfg, cfg.parallel.dp_shard, cfg.parallel.dp_shard)
    else:
        cfg = plan_start(cfg, model_cfg, world_size)
    from shardwise.train.parallelize import validate_ep, validate_tp  # degrees vs the shape
    validate_tp(cfg, shape, world_size)
    validate_ep(cfg, shape)
    validate_cp(cfg, shape)
    resume = check_resume(cfg, model_cfg, verify=verify_checkpoint)
    if resume is not None and cfg.checkpoint.resume == "auto" and verify_checkpoint:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, resume=str(resume)))  # the ranks load what was verified here
    idle = bubble_warning(cfg)  # after the planner: its micro-batches are the run's
    if idle:
        warnings.warn(idle, stacklevel=2)
    return cfg, data


def config_lines(cfg: Config) -> list[str]:
    """What the start of a run prints about its config: the keys that differ from the
    defaults (the defaults resolved for the same world size), and where the full file is."""
    world = cfg.parallel.dp_replicate * cfg.parallel.dp_shard * cfg.parallel.pp
    base = resolve_world(Config(), world) if world > 0 else Config()
    changed = config_io.differences(cfg, base)
    path = Path(cfg.log.dir) / "config.toml"
    if not changed:
        return [f"config: the defaults; every key in {path}"]
    return [f"config: every key in {path}; not the default:",
            *(f"  {key} = {config_io.to_toml_value(value)}" for key, value in changed)]


def announce(cfg: Config, requested: Config | None = None) -> Path:
    """Rank 0's start of a run: say where it writes, clear the earlier run when
    ``log.overwrite`` asks for it, print the non-default config keys and save the whole
    config as ``<log.dir>/config.toml``.

    Args:
        cfg: the config :func:`preflight` returned.
        requested: the config before :func:`preflight` (to say when ``log.dir`` moved to a
            numbered folder); None: nothing to compare.

    Returns:
        The saved file, loadable again with ``--config``.
    """
    note = renamed_note(requested, cfg) if requested is not None else None
    if note:
        print(note, flush=True)
    removed = clear_run(cfg)
    if removed:
        print(f"log.overwrite: removed the earlier run's {', '.join(removed)} from "
              f"{cfg.log.dir}", flush=True)
    print("\n".join(config_lines(cfg)), flush=True)
    path = Path(cfg.log.dir) / "config.toml"
    path.write_text(to_toml(cfg), encoding="ascii")
    return path
