"""Sources of streamed weights: one :class:`Source` (name -> :class:`TensorEntry`) from a
safetensors file or folder (Hugging Face names, as ``shardwise checkpoint export`` writes
them, or our own names), a DCP step folder (dcp_source.py) or the quantised store (store.py).

Only headers and indexes are read here; no tensor data. The safetensors header is parsed by
hand (8-byte little-endian length, then JSON) because the reads that follow are ``preadv``
into our own buffers at the header's offsets, which the ``safetensors`` package does not do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import hf
from shardwise.inference.weights.dcp_source import dcp_source
from shardwise.inference.weights.layout import Piece, Source, TensorEntry
from shardwise.inference.weights.store import STORE_INDEX, store_source

__all__ = ["open_source", "safetensors_source", "ST_DTYPES"]

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_HF_INDEX = "model.safetensors.index.json"


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset its data starts at."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        header = json.loads(f.read(n))
    return header, 8 + n


def _files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    index = src / _HF_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({src / f for f in weight_map.values()})
    found = sorted(src.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{src} holds no {_HF_INDEX} and no .safetensors file")
    return found


def _is_hf(names: list[str]) -> bool:
    return any(hf.our_name(n) is not None or hf.expert_source(n) is not None for n in names)


def _hf_piece(fqn: str, path: str, offset: int, nbytes: int, shape: tuple[int, ...],
              config: dict[str, Any] | None) -> Piece:
    heads = hf.permuted_heads(fqn, config) if config is not None else None
    if heads is None and hf.permuted_heads(fqn, {"n_heads": 1, "n_kv_heads": 1}):
        raise ValueError(f"{path}: {fqn} is stored in Hugging Face's rotate-half order; "
                         f"reading it needs the model config (n_heads, n_kv_heads)")
    return Piece(path, offset, nbytes, (0,) * len(shape), shape, hf_heads=heads)


def safetensors_source(src: str | os.PathLike, config: dict[str, Any] | None = None) -> Source:
    """The tensors of a safetensors file or folder, in our names and layout.

    Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) are mapped to ours and
    ``wq`` / ``wk`` read through the RoPE row permutation; Mixtral's per-expert tensors
    become pieces of our stacked expert tensors (transposed as stored).

    Args:
        src: a ``.safetensors`` file, or a folder with ``model.safetensors.index.json`` or
            ``.safetensors`` files.
        config: the model config as a dict (needs ``n_heads``, ``n_kv_heads`` for HF
            names); default: the folder's ``config.json`` read by hf.config_from_hf.

    Returns:
        The :class:`Source`.

    Raises:
        ValueError: no safetensors file, a tensor whose HF name has no shardwise name, or
            an unknown dtype.
    """
    src = Path(src)
    folder = src if src.is_dir() else src.parent
    if config is None and (folder / "config.json").exists():
        import dataclasses

        cfg = hf.config_from_hf(json.loads((folder / "config.json").read_text()))
        config = dataclasses.asdict(cfg)
    headers = [(p, *_header(p)) for p in _files(src)]
    names = [n for _, h, _ in headers for n in h if n != "__metadata__"]
    hf_names = _is_hf(names)
    entries: dict[str, TensorEntry] = {}
    experts: dict[str, list[tuple[int, Piece, torch.dtype]]] = {}
    for path, header, start in headers:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']!r}, expected "
                                 f"one of {sorted(ST_DTYPES)}")
            shape = tuple(info["shape"])
            a, b = info["data_offsets"]
            if hf_names and hf.expert_source(name) is not None:
                fqn, j = hf.expert_source(name)
                piece = Piece(str(path), start + a, b - a, (j, 0, 0), (1, *shape), (0, 2, 1))
                experts.setdefault(fqn, []).append((j, piece, dtype))
                continue
            fqn = hf.our_name(name) if hf_names else name
            if fqn is None:
                raise ValueError(f"{path}: tensor {name} has no shardwise name")
            piece = (_hf_piece(fqn, str(path), start + a, b - a, shape, config) if hf_names
                     else Piece(str(path), start + a, b - a, (0,) * len(shape), shape))
            entries[fqn] = TensorEntry(fqn, shape, dtype, (piece,))
    for fqn, parts in experts.items():
        parts.sort(key=lambda x: x[0])
        if [j for j, _, _ in parts] != list(range(len(parts))):
            raise ValueError(f"{src}: the experts of {fqn} are not numbered 0..{len(parts) - 1}")
        ffn, dim = parts[0][1].file_shape[1:]
        entries[fqn] = TensorEntry(fqn, (len(parts), dim, ffn), parts[0][2],
                                   tuple(p for _, p, _ in parts))
    return Source("hf-safetensors" if hf_names else "safetensors", src, entries, config,
                  [str(p) for p, _, _ in headers])


def open_source(src: str | os.PathLike, config: dict[str, Any] | None = None) -> Source:
    """Open whatever checkpoint ``src`` is: the quantised store (``quantized.json``), a DCP
    step folder (``.metadata``), or safetensors.

    Args:
        src: the path.
        config: the model config as a dict (for Hugging Face names; see
            :func:`safetensors_source`).

    Returns:
        The :class:`Source`.

    Raises:
        ValueError: a path that does not exist or is none of these.
    """
    src = Path(src)
    if not src.exists():
        raise ValueError(f"weights source {src} does not exist")
    if src.is_dir() and (src / STORE_INDEX).exists():
        return store_source(src)
    if src.is_dir() and (src / ".metadata").exists():
        return dcp_source(src)
    return safetensors_source(src, config)

