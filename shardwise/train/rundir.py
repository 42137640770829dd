"""Which folder a run writes to: never silently over an earlier run.

A folder "holds a run" when it has any of a run's outputs (:data:`RUN_OUTPUTS`). Then:

* ``log.dir`` left at its default (``runs/debug``): this run takes the first free numbered
  sibling, ``runs/debug-2``, ``runs/debug-3``, ..., and says so, so running the quick start
  twice just works and keeps both runs;
* ``checkpoint.resume`` set (``auto`` or a path): the run continues the one in the folder;
* ``log.overwrite = true``: the earlier run's outputs are removed first (:func:`clear_run`);
* otherwise the run is refused before any rank starts, naming the folder and the ways on.

:func:`choose_log_dir` only reads (every rank of a torchrun job may call it); the launcher, or
rank 0, removes files in :func:`clear_run` once every rank agreed to start.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from shardwise.train.config import Config, LogConfig

__all__ = ["RUN_OUTPUTS", "DEFAULT_LOG_DIR", "run_outputs", "choose_log_dir", "clear_run",
           "renamed_note"]

#: What a run leaves in its folder (``checkpoints`` counts when it is not empty).
RUN_OUTPUTS = ("config.toml", "tokenizer.json", "metrics.jsonl", "loss.png", "summary.json", "tb",
               "checkpoints")
DEFAULT_LOG_DIR = LogConfig().dir


def run_outputs(folder: str | Path) -> list[str]:
    """The names of :data:`RUN_OUTPUTS` present in ``folder`` (empty: it holds no run)."""
    folder = Path(folder).expanduser()
    found = []
    for name in RUN_OUTPUTS:
        path = folder / name
        if name == "checkpoints":
            if path.is_dir() and any(path.iterdir()):
                found.append(name + "/")
        elif path.exists():
            found.append(name + "/" if path.is_dir() else name)
    return found


def choose_log_dir(cfg: Config) -> Config:
    """The config with the folder this run will write to as ``log.dir``.

    Args:
        cfg: a validated config.

    Returns:
        ``cfg`` itself, or a copy with ``log.dir`` set to a numbered sibling of the default
        folder when that holds an earlier run.

    Raises:
        ValueError: ``log.dir`` was named, holds a run, and neither ``log.overwrite`` nor
            ``checkpoint.resume`` says what to do with it.
    """
    found = run_outputs(cfg.log.dir)
    if not found or cfg.log.overwrite or cfg.checkpoint.resume != "none":
        return cfg
    if cfg.log.dir == DEFAULT_LOG_DIR:
        n = 2
        while run_outputs(f"{DEFAULT_LOG_DIR}-{n}"):
            n += 1
        return dataclasses.replace(cfg, log=dataclasses.replace(cfg.log,
                                                                dir=f"{DEFAULT_LOG_DIR}-{n}"))
    raise ValueError(f"log.dir {cfg.log.dir!r} already holds a run ({', '.join(found)}); "
                     "expected a folder without one: pass --log.overwrite true to replace that "
                     "run, --checkpoint.resume auto to continue it, or another --log.dir")


def renamed_note(requested: Config, cfg: Config) -> str | None:
    """The line that says a run was moved to a numbered folder (None when it was not)."""
    if requested.log.dir == cfg.log.dir:
        return None
    return (f"log.dir {requested.log.dir!r} holds an earlier run, so this run writes to "
            f"{cfg.log.dir!r} (--log.dir names a folder; --log.overwrite true reuses one)")


def clear_run(cfg: Config) -> list[str]:
    """Remove the earlier run's outputs from ``log.dir`` when ``log.overwrite`` is set.

    Only the files a run writes go: config.toml, tokenizer.json, metrics.jsonl (and the
    ``metrics.until-step-*.jsonl`` of older versions), loss.png, summary.json, tb/ and
    checkpoints/; anything else in the folder stays. Call it once per job (rank 0 or the
    launcher), after every rank agreed to start.

    Returns:
        The names removed (empty when there was nothing, or ``log.overwrite`` is false).
    """
    if not cfg.log.overwrite or cfg.checkpoint.resume != "none":
        return []
    folder = Path(cfg.log.dir).expanduser()
    removed = run_outputs(folder)
    for name in removed:
        path = folder / name.rstrip("/")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for old in sorted(folder.glob("metrics.until-step-*.jsonl")):
        old.unlink()
        removed.append(old.name)
    return removed
