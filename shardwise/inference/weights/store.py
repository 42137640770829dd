"""The quantised weights store: block linears as packed int8 / int4 codec bytes, one file
per streamed unit so that a unit is one sequential read.

    quantize_checkpoint("runs/x/checkpoints/step_00000150", "runs/x/int4", kind="int4")
    stream = stream_weights(build_model(cfg, device="meta"), "runs/x/int4")

[Note: what is quantised]
Weight-only quantisation with the block codecs of shardwise/quant/codecs.py (absmax scale
per block of ``block_size`` elements along the last dim, i.e. along each output row's input
features): every weight of two or more dims in a block (attention and feed-forward
projections, stacked experts) and the untied output head. Kept in the source dtype: norms
and other 1-D tensors (small; they stay resident), the token embedding (a lookup reads
only its rows, so quantising it would save almost no bytes per token, and a tied head is
the embedding matrix, so it stays exact too), and routers' gates (top-k selection is
discrete: a rounding error could flip an expert, an error no bound on the logits covers).
Each weight is dequantised into the unit's work buffer in the working dtype just before its
unit runs; the arithmetic is the working dtype's (weight-only quantisation). Per weight the
error is at most ``codecs.error_bound`` (half a step, absmax / 254 for int8, / 14 for int4).

Layout: ``<out>/quantized.json`` (format, kind, block size, the model config, and per
tensor: file, offset, bytes, shape, source dtype, codec or null) and ``<unit>.bin`` files
(``embedding``, ``layers.<i>``, ``head``, ``resident``), tensors at 64-byte aligned offsets in
data-flow order. The folder is written beside its final name and renamed into place (as
checkpoints are, shardwise/checkpoint/atomic.py), so a reader never sees half a store.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from shardwise.inference.weights.layout import Piece, Source, TensorEntry

__all__ = ["store_source", "unit_of", "STORE_INDEX", "STORE_FORMAT"]

STORE_INDEX = "quantized.json"
STORE_FORMAT = "shardwise-quantized-weights"
_LAYER = re.compile(r"^layers\.(\d+)\.")


def unit_of(name: str) -> str:
    """The streamed unit a parameter name belongs to: ``layers.<i>``, ``head`` (the output
    head), ``embedding`` or ``resident`` (everything else: norms, biases)."""
    m = _LAYER.match(name)
    if m:
        return f"layers.{m.group(1)}"
    return {"output.weight": "head", "tok_embeddings.weight": "embedding"}.get(name, "resident")


def store_source(folder: str | os.PathLike) -> Source:
    """The tensors of a quantised store.

    Raises:
        ValueError: a ``quantized.json`` of another format or version.
    """
    folder = Path(folder)
    index = json.loads((folder / STORE_INDEX).read_text())
    if index.get("format") != STORE_FORMAT or index.get("version") != 1:
        raise ValueError(f"{folder / STORE_INDEX}: format {index.get('format')!r} version "
                         f"{index.get('version')!r}, expected {STORE_FORMAT!r} version 1")
    entries = {}
    for name, t in index["tensors"].items():
        shape = tuple(t["shape"])
        piece = Piece(str(folder / t["file"]), t["offset"], t["nbytes"], (0,) * len(shape),
                      shape)
        dtype = getattr(torch, t["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{folder / STORE_INDEX}: tensor {name} has dtype {t['dtype']!r}")
        entries[name] = TensorEntry(name, shape, dtype,
                                    (piece,), t["codec"], index["block_size"])
    files = sorted({p.path for e in entries.values() for p in e.pieces})
    return Source("quantized", folder, entries, index.get("config"), files)
