"""Checks that a run fits what it resumes from, and the fault spec, before any rank starts.

Called by :func:`shardwise.train.preflight.preflight`. A resume that cannot work (a missing
checkpoint, one saved from a model of another shape, or with another tokenizer's vocabulary)
ends the run with one line naming the value, instead of an error from every rank after the
model is built; the checkpoint itself is only read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

__all__ = ["check_resume", "check_fault_spec", "SHAPE_FIELDS"]

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


def check_resume(cfg: Any, model_cfg: Any) -> Path | None:
    """The checkpoint ``checkpoint.resume`` selects, checked against the model to build.

    Args:
        cfg: the run config (``checkpoint``, ``log.dir``, ``data``).
        model_cfg: the :class:`~shardwise.models.LlamaConfig` about to be built (its
            ``vocab_size`` from the tokenizer).

    Returns:
        The checkpoint folder, or None when the run starts fresh.

    Raises:
        ValueError: a missing or incomplete checkpoint, or one whose model differs in a
            shape field (named, with both values).
    """
    from shardwise.checkpoint import CheckpointError, resolve_resume
    from shardwise.checkpoint.atomic import read_manifest

    c = cfg.checkpoint
    if c.resume in ("", "none"):
        return None
    root = Path(c.dir or Path(cfg.log.dir) / "checkpoints").expanduser()
    try:
        path = resolve_resume(c.resume, root)
        if path is None:
            return None
        saved = read_manifest(path).get("model", {}).get("config", {})
    except CheckpointError as exc:
        raise ValueError(f"checkpoint.resume {c.resume!r}: {exc}") from None
    now = dataclasses.asdict(model_cfg)
    if "vocab_size" in saved and saved["vocab_size"] != now["vocab_size"]:
        raise ValueError(_vocab_message(cfg, path, saved["vocab_size"], now["vocab_size"]))
    diffs = [f"{k}={saved[k]!r} (this run: {now[k]!r})" for k in SHAPE_FIELDS
             if k in saved and k in now and saved[k] != now[k]]
    if diffs:
        raise ValueError(f"checkpoint {path} holds a model of another shape: "
                         f"{', '.join(diffs)}; expected the same model.* settings as the run "
                         "that saved it")
    return path


def check_fault_spec(environ: dict[str, str] | None = None) -> None:
    """Parse ``$SHARDWISE_FAULT`` now, so a typo fails before launch (see faults.py).

    Raises:
        ValueError: naming the bad part of the spec.
    """
    from shardwise.train.faults import ENV_VAR, parse_faults

    spec = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if spec.strip():
        parse_faults(spec)
