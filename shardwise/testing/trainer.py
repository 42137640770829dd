"""Harnesses shared by the tests of the trainer and the ``shardwise`` command: dotted
config values as command-line arguments, a refused command's one line, one rank's
training and several runs' in one launch of ranks (module-level, so
:func:`shardwise.testing.run_ranks` can pickle them), and what a run logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["cli_args", "refused", "train_rank", "train_runs", "logged"]


def cli_args(values: dict[str, str]) -> list[str]:
    """``{"train.steps": "4"}`` -> ``["--train.steps", "4"]``."""
    return [a for k, v in values.items() for a in (f"--{k}", v)]


def refused(capsys, *args: str) -> str:
    """Run ``shardwise train ARGS`` in this process; assert it is refused with exit code 2
    and one line ``shardwise: error: ...`` on stderr; return the message after the prefix."""
    from shardwise.train.cli import main

    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), err
    return lines[0].removeprefix("shardwise: error: ")


def train_rank(cfg: Any, data: Any) -> None:
    """One rank of a run prepared by ``preflight`` (what ``shardwise train``'s ranks do,
    re-planning aside)."""
    from shardwise.train.trainer import build_env, train

    train(cfg, data, build_env(cfg))


def train_runs(runs: list) -> None:
    """One rank of several runs, each ``(cfg, data)`` prepared by ``preflight`` for the same
    world size, trained in turn on one process group: a grid of layouts costs one launch of
    ranks instead of one per run."""
    from shardwise.train.trainer import build_env, train

    env = build_env(runs[0][0])
    for cfg, data in runs:
        train(cfg, data, env)


def logged(log_dir: str | Path, key: str = "loss", name: str = "metrics.jsonl") -> list[dict]:
    """The records of ``<log_dir>/<name>`` that hold ``key``."""
    lines = (Path(log_dir) / name).read_text().splitlines()
    return [r for r in map(json.loads, lines) if key in r]
