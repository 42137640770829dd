"""What a replica group keeps and records beyond the model: the state a group behind
copies from a peer, the group's journal, and who saves a checkpoint
([Note: what a step is under fault tolerance] in loop.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardwise.train.config import Config

__all__ = ["HealableState", "Journal", "CheckpointSaver"]


class HealableState:
    """What a group behind copies from a live one ([Note: what a step is under fault
    tolerance] in loop.py; [Note: healing across layouts] in heal.py): the model (parameters
    and buffers), the optimizer, the schedule, the data position, and the lineage.

    Attributes:
        healed: how often this process healed.
        lineage: the group's history ([Note: lineages] in combine.py), healed with the rest.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: Any, loader: Any) -> None:
        self.model, self.optimizer, self.schedule, self.loader = model, optimizer, schedule, loader
        self.healed = 0
        self.lineage = 0  # [Note: lineages] in combine.py


class Journal:
    """The group's record (rank 0 writes it): one JSON line per attempted step, flushed, so
    the launcher can tell what committed even when this process is killed next."""

    def __init__(self, path: Path | None) -> None:
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, **record: Any) -> None:
        """Append one record (rank 0 of the group; a no-op elsewhere)."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class CheckpointSaver:
    """``checkpoint.interval``: the committed step is saved by one group, the lowest id among
    its participants (they all hold the same state), collectively inside that group."""

    def __init__(self, ckpt: Any, cfg: Config, group: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, stateful: dict[str, Any]) -> None:
        from shardwise.train.resume_checks import RUN_KEY, run_record

        self.ckpt, self.cfg, self.group = ckpt, cfg, group
        self.model, self.optimizer = model, optimizer
        self.extra = {**stateful, RUN_KEY: run_record(cfg)}  # the whole job's batch

    def after_commit(self, step: int, ids: list[int]) -> None:
        """Save ``step`` if it is due and this group speaks for its participants."""
        interval = self.cfg.checkpoint.interval
        due = interval > 0 and (step % interval == 0 or step == self.cfg.train.steps)
        if due and ids and self.group == ids[0]:
            self.ckpt.save(step, self.model, self.optimizer, extra=self.extra)
