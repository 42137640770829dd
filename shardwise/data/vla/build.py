"""Make a demonstration dataset: generate with the expert, write atomically, or reuse one.

    from shardwise.data.vla import ensure_dataset
    path = ensure_dataset("data/gotolocal-1k", "BabyAI-GoToLocal-v0", episodes=1000, seed=0)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from shardwise.data.vla.demos import TRAIN_SEED_BASE, check_train_seeds, generate_demos
from shardwise.data.vla.env import DEFAULT_TILE_SIZE
from shardwise.data.vla.store import INDEX_NAME, read_index, write_dataset
from shardwise.data.vla.tokens import MissionTokenizer

__all__ = ["BuildReport", "build_dataset", "ensure_dataset"]


@dataclasses.dataclass
class BuildReport:
    """What :func:`build_dataset` wrote.

    Attributes:
        path: the dataset directory.
        episodes, steps: counts written.
        bytes: bytes of the shard files.
        seconds: wall time of generating the episodes (the write excluded).
        expert_success: share of episodes the expert solved.
    """

    path: Path
    episodes: int
    steps: int
    bytes: int
    seconds: float
    expert_success: float

    @property
    def episodes_per_second(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else float("inf")


def build_dataset(out_dir: str | os.PathLike, level: str, episodes: int,
                  seed: int = TRAIN_SEED_BASE, tile_size: int = DEFAULT_TILE_SIZE,
                  shard_episodes: int = 256) -> BuildReport:
    """Generate ``episodes`` expert demonstrations of ``level`` (seeds ``seed, seed+1, ...``)
    and write them at ``out_dir`` (atomically; see ``store.write_dataset``).

    Raises:
        ValueError: bad level, counts or seeds; ``out_dir`` exists and is not empty.
        ImportError: minigrid is missing.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # before minutes of work
        raise ValueError(f"dataset directory {str(out)!r} already exists and is not empty")
    demos, seconds = generate_demos(level, episodes, seed, tile_size)
    index = write_dataset(out, demos, shard_episodes=shard_episodes,
                          meta={"level": level, "base_seed": seed, "tile_size": tile_size,
                                "seconds": round(seconds, 3)})
    return BuildReport(path=out, episodes=index["episodes"], steps=index["steps"],
                       bytes=index["bytes"], seconds=seconds,
                       expert_success=index["expert_success"])


def _mismatches(index: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [f"{key}={index.get(key)!r} (requested {value!r})"
            for key, value in wanted.items() if index.get(key) != value]


def ensure_dataset(path: str | os.PathLike, level: str, episodes: int,
                   seed: int = TRAIN_SEED_BASE, tile_size: int = DEFAULT_TILE_SIZE) -> Path:
    """The dataset at ``path``, generated first if it has no index yet (idempotent).

    Args:
        path: the dataset directory.
        level, episodes, seed, tile_size: what the dataset must hold (see
            :func:`build_dataset`).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: a dataset is there but was made for another level, episode count, seed,
            tile size or tokenizer vocabulary (the message lists the differences); bad
            arguments; ``path`` holds other files but no index.
        ImportError: minigrid is missing and the dataset must be generated.
    """
    out = Path(path)
    check_train_seeds(seed, episodes)
    if (out / INDEX_NAME).is_file():
        index = read_index(out)
        wrong = _mismatches(index, {"level": level, "episodes": episodes, "base_seed": seed,
                                    "tile_size": tile_size})
        if index["tokenizer"]["vocab_hash"] != MissionTokenizer().vocab_hash:
            wrong.append("tokenizer vocab_hash (written by another shardwise version)")
        if wrong:
            raise ValueError(f"dataset {str(out)!r} does not match the request: "
                             f"{'; '.join(wrong)}; use another directory or remove it")
        return out
    build_dataset(out, level, episodes, seed, tile_size)
    return out
