"""Checkpoint glue for a training loop: resume (or import weights) at the start.

The trainer (shardwise.train.trainer) reads its ``[checkpoint]`` section and calls these; any
other loop can too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["resume_or_import"]


def resume_or_import(ckpt: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stateful: dict[str, Any], *, resume: str,
                     import_path: str) -> tuple[int, str | None]:
    """Resume from ``resume`` (model, optimizer, ``stateful`` objects, RNG), else import
    Hugging Face safetensors from ``import_path`` (if set), else nothing (collective).

    Args:
        ckpt: the run's :class:`~shardwise.checkpoint.Checkpointer`.
        model, optimizer: as built for training.
        stateful: ``{"schedule": ..., "scaler": ..., "loader": ...}``, restored in place.
        resume: ``"auto"``, ``"none"`` or a checkpoint folder.
        import_path: safetensors file or folder ("" for none); ignored when resuming.

    Returns:
        ``(steps already done, a line saying what happened, or None)``.

    Raises:
        CheckpointError: an unusable checkpoint or weights file (named).
    """
    info = ckpt.load(resume, model, optimizer, extra=stateful)
    if info is not None:
        saved = info.layout
        tp = "".join(f", {axis} {saved[axis]}" for axis in ("cp", "tp", "ep")
                     if saved.get(axis, 1) > 1)
        how = (f" (resharded from {saved['world_size']} rank(s), stage {saved['stage']}{tp}; "
               f"RNG states not restored)" if info.resharded else "")
        return info.step, f"resumed from {info.path} at step {info.step}{how}"
    if import_path:
        from shardwise.checkpoint.export import import_safetensors

        names = import_safetensors(import_path, model)
        return 0, f"imported {len(names)} tensors from {import_path}"
    return 0, None
