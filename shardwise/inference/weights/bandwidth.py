"""The disk's sequential read rate, measured the way the stream reads (``preadv`` of
:data:`~shardwise.inference.weights.layout.READ_CHUNK` bytes into one reused buffer), so
that ``bandwidth / bytes_per_forward`` is the forward rate a read-bound stream can reach."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch

from shardwise.inference.weights.layout import READ_CHUNK

__all__ = ["measure_read_bandwidth", "drop_page_cache"]


def drop_page_cache(paths: Iterable[str | os.PathLike]) -> None:
    """Ask the kernel to drop the files' pages from the page cache (``POSIX_FADV_DONTNEED``;
    clean pages only: a file just written must be fsync'ed first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_drop = drop_page_cache  # the name measure_read_bandwidth's flag shadows


def measure_read_bandwidth(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                           drop_page_cache: bool = True, read_size: int = READ_CHUNK) -> float:
    """Bytes per second of reading the files whole, in order, ``read_size`` bytes a call.

    Args:
        paths: a file or files (e.g. ``stream.source.files``).
        drop_page_cache: drop the files' pages before and after (default True: the disk's
            rate; False: the page cache's).
        read_size: bytes per read call (default the stream's).

    Returns:
        Bytes read divided by the seconds it took.

    Raises:
        ValueError: no file, or no bytes to read.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("measure_read_bandwidth: no file given")
    if drop_page_cache:
        _drop(paths)
    buf = memoryview(torch.empty(read_size, dtype=torch.uint8).numpy())
    total, t0 = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while (n := os.preadv(fd, [buf], offset)) > 0:
                offset += n
            if drop_page_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += offset
    seconds = time.perf_counter() - t0
    if total == 0:
        raise ValueError(f"measure_read_bandwidth: the files {paths} are empty")
    return total / seconds
