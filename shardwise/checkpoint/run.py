"""Checkpoint glue for a training loop: resume (or import weights) at the start.

The trainer (shardwise.train.trainer) reads its ``[checkpoint]`` section and calls these; any
other loop can too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["resume_or_import", "keep_old_metrics"]


def keep_old_metrics(log_dir: str | os.PathLike, step: int) -> Path | None:
    """Before a resumed run truncates ``metrics.jsonl``, keep its records up to ``step`` in
    ``metrics.until-step-<step>.jsonl`` (rank 0's job).

    Returns:
        The file written, or None when there was no log.
    """
    old = Path(log_dir) / "metrics.jsonl"
    if not old.exists():
        return None
    lines = [ln for ln in old.read_text(encoding="ascii").splitlines()
             if ln.strip() and json.loads(ln).get("step", 0) <= step]
    kept = Path(log_dir) / f"metrics.until-step-{step}.jsonl"
    kept.write_text("".join(ln + "\n" for ln in lines), encoding="ascii")
    return kept


def resume_or_import(ckpt: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stateful: dict[str, Any], *, resume: str, import_path: str,
                     log_dir: str | os.PathLike, is_main: bool) -> tuple[int, str | None]:
    """Resume from ``resume`` (model, optimizer, ``stateful`` objects, RNG), else import
    Hugging Face safetensors from ``import_path`` (if set), else nothing (collective).

    Args:
        ckpt: the run's :class:`~shardwise.checkpoint.Checkpointer`.
        model, optimizer: as built for training.
        stateful: ``{"schedule": ..., "scaler": ..., "loader": ...}``, restored in place.
        resume: ``"auto"``, ``"none"`` or a checkpoint folder.
        import_path: safetensors file or folder ("" for none); ignored when resuming.
        log_dir: the run's output folder (old metrics are kept, see :func:`keep_old_metrics`).
        is_main: this is rank 0.

    Returns:
        ``(steps already done, a line saying what happened, or None)``.

    Raises:
        CheckpointError: an unusable checkpoint or weights file (named).
    """
    info = ckpt.load(resume, model, optimizer, extra=stateful)
    if info is not None:
        if is_main:
            keep_old_metrics(log_dir, info.step)
        saved = info.layout
        how = (f" (resharded from {saved['world_size']} rank(s), stage {saved['stage']}; RNG "
               f"states not restored)" if info.resharded else "")
        return info.step, f"resumed from {info.path} at step {info.step}{how}"
    if import_path:
        from shardwise.checkpoint.export import import_safetensors

        names = import_safetensors(import_path, model)
        return 0, f"imported {len(names)} tensors from {import_path}"
    return 0, None
