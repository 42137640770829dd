"""``quantize_checkpoint``: write the quantised store (store.py, [Note: what is quantised])
of any streamed-weights source, one tensor at a time, atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.atomic import commit, staging_path
from shardwise.inference.weights.layout import FileSet, Source, TensorEntry, read_entry
from shardwise.inference.weights.sources import open_source
from shardwise.inference.weights.store import _LAYER, STORE_FORMAT, STORE_INDEX, unit_of
from shardwise.quant.codecs import check_block_size, check_kind, pack, quantize

__all__ = ["quantize_checkpoint"]

_ALIGN = 64


def _quantised(name: str, shape: tuple[int, ...]) -> bool:
    """[Note: what is quantised]."""
    return (unit_of(name) in ("head",) or unit_of(name).startswith("layers.")) and \
        len(shape) >= 2 and ".router." not in name


def _order(name: str) -> tuple:
    unit = unit_of(name)
    m = _LAYER.match(name)
    rank = {"embedding": (0, 0), "head": (2, 0), "resident": (3, 0)}.get(unit)
    return (rank or (1, int(m.group(1))), name)


def _read_full(files: FileSet, entry: TensorEntry) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=entry.dtype)
    need = entry.staging_bytes(entry.dtype)
    read_entry(files, entry, out, torch.empty(need, dtype=torch.uint8) if need else None)
    return out


def _write_units(source: Source, stage: Path, kind: str, block_size: int) -> dict[str, Any]:
    """Write one ``<unit>.bin`` per unit; return the per-tensor index."""
    files, tensors = FileSet(), {}
    handles: dict[str, Any] = {}
    try:
        for name in sorted(source.entries, key=_order):
            entry = source.entries[name]
            unit = unit_of(name)
            if unit not in handles:
                handles[unit] = open(stage / f"{unit}.bin", "wb")
            f = handles[unit]
            f.write(b"\0" * (-f.tell() % _ALIGN))
            t = _read_full(files, entry)
            codec = kind if _quantised(name, entry.shape) and t.is_floating_point() else None
            data = pack(quantize(t, kind, block_size)) if codec else t.contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().data
            tensors[name] = {"file": f"{unit}.bin", "offset": f.tell(), "nbytes": raw.nbytes,
                             "shape": list(entry.shape),
                             "dtype": str(entry.dtype).removeprefix("torch."), "codec": codec}
            f.write(raw)
    finally:
        for f in handles.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        files.close()
    return tensors


def quantize_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, *,
                        kind: str = "int8", block_size: int = 256,
                        config: dict[str, Any] | None = None) -> Path:
    """Write the quantised store of a checkpoint ([Note: what is quantised]).

    Reads one tensor at a time from the source (peak memory about three copies of the
    largest tensor) and writes the folder atomically.

    Args:
        source: a DCP step folder, safetensors file or folder (as
            :func:`~shardwise.inference.weights.sources.open_source` takes).
        out_dir: the store's folder (replaced if it exists).
        kind: "int8" or "int4" (default "int8").
        block_size: elements per codec block (default 256).
        config: the model config as a dict, for Hugging Face names without config.json.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: a bad ``kind`` or ``block_size``, or an unreadable source.
    """
    check_kind(kind, ("int8", "int4"), "quantize_checkpoint kind")
    check_block_size(block_size)
    src = open_source(source, config)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_path(out)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    tensors = _write_units(src, stage, kind, block_size)
    index = {"format": STORE_FORMAT, "version": 1, "kind": kind, "block_size": block_size,
             "source": str(source), "config": src.config or config, "tensors": tensors}
    with open(stage / STORE_INDEX, "w", encoding="ascii") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    commit(stage, out)
    return out
