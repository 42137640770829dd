"""Checks that a run fits what it resumes from, and the fault spec, before any rank starts.

Called by :func:`shardwise.train.preflight.preflight`. A resume that cannot work (a missing
checkpoint, one saved from a model of another shape, or with another tokenizer's vocabulary)
ends the run with one line naming the value, instead of an error from every rank after the
model is built; the checkpoint itself is only read.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["check_resume", "check_fault_spec", "SHAPE_FIELDS", "RUN_KEY", "run_record",
           "batch_change"]

# Model fields that decide tensor shapes: a checkpoint only loads into the same ones.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                "multiple_of", "ffn_dim_multiplier", "tie_embeddings", "num_experts",
                "num_shared_experts", "moe_ffn_dim", "moe_every", "moe_first_dense",
                "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")


def _vocab_message(cfg: Any, path: Path, saved: int, now: int) -> str:
    d = cfg.data
    tokenizer = (f"data.tokenizer 'bpe' with data.bpe_vocab_size={d.bpe_vocab_size}"
                 if d.tokenizer == "bpe" else f"data.tokenizer {d.tokenizer!r}")
    return (f"checkpoint {path} was trained with vocab_size={saved}, but {tokenizer} gives "
            f"{now} token ids; expected the tokenizer the checkpoint was trained with (or "
            "checkpoint.resume = 'none' to start fresh)")


def check_resume(cfg: Any, model_cfg: Any, verify: bool = False) -> Path | None:
    """The checkpoint ``checkpoint.resume`` selects, checked against the run to start.

    Args:
        cfg: the run config (``checkpoint``, ``log.dir``, ``data``, ``train``, degrees).
        model_cfg: the :class:`~shardwise.models.LlamaConfig` about to be built (its
            ``vocab_size`` from the tokenizer).
        verify: with ``resume = "auto"``, check every file of the candidates, newest first,
            and skip damaged ones with a warning ([Note: resuming past a damaged
            checkpoint] in shardwise/checkpoint/manager.py); False: the newest committed one
            (the ranks verify it together when they load).

    Returns:
        The checkpoint folder, or None when the run starts fresh.

    Raises:
        ValueError: a missing or incomplete checkpoint, every checkpoint damaged, one whose
            model differs in a shape field (named, with both values), or one at or beyond
            ``train.steps`` (nothing left to train).
    """
    from shardwise.checkpoint import CheckpointError, newest_intact, resolve_resume
    from shardwise.checkpoint.atomic import read_manifest

    c = cfg.checkpoint
    if c.resume in ("", "none"):
        return None
    root = Path(c.dir or Path(cfg.log.dir) / "checkpoints").expanduser()
    try:
        if c.resume == "auto" and verify:
            path, damaged = newest_intact(root)
            for bad, why in damaged:
                warnings.warn(f"checkpoint.resume auto: skipping {bad.name}, it is damaged "
                              f"({why}); resuming from "
                              f"{path.name if path else 'nothing'}", stacklevel=3)
            if path is None and damaged:
                raise ValueError(f"checkpoint.resume 'auto': every checkpoint under {root} is "
                                 f"damaged ({len(damaged)} checked, the newest: "
                                 f"{damaged[0][1]}); expected an intact one, or "
                                 f"checkpoint.resume 'none' to start over")
        else:
            path = resolve_resume(c.resume, root)
        if path is None:
            return None
        manifest = read_manifest(path)
    except CheckpointError as exc:
        raise ValueError(f"checkpoint.resume {c.resume!r}: {exc}") from None
    saved = manifest.get("model", {}).get("config", {})
    now = dataclasses.asdict(model_cfg)
    if "vocab_size" in saved and saved["vocab_size"] != now["vocab_size"]:
        raise ValueError(_vocab_message(cfg, path, saved["vocab_size"], now["vocab_size"]))
    diffs = [f"{k}={saved[k]!r} (this run: {now[k]!r})" for k in SHAPE_FIELDS
             if k in saved and k in now and saved[k] != now[k]]
    if diffs:
        raise ValueError(f"checkpoint {path} holds a model of another shape: "
                         f"{', '.join(diffs)}; expected the same model.* settings as the run "
                         "that saved it")
    step = manifest.get("step")
    if isinstance(step, int) and cfg.train.steps <= step:
        raise ValueError(f"train.steps={cfg.train.steps}: checkpoint {path} is at step {step} "
                         f"already, so nothing is left to train; expected train.steps > "
                         f"{step} (train.steps counts the run's steps from the start, the "
                         f"checkpoint's included)")
    note = batch_change(cfg, manifest.get("extra", {}).get(RUN_KEY), step)
    if note:
        warnings.warn(note, stacklevel=3)
    return path


RUN_KEY = "run"
"""The checkpoint extra the trainer records its batch under (:func:`run_record`)."""


def run_record(cfg: Any) -> dict[str, int]:
    """What a checkpoint records of the run's batch: sequences per optimizer step over all
    data-parallel ranks, their length, and how they were split."""
    par, t = cfg.parallel, cfg.train
    dp = par.dp_replicate * par.dp_shard
    return {"global_batch": dp * t.batch_size * t.grad_accum, "seq_len": cfg.data.seq_len,
            "data_ranks": dp, "batch_size": t.batch_size, "grad_accum": t.grad_accum}


def batch_change(cfg: Any, saved: dict[str, Any] | None, step: int | None) -> str | None:
    """The warning for a resume whose global batch differs from the checkpoint's run
    (None: the same, or a checkpoint that did not record it)."""
    if not isinstance(saved, dict) or "global_batch" not in saved:
        return None
    now = run_record(cfg)
    before = saved["global_batch"] * saved.get("seq_len", now["seq_len"])
    after = now["global_batch"] * now["seq_len"]
    if before == after:
        return None

    def words(r: dict[str, Any]) -> str:
        return (f"{r['global_batch']} sequences x {r.get('seq_len', '?')} tokens "
                f"({r.get('data_ranks', '?')} data ranks x train.batch_size "
                f"{r.get('batch_size', '?')} x train.grad_accum {r.get('grad_accum', '?')})")

    ratio = after / before
    return (f"checkpoint.resume: the checkpoint's run took a global batch of {words(saved)} "
            f"per step, this run takes {words(now)}: each step from {step} on sees {ratio:.3g}x "
            f"the tokens. The learning-rate schedule goes on by step (warmup and decay over "
            f"train.steps={cfg.train.steps} steps, optim.schedule_horizon "
            f"{cfg.optim.schedule_horizon!r}), so the remaining steps apply the same rates to "
            f"{ratio:.3g}x larger batches (a common rule scales the learning rate with the "
            f"batch: optim.lr); the data continues where the checkpoint left it")


def check_fault_spec(environ: dict[str, str] | None = None) -> None:
    """Parse ``$SHARDWISE_FAULT`` now, so a typo fails before launch (see faults.py).

    Raises:
        ValueError: naming the bad part of the spec.
    """
    from shardwise.train.faults import ENV_VAR, parse_faults

    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if spec.strip():
        parse_faults(spec)
