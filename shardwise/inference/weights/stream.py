"""Run a model whose weights do not fit: each unit's weights read from disk just before it
runs, the next unit's read overlapping this one's compute.

    model = build_model(cfg, device="meta")
    with stream_weights(model, "runs/x/checkpoints/step_00000150", prefetch=1) as stream:
        logits = model(tokens)              # or the KV-cache decode: any forward works
        print(stream.stats())

[Note: weight streaming]
Hooks, not a forward of our own: a forward pre-hook on each unit ([Note: streamed units] in
plan.py) waits for the unit's load, installs its tensors (views of one slot's work buffer)
as the module's parameters, and starts loading the next ``prefetch`` units into free slots
in the background: a decode thread loads a unit, having a read thread read piece ``i + 1``
while it dequantises or permutes piece ``i``. A forward post-hook (``always_call``) puts the
meta parameters back and frees the slot. Units load in call order, cyclically (after the
head comes layer 0 of the next forward, so a decode loop keeps the disk busy across
tokens); a unit asked for out of order is loaded on the spot (counted as a miss). There are
``prefetch + 1`` slots, so resident memory is ``prefetch + 1`` units' work and staging
buffers, the resident tensors and the batch's embedding rows, whatever the model's size.
An exception in a unit's forward drains the loads in flight (their errors dropped: the
forward's wins) and frees every slot, so nothing stays installed and no read outlives the
call; :meth:`close` joins both threads. They hold the GIL only between system calls and
tensor ops, so disk reads, dequantisation and the forward's kernels overlap.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from shardwise.inference.weights.decode import decode_piece
from shardwise.inference.weights.layout import FileSet, read_entry, read_rows
from shardwise.inference.weights.plan import (Unit, WorkBuffer, materialise_resident,
                                              plan_units, view_of)
from shardwise.inference.weights.sources import open_source

__all__ = ["WeightStream", "stream_weights"]


class WeightStream:
    """The hooks and buffers streaming a meta model's weights ([Note: weight streaming]).

    Built by :func:`stream_weights`; use as a context manager or call :meth:`close`.
    """

    def __init__(self, model: nn.Module, source: str | os.PathLike, prefetch: int,
                 drop_page_cache: bool, config: dict[str, Any] | None) -> None:
        import dataclasses

        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"stream_weights: prefetch={prefetch!r}, expected an int >= 0")
        cfg = getattr(model, "config", None)
        if config is None and dataclasses.is_dataclass(cfg):
            config = dataclasses.asdict(cfg)
        self.model, self.prefetch = model, prefetch
        self.source = open_source(source, config)
        self.units, resident, self.dtype = plan_units(model, self.source)
        self.files = FileSet(drop_page_cache)
        self._embed = self.source.entry("tok_embeddings.weight",
                                        tuple(model.tok_embeddings.weight.shape))
        self._metas = {s.name: s.module._parameters[s.attr] for u in self.units for s in u.slots}
        self._metas["tok_embeddings.weight"] = model.tok_embeddings.weight
        self._saved = materialise_resident(model, self.source, resident, self._read_resident)
        numel = max(u.numel for u in self.units)
        staging = max(u.staging for u in self.units)
        self._buffers = [WorkBuffer(numel, staging, self.dtype) for _ in range(prefetch + 1)]
        self._where: dict[int, WorkBuffer] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardwise-weights")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="shardwise-weights-read")
        self._counts = {"wait_seconds": 0.0, "read_seconds": 0.0, "units_loaded": 0,
                        "misses": 0, "forwards": 0}
        self._hooks = [model.tok_embeddings.register_forward_pre_hook(self._embed_in),
                       model.tok_embeddings.register_forward_hook(self._embed_out,
                                                                   always_call=True)]
        for k, unit in enumerate(self.units):
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda m, args, k=k: self._unit_in(k)))
            self._hooks.append(unit.module.register_forward_hook(
                lambda m, args, out, k=k: self._unit_out(k, out), always_call=True))
        self._closed = False

    def _read_resident(self, entry, out: torch.Tensor) -> None:
        need = entry.staging_bytes(out.dtype)
        read_entry(self.files, entry, out, torch.empty(need, dtype=torch.uint8) if need else None)

    # ---- the background threads ----------------------------------------------------------
    def _load(self, unit: Unit, buf: WorkBuffer) -> float:
        """Read and decode one unit into ``buf`` (on the decode thread): piece ``i + 1`` is
        read (on the read thread) while piece ``i`` is decoded, into alternating halves of
        the staging buffer, so dequantisation overlaps the disk too."""
        t0 = time.perf_counter()
        steps = [(s, p) for s in unit.slots for p in (s.entry.pieces or (None,))]

        def read(i: int) -> torch.Tensor | None:
            s, piece = steps[i]
            if s.entry.zero:
                return None
            if s.entry.direct(self.dtype):
                self.files.pread_into(piece.path, piece.offset, view_of(buf.work, s))
                return None
            raw = buf.staging[i % 2][:piece.nbytes]
            self.files.pread_into(piece.path, piece.offset, raw)
            return raw

        pending = [self._reader.submit(read, i) for i in range(min(2, len(steps)))]
        try:
            for i, (s, piece) in enumerate(steps):
                raw = pending[i].result()
                if s.entry.zero:
                    view_of(buf.work, s).zero_()
                elif raw is not None:
                    decode_piece(s.entry, piece, raw, view_of(buf.work, s))
                if i + 2 < len(steps):  # its half of the staging buffer is free again
                    pending.append(self._reader.submit(read, i + 2))
        finally:
            for f in pending:  # no read outlives the load, whatever happened
                f.exception()
        self.files.drop_files()
        return time.perf_counter() - t0

    def _submit(self, k: int) -> bool:
        free = next((b for b in self._buffers if b.unit is None), None)
        if free is None:
            return False
        free.unit, free.future = k, self._pool.submit(self._load, self.units[k], free)
        self._where[k] = free
        return True

    def _drain(self) -> None:
        """Wait for every read in flight and free every slot (errors dropped)."""
        for buf in self._buffers:
            if buf.future is not None:
                try:
                    buf.future.result()
                except Exception:  # noqa: BLE001 - the caller's error is the one to raise
                    pass
            buf.unit, buf.future = None, None
        self._where.clear()

    # ---- hooks ----------------------------------------------------------------------------
    def _unit_in(self, k: int) -> None:
        if self._closed:
            raise ValueError("this WeightStream is closed; the model's weights are on meta")
        if k not in self._where:
            self._counts["misses"] += 1
            if not self._submit(k):  # every slot busy with other units: start over
                self._drain()
                self._submit(k)
        buf = self._where[k]
        t0 = time.perf_counter()
        try:
            self._counts["read_seconds"] += buf.future.result()
        except BaseException:
            self._drain()
            raise
        self._counts["wait_seconds"] += time.perf_counter() - t0
        self._counts["units_loaded"] += 1
        buf.future = None
        for s in self.units[k].slots:
            s.module._parameters[s.attr] = nn.Parameter(view_of(buf.work, s), requires_grad=False)
        self._prefetch_after(k)

    def _prefetch_after(self, k: int) -> None:
        n = len(self.units)
        for j in range(1, min(self.prefetch, n - 1) + 1):
            nxt = (k + j) % n
            if nxt not in self._where and not self._submit(nxt):
                break

    def _unit_out(self, k: int, out: Any) -> None:
        for s in self.units[k].slots:
            s.module._parameters[s.attr] = self._metas[s.name]
        buf = self._where.pop(k, None)
        if buf is not None:
            buf.unit = None
        if k == len(self.units) - 1 and out is not None:
            self._counts["forwards"] += 1
        if out is None:  # the unit's forward raised: no read may outlive the call
            self._drain()

    def _embed_in(self, module: nn.Module, args: tuple) -> tuple:
        if self._closed:
            raise ValueError("this WeightStream is closed; the model's weights are on meta")
        tokens = args[0]
        vocab = module.weight.shape[0]
        uniq, inverse = torch.unique(tokens, return_inverse=True)  # (U,), tokens' shape
        if uniq.numel() and (uniq[0] < 0 or uniq[-1] >= vocab):
            bad = uniq[0].item() if uniq[0] < 0 else uniq[-1].item()
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if 0 not in self._where and self.units:
            self._submit(0)  # layer 0 reads while the rows are read
        rows = torch.empty(uniq.numel(), module.weight.shape[1], dtype=self.dtype)
        read_rows(self.files, self._embed, uniq.tolist(), rows)
        module._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
        return (inverse, *args[1:])

    def _embed_out(self, module: nn.Module, args: tuple, out: Any) -> None:
        module._parameters["weight"] = self._metas["tok_embeddings.weight"]

    # ---- accounting and lifetime ----------------------------------------------------------
    def bytes_per_forward(self) -> int:
        """Bytes one forward reads from disk for its units (the embedding rows apart: a
        few KiB per token)."""
        return sum(u.nbytes_read for u in self.units)

    def resident_bytes(self, num_tokens: int = 0) -> int:
        """Predicted bytes this stream holds: the ``prefetch + 1`` slots' work and staging
        buffers, the resident tensors and buffers, and the embedding rows of a batch of
        ``num_tokens`` tokens (activations and the KV cache apart)."""
        slots = sum(b.nbytes for b in self._buffers)
        resident = sum(self._tensor(n).nbytes for n in self._saved)
        rows = num_tokens * self._embed.shape[1] * self.dtype.itemsize
        return slots + resident + rows

    def _tensor(self, name: str) -> torch.Tensor:
        path, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(path) if path else self.model
        return owner._parameters[attr] if attr in owner._parameters else owner._buffers[attr]

    def stats(self) -> dict[str, float]:
        """Counters since construction (or :meth:`reset_stats`).

        Returns:
            ``bytes_read`` (from disk, rows included), ``read_seconds`` (the decode
            thread's time loading units: reads and dequantisation), ``wait_seconds`` (time
            the forward waited for a load: 0 when loads hide behind compute),
            ``units_loaded``, ``misses`` (units loaded on the spot, out of order),
            ``forwards`` (head calls completed), ``bytes_per_forward`` (predicted),
            ``work_buffer_bytes`` (the slots').
        """
        slots = sum(b.nbytes for b in self._buffers)
        return {"bytes_read": self.files.bytes_read, **self._counts,
                "bytes_per_forward": self.bytes_per_forward(), "work_buffer_bytes": slots}

    def reset_stats(self) -> None:
        """Zero the counters."""
        self.files.bytes_read = 0
        self._counts.update(wait_seconds=0.0, read_seconds=0.0, units_loaded=0, misses=0,
                            forwards=0)

    def close(self) -> None:
        """Join the background threads, remove the hooks, put every tensor back on meta and close
        the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain()
        self._pool.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for h in self._hooks:
            h.remove()
        for name, meta in {**self._metas, **self._saved}.items():
            path, _, attr = name.rpartition(".")
            owner = self.model.get_submodule(path) if path else self.model
            (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = meta
        self._buffers.clear()
        self.files.close()

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stream_weights(model: nn.Module, source: str | os.PathLike, *, prefetch: int = 1,
                   drop_page_cache: bool = False,
                   config: dict[str, Any] | None = None) -> WeightStream:
    """Stream a meta model's weights from a checkpoint on disk ([Note: weight streaming]).

    Args:
        model: a shardwise Transformer built on meta (``build_model(cfg, device="meta")``;
            its parameters' dtype is the working dtype: ``.to(torch.bfloat16)`` on meta for
            bf16 compute).
        source: a DCP step folder, a safetensors file or folder (Hugging Face or shardwise
            names), or a quantised store (:func:`quantize_checkpoint`).
        prefetch: units read ahead of the running one (default 1: double buffering; 0 reads
            each unit when it is called).
        drop_page_cache: drop each range from the page cache once read, so every forward
            reads from the disk (default False); this is how a benchmark emulates weights
            that do not fit in RAM on a machine whose page cache would hold them.
        config: the model config as a dict (default: ``asdict(model.config)``), for the
            Hugging Face layout.

    Returns:
        The :class:`WeightStream` (a context manager).

    Raises:
        ValueError: a model not on meta, a bad ``prefetch``, a source that lacks a tensor of
            the model or holds another shape (named), before any weight is read.
    """
    return WeightStream(model, source, prefetch, drop_page_cache, config)
