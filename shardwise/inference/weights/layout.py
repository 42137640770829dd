"""Where a tensor's bytes lie on disk, and how to read them into a preallocated buffer.

A source (safetensors, DCP, the quantised store: sources.py, dcp_source.py, store.py) is
turned into one :class:`TensorEntry` per tensor of the model, in our names and layout: a
list of :class:`Piece`\\ s, each a byte range of one file and the region of the global tensor
it fills. Reading never maps a file: ``os.preadv`` writes straight into the caller's buffer
(the unit's work buffer when the bytes need no change, else a reusable staging buffer), so
the process's resident memory is the buffers it owns, whatever the file sizes ([Note: why
pread, not mmap]).

[Note: why pread, not mmap]
A memory-mapped file's pages count in the process's RSS while they are mapped and touched,
and the kernel frees them only under memory pressure: a model larger than the RSS cap would
exceed it after one pass. ``preadv`` into buffers we own copies through the page cache
(which is not RSS, and which ``drop_page_cache`` empties for the ranges read) and keeps RSS
at the buffers' size. The copy costs far less than the disk read it follows.

[Note: read size]
Reads are issued in calls of at most 8 MiB. Measured on this project's machine (a virtual
disk, bench/stream_bench.py): sequential ``preadv`` calls of 8 MiB or 1 MiB read at about
1.5 GB/s, single calls of 64 MiB at 0.37 GB/s: a call that large is served as one
synchronous request, while a run of smaller sequential calls lets the kernel's readahead
keep the next request in flight. :func:`~shardwise.inference.weights.bandwidth.
measure_read_bandwidth` uses the same size, so the limit and the stream read alike.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import hf
from shardwise.inference.weights.decode import decode_piece

__all__ = ["Piece", "TensorEntry", "Source", "FileSet", "read_entry", "read_rows", "READ_CHUNK"]

READ_CHUNK = 8 * 2**20  # bytes per preadv call: see [Note: read size]


@dataclass(frozen=True)
class Piece:
    """One byte range of one file and the region of the global tensor it fills.

    Attributes:
        path: the file.
        offset: first byte in the file.
        nbytes: bytes of the range.
        dest: per-dim start of the region in the global tensor.
        file_shape: the region's shape as stored (row-major in the file).
        perm: ``region = stored.permute(perm)`` when the stored layout is not the region's
            (a transposed Mixtral expert, a DCP chunk saved with other strides), else None.
        hf_heads: the region is ``wq`` / ``wk`` rows in Hugging Face's rotate-half order of
            this many heads ([Note: RoPE layouts] in shardwise/checkpoint/hf.py), else None.
    """

    path: str
    offset: int
    nbytes: int
    dest: tuple[int, ...]
    file_shape: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    hf_heads: int | None = None

    @property
    def plain(self) -> bool:
        """Whether the stored bytes are the region's bytes in row-major order."""
        return self.perm is None and self.hf_heads is None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the model in a source.

    Attributes:
        name: our parameter (or buffer) name.
        shape: the global shape.
        dtype: the stored element type (for a quantised tensor, the dtype it was quantised
            from).
        pieces: the byte ranges that cover it (one, for a quantised tensor).
        codec: "int8" / "int4" for a tensor in the quantised store, else None.
        block_size: the codec's block size.
        zero: the source has no bytes for it and it is zero (a Mixtral export drops the
            routing bias, which is zero by construction: see hf.py's [Note: Mixtral layout]).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...] = field(default=())
    codec: str | None = None
    block_size: int = 256
    zero: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes read from disk for the whole tensor."""
        return sum(p.nbytes for p in self.pieces)

    def direct(self, dtype: torch.dtype) -> bool:
        """Whether one read lands the bytes in a ``dtype`` buffer with no staging."""
        return (self.codec is None and len(self.pieces) == 1 and self.pieces[0].plain
                and self.dtype == dtype and self.pieces[0].file_shape == self.shape)

    def staging_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of staging a read into a ``dtype`` buffer needs (largest piece, or 0)."""
        if self.zero or self.direct(dtype):
            return 0
        return max((p.nbytes for p in self.pieces), default=0)


@dataclass
class Source:
    """The tensors of one checkpoint, in our names.

    Attributes:
        kind: "safetensors", "hf-safetensors", "dcp" or "quantized".
        path: where it was opened.
        entries: our name -> :class:`TensorEntry`.
        config: the model config recorded with it (a dict of LlamaConfig fields), or None.
        files: every file the entries read.
    """

    kind: str
    path: Path
    entries: dict[str, TensorEntry]
    config: dict[str, Any] | None = None
    files: list[str] = field(default_factory=list)

    def entry(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        """The entry of ``name``, checked against the model's ``shape``.

        Raises:
            ValueError: the source lacks ``name`` or holds another shape.
        """
        e = self.entries.get(name)
        if e is None and self.kind == "hf-safetensors" and hf.is_routing_bias(name):
            return TensorEntry(name, tuple(shape), torch.float32, zero=True)
        if e is None:
            raise ValueError(f"{self.kind} source {self.path} has no tensor {name!r} (the "
                             f"model's; the source holds {len(self.entries)} tensors)")
        if tuple(e.shape) != tuple(shape):
            raise ValueError(f"{self.kind} source {self.path}: tensor {name!r} has shape "
                             f"{tuple(e.shape)}, the model's is {tuple(shape)}")
        return e


class FileSet:
    """Open file descriptors shared by the reads, and the counters of bytes and seconds.

    Args:
        drop_page_cache: after each read, ``posix_fadvise(DONTNEED)`` the range, so the next
            pass reads from the disk again (how a model larger than RAM is emulated on a
            machine whose page cache would otherwise hold it).
    """

    def __init__(self, drop_page_cache: bool = False) -> None:
        self.drop_page_cache = drop_page_cache
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def fd(self, path: str) -> int:
        """The descriptor of ``path`` (opened once, read-only)."""
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def pread_into(self, path: str, offset: int, buf: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``buf`` with the file's bytes from ``offset``.

        Raises:
            ValueError: the file ends before ``buf`` is full (a truncated checkpoint).
        """
        view = memoryview(buf.view(torch.uint8).reshape(-1).numpy())
        fd, done, total = self.fd(path), 0, view.nbytes
        while done < total:
            n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
            if n <= 0:
                raise ValueError(f"{path}: file ends at byte {offset + done}, expected "
                                 f"{total - done} more bytes from offset {offset}")
            done += n
        if self.drop_page_cache and total:
            os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)
        with self._lock:  # the read thread and the embedding's rows both count
            self.bytes_read += total

    def drop_files(self) -> None:
        """Drop the whole of every file read so far from the page cache (when
        ``drop_page_cache``): the per-range drops miss the pages the kernel's readahead
        still had in flight past a range's end (measured: about 70 MB of 250 MB read stayed
        cached), so each unit's load ends with this."""
        if not self.drop_page_cache:
            return
        with self._lock:
            fds = list(self._fds.values())
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close every descriptor."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_entry(files: FileSet, entry: TensorEntry, out: torch.Tensor,
               staging: torch.Tensor | None) -> None:
    """Read ``entry`` into ``out`` (its shape, the working dtype, contiguous).

    Args:
        files: the descriptors and counters.
        entry: the tensor's pieces.
        out: the destination.
        staging: a uint8 buffer of at least ``entry.staging_bytes(out.dtype)`` bytes (None
            when that is 0).
    """
    if entry.zero:
        out.zero_()
        return
    if entry.direct(out.dtype):
        files.pread_into(entry.pieces[0].path, entry.pieces[0].offset, out)
        return
    assert staging is not None and staging.numel() >= entry.staging_bytes(out.dtype)
    for piece in entry.pieces:
        raw = staging[:piece.nbytes]
        files.pread_into(piece.path, piece.offset, raw)
        decode_piece(entry, piece, raw, out)


def read_rows(files: FileSet, entry: TensorEntry, ids: list[int], out: torch.Tensor) -> None:
    """Read rows ``ids`` of a 2-D ``entry`` into ``out`` ``(len(ids), cols)``: only those
    rows' bytes (row ``r`` of a piece starting at row ``r0`` with ``c`` stored columns lies
    at ``offset + (r - r0) * c * itemsize``).

    Raises:
        ValueError: the entry is not row-readable (quantised or stored permuted).
    """
    if entry.zero:
        out.zero_()
        return
    if entry.codec is not None or any(not p.plain for p in entry.pieces) or len(entry.shape) != 2:
        raise ValueError(f"{entry.name}: rows can only be read from a plain 2-D tensor")
    item = torch.empty(0, dtype=entry.dtype).element_size()
    for piece in entry.pieces:
        (r0, c0), (nr, nc) = piece.dest, piece.file_shape
        row_buf = torch.empty(nc, dtype=entry.dtype) if entry.dtype != out.dtype or \
            nc != out.shape[1] else None
        for k, r in enumerate(ids):
            if not r0 <= r < r0 + nr:
                continue
            dst = row_buf if row_buf is not None else out[k]
            files.pread_into(piece.path, piece.offset + (r - r0) * nc * item, dst)
            if row_buf is not None:
                out[k, c0:c0 + nc].copy_(row_buf)
