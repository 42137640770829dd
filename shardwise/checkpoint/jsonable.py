"""Lossless JSON for the small, non-tensor-sharded state a checkpoint carries: optimizer
hyper-parameters, LR schedules, loss scalers, data-loader positions, RNG states.

Plain JSON loses tuples, non-string keys, tensors and arrays; these are written as tagged
objects (``{"__tuple__": [...]}``, ``{"__tensor__": base64, "dtype", "shape"}``, ...) and come
back as they were. Floats are written with ``repr``, which round-trips exactly (inf and nan as
Python's JSON extensions). Nothing here executes code or imports anything on read.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from shardwise.sizes import nbytes

__all__ = ["encode", "decode", "MAX_TENSOR_BYTES"]

MAX_TENSOR_BYTES = 1 << 20
"""Largest tensor kept inline in JSON (RNG states are ~5 KB); larger ones belong in the
sharded tensor data."""

_TAGS = ("__tuple__", "__tensor__", "__ndarray__", "__bytes__", "__items__")


def encode(obj: Any, where: str = "extra") -> Any:
    """A JSON-serialisable form of ``obj``.

    Args:
        obj: nested dicts / lists / tuples of None, bool, int, float, str, bytes, small
            tensors and numpy arrays.
        where: the key path, for messages.

    Returns:
        The tagged JSON value (see the module docstring).

    Raises:
        ValueError: naming the key path of a value that cannot be stored (and its type).
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, where), encode(v, f"{where}[{k!r}]")]
                              for k, v in obj.items()]}
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, where)
    if type(obj).__module__ == "numpy" and hasattr(obj, "tobytes"):
        if getattr(obj, "shape", None) == ():
            return encode(obj.item(), where)
        return {"__ndarray__": base64.b64encode(obj.tobytes()).decode("ascii"),
                "dtype": str(obj.dtype), "shape": list(obj.shape)}
    raise ValueError(f"{where} = {obj!r} ({type(obj).__name__}) cannot be stored in a "
                     f"checkpoint; expected numbers, strings, lists, dicts or small tensors")


def _encode_tensor(t: torch.Tensor, where: str) -> dict:
    t = t.detach().to("cpu")
    size = nbytes(t)
    if size > MAX_TENSOR_BYTES:
        raise ValueError(f"{where} is a {tuple(t.shape)} tensor of {size} bytes; extra "
                         f"state keeps tensors up to {MAX_TENSOR_BYTES} bytes inline")
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"__tensor__": base64.b64encode(raw).decode("ascii"),
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _decode_tensor(obj: dict) -> torch.Tensor:
    dtype = getattr(torch, obj["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {obj['dtype']!r} in checkpoint state")
    raw = bytearray(base64.b64decode(obj["__tensor__"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(obj["shape"]).clone()


def decode(obj: Any) -> Any:
    """Invert :func:`encode` (numpy arrays need numpy installed)."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {decode(k): decode(v) for k, v in obj["__items__"]}
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    if "__tensor__" in obj:
        return _decode_tensor(obj)
    if "__ndarray__" in obj:
        import numpy as np

        flat = np.frombuffer(base64.b64decode(obj["__ndarray__"]), dtype=obj["dtype"])
        return flat.reshape(obj["shape"]).copy()
    return {k: decode(v) for k, v in obj.items()}
