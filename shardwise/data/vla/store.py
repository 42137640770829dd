"""Demonstrations on disk: a directory of safetensors shards and one JSON index.

::

    DIR/index.json                       level, seeds, episodes, steps, frame shape,
                                         tokenizer vocabulary hash, shardwise version,
                                         per episode: seed, mission, shard, offset, length
    DIR/shard-00000.safetensors          frames (S, H, W, 3) uint8, actions (S,) int64,
    DIR/shard-00001.safetensors ...      rewards (S,) float32, dones (S,) uint8

A shard holds whole episodes, their steps concatenated.

[Note: atomic dataset] The dataset is built in a hidden sibling directory
(``.DIR.partial-...``), ``index.json`` written last, and the directory renamed onto ``DIR``
in one step; an interrupted write leaves no ``DIR`` (and a crash at worst a ``.partial``
directory that nothing reads), so a directory with an index is always complete.

Reading opens shards lazily with safetensors' memory-mapped ``safe_open`` and copies only
the frames a sample needs.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.data.vla.demos import Episode
from shardwise.data.vla.env import ACTION_NAMES
from shardwise.data.vla.tokens import MissionTokenizer

__all__ = ["INDEX_NAME", "FORMAT", "FORMAT_VERSION", "write_dataset", "read_index",
           "VLADataset"]

INDEX_NAME = "index.json"
FORMAT = "shardwise.vla-demos"
FORMAT_VERSION = 1


def _shardwise_version() -> str:
    try:
        return metadata.version("shardwise")
    except metadata.PackageNotFoundError:  # a source tree run without installing
        return "unknown"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask_mode(path: Path) -> None:
    # safetensors creates its file 0600; a dataset is shared like any file the user writes.
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def _write_shard(path: Path, episodes: list[Episode]) -> int:
    from safetensors.numpy import save_file

    save_file({"frames": np.concatenate([e.frames for e in episodes]),
               "actions": np.concatenate([e.actions for e in episodes]).astype(np.int64),
               "rewards": np.concatenate([e.rewards for e in episodes]).astype(np.float32),
               "dones": np.concatenate([e.dones for e in episodes]).astype(np.uint8)},
              str(path))
    _umask_mode(path)
    _fsync(path)
    return path.stat().st_size


def _index(episodes: list[Episode], shards: list[dict[str, Any]], meta: dict[str, Any],
           placement: list[tuple[int, int]]) -> dict[str, Any]:
    tok = MissionTokenizer()
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, **meta,
        "episodes": len(episodes), "steps": sum(e.num_steps for e in episodes),
        "frame_shape": list(episodes[0].frames.shape[1:]),
        "action_names": list(ACTION_NAMES),
        "expert_success": sum(e.success for e in episodes) / len(episodes),
        "tokenizer": {"vocab_size": tok.vocab_size, "vocab_hash": tok.vocab_hash},
        "shardwise_version": _shardwise_version(),
        "bytes": sum(s["bytes"] for s in shards), "shards": shards,
        "seeds": [e.seed for e in episodes],
        "missions": [e.mission for e in episodes],
        "lengths": [e.num_steps for e in episodes],
        "success": [e.success for e in episodes],
        "shard_of": [p[0] for p in placement], "offset": [p[1] for p in placement],
    }


def write_dataset(out_dir: str | os.PathLike, episodes: list[Episode], *,
                  meta: dict[str, Any], shard_episodes: int = 256) -> dict[str, Any]:
    """Write ``episodes`` once, atomically, as a sharded dataset at ``out_dir``
    ([Note: atomic dataset]).

    Args:
        out_dir: the dataset directory; must not exist or be an empty directory.
        episodes: the demonstrations (all frames of one shape).
        meta: recorded in the index as given (the generator's ``level``, ``base_seed``,
            ``tile_size``, ``seconds``).
        shard_episodes: episodes per shard file. Default 256.

    Returns:
        The index that was written.

    Raises:
        ValueError: ``out_dir`` exists and is not an empty directory; no episodes; frame
            shapes differ; ``shard_episodes`` < 1.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"dataset directory {str(out)!r} already exists and is not empty")
    if not episodes:
        raise ValueError("no episodes to write")
    if len({e.frames.shape[1:] for e in episodes}) != 1:
        raise ValueError(f"episodes have different frame shapes "
                         f"{sorted({e.frames.shape[1:] for e in episodes})}")
    if isinstance(shard_episodes, bool) or not isinstance(shard_episodes, int) \
            or shard_episodes < 1:
        raise ValueError(f"shard_episodes must be a positive int, got {shard_episodes!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        shards, placement = [], []
        for k, first in enumerate(range(0, len(episodes), shard_episodes)):
            chunk = episodes[first:first + shard_episodes]
            name = f"shard-{k:05d}.safetensors"
            offset = 0
            for e in chunk:
                placement.append((k, offset))
                offset += e.num_steps
            shards.append({"file": name, "steps": offset, "episodes": len(chunk),
                           "bytes": _write_shard(tmp / name, chunk)})
        index = _index(episodes, shards, meta, placement)
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        _fsync(tmp / INDEX_NAME)
        if out.exists():
            out.rmdir()  # empty (checked above): rename needs the name free
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The index of the dataset at ``path``.

    Raises:
        ValueError: no index there (missing or incomplete dataset), or it is not a
            shardwise VLA dataset of a version this code reads.
    """
    file = Path(path) / INDEX_NAME
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is not a complete VLA dataset: no {INDEX_NAME} "
                         "(write it with `shardwise data vla` or ensure_dataset)")
    index = json.loads(file.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{str(file)!r} has format {index.get('format')!r} version "
                         f"{index.get('format_version')!r}; expected {FORMAT!r} version "
                         f"{FORMAT_VERSION}")
    return index


class VLADataset:
    """Read access to a dataset written by :func:`write_dataset`; shards open on first use.

    Args:
        path: the dataset directory.

    Raises:
        ValueError: see :func:`read_index`; the index's tokenizer hash differs from this
            version's :class:`MissionTokenizer` (the word ids would mean other words); a
            shard file is missing.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.index = read_index(self.path)
        mine = MissionTokenizer().vocab_hash
        if self.index["tokenizer"]["vocab_hash"] != mine:
            raise ValueError(f"dataset {str(self.path)!r} was written with tokenizer vocab "
                             f"hash {self.index['tokenizer']['vocab_hash']!r}, this version "
                             f"has {mine!r}: regenerate the dataset")
        for shard in self.index["shards"]:
            if not (self.path / shard["file"]).is_file():
                raise ValueError(f"dataset {str(self.path)!r} lacks shard {shard['file']!r}")
        self._handles: dict[int, Any] = {}
        self._actions: dict[int, np.ndarray] = {}

    @property
    def num_episodes(self) -> int:
        return int(self.index["episodes"])

    @property
    def num_steps(self) -> int:
        return int(self.index["steps"])

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        """``(H, W, 3)`` of the stored frames."""
        return tuple(self.index["frame_shape"])  # type: ignore[return-value]

    @property
    def seeds(self) -> list[int]:
        return list(self.index["seeds"])

    @property
    def lengths(self) -> list[int]:
        """Time steps of each episode."""
        return list(self.index["lengths"])

    def mission(self, episode: int) -> str:
        return self.index["missions"][episode]

    def _handle(self, shard: int) -> Any:
        if shard not in self._handles:
            from safetensors import safe_open

            self._handles[shard] = safe_open(
                str(self.path / self.index["shards"][shard]["file"]), framework="np")
        return self._handles[shard]

    def frames(self, episode: int, start: int, stop: int) -> np.ndarray:
        """Frames ``[start, stop)`` of ``episode``: ``(stop - start, H, W, 3)`` uint8."""
        if not 0 <= start <= stop <= self.lengths[episode]:
            raise ValueError(f"frames [{start}, {stop}) out of range for episode {episode} of "
                             f"length {self.lengths[episode]}")
        if start == stop:  # safetensors refuses an empty slice at a tensor's end
            return np.zeros((0, *self.frame_shape), np.uint8)
        shard, offset = self.index["shard_of"][episode], self.index["offset"][episode]
        return self._handle(shard).get_slice("frames")[offset + start:offset + stop]

    def action(self, episode: int, t: int) -> int:
        """The expert's action at step ``t`` of ``episode``."""
        shard, offset = self.index["shard_of"][episode], self.index["offset"][episode]
        if shard not in self._actions:  # small: the whole shard's column at once
            self._actions[shard] = self._handle(shard).get_tensor("actions")
        return int(self._actions[shard][offset + t])

    def episode(self, episode: int) -> Episode:
        """The whole stored ``episode`` as an :class:`Episode`."""
        shard, offset = self.index["shard_of"][episode], self.index["offset"][episode]
        n = self.lengths[episode]
        h = self._handle(shard)
        return Episode(seed=self.seeds[episode], mission=self.mission(episode),
                       frames=self.frames(episode, 0, n),
                       actions=h.get_slice("actions")[offset:offset + n].astype(np.int64),
                       rewards=h.get_slice("rewards")[offset:offset + n].astype(np.float32),
                       dones=h.get_slice("dones")[offset:offset + n].astype(bool),
                       success=bool(self.index["success"][episode]))

    def __repr__(self) -> str:
        return (f"VLADataset({str(self.path)!r}, level={self.index.get('level')!r}, "
                f"episodes={self.num_episodes}, steps={self.num_steps})")
