"""The offload policy (:class:`Offload`), its directory checks and the statistics type.

See the notes in ``offload.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Offload", "OffloadStats", "DiskUsage", "check_offload_dir", "local_ranks"]

_MiB = 2 ** 20
DiskUsage = Callable[[str], Any]  # shutil.disk_usage or a stand-in with .free


@dataclass(frozen=True)
class Offload:
    """Where optimizer state and fp32 masters live during training.

    Attributes:
        device: "cpu" (host memory; see [Note: CPU offload]) or "disk" (files under
            ``path``, streamed through ``buffer_mb`` of RAM; see [Note: disk offload]).
            Default "cpu".
        path: disk only: an existing, writable directory with room for this host's
            optimizer state. Each rank writes its own run directory inside. Default None.
        buffer_mb: disk: MiB of RAM the streamed optimizer state may occupy (default 64).
            cpu on an accelerator: MiB of masters per pipelined chunk.
        budget_bytes: at most this many bytes of masters + optimizer state are offloaded,
            parameters taken in order; the rest stay where they are. Default None (all).
        prefetch: disk: read the next chunk while this one steps (chunks of half the
            buffer); False: one chunk at a time (chunks of the whole buffer). Default True.
        foreach: set ``foreach=True`` on parameter groups that leave it unset (vectorised
            host step). Default True.
        pin_memory: accelerators: pinned host masters and gradient buffers (async copies).
            Default True.
    """

    device: str = "cpu"
    path: str | None = None
    buffer_mb: float = 64.0
    budget_bytes: int | None = None
    prefetch: bool = True
    foreach: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "disk"):
            raise ValueError(f"Offload(device={self.device!r}): expected 'cpu' or 'disk'")
        if self.device == "disk" and not (isinstance(self.path, str) and self.path):
            raise ValueError(f"Offload(device='disk') needs path=<directory>, got "
                             f"path={self.path!r}")
        if self.device == "cpu" and self.path:
            raise ValueError(f"Offload(path={self.path!r}) is only used with device='disk', "
                             f"got device='cpu'")
        if isinstance(self.buffer_mb, bool) or not isinstance(self.buffer_mb, (int, float)) \
                or not self.buffer_mb > 0:
            raise ValueError(f"Offload(buffer_mb={self.buffer_mb!r}): expected a number > 0 "
                             "(MiB)")
        if self.budget_bytes is not None and (isinstance(self.budget_bytes, bool) or not
                                              isinstance(self.budget_bytes, int)
                                              or self.budget_bytes < 0):
            raise ValueError(f"Offload(budget_bytes={self.budget_bytes!r}): expected None or "
                             "an int >= 0")

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer_mb * _MiB)

    def validate(self, need_bytes: int = 0, *, disk_usage: DiskUsage = shutil.disk_usage
                 ) -> None:
        """Check the directory now (disk), before anything is written or trained.

        Args:
            need_bytes: optimizer-state bytes this rank will write (0: skip the space check).
            disk_usage: ``shutil.disk_usage`` or a stand-in (tests).

        Raises:
            ValueError: see :func:`check_offload_dir`.
        """
        if self.device == "disk":
            check_offload_dir(self.path, need_bytes, disk_usage=disk_usage)


def local_ranks() -> int:
    """Ranks of this host, which may share ``path`` (torchrun's LOCAL_WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_offload_dir(path: str, need_bytes: int = 0, *,
                      disk_usage: DiskUsage = shutil.disk_usage) -> None:
    """Refuse a directory that cannot hold the offloaded optimizer state.

    Args:
        path: the directory.
        need_bytes: bytes this rank will write; every rank of this host
            (``LOCAL_WORLD_SIZE``) is assumed to write as much into the same filesystem.
        disk_usage: returns an object with ``.free`` bytes for a path (injectable for tests).

    Raises:
        ValueError: naming ``path``: missing, not a directory, read-only, or too little
            free space (with the bytes needed and free).
    """
    if not os.path.exists(path):
        raise ValueError(f"Offload(path={path!r}) does not exist; create the directory first")
    if not os.path.isdir(path):
        raise ValueError(f"Offload(path={path!r}) is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"Offload(path={path!r}) is read-only for this process "
                         f"(uid {os.getuid()}); choose a writable directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardwise-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"Offload(path={path!r}) cannot be written: {e.strerror}") from e
    need = need_bytes * local_ranks()
    free = disk_usage(path).free
    if need > free:
        raise ValueError(f"Offload(path={path!r}) has {free / _MiB:.1f} MiB free but the "
                         f"optimizer state of {local_ranks()} rank(s) on this host needs "
                         f"{need / _MiB:.1f} MiB ({need} bytes); free space or choose "
                         f"another directory")


@dataclass(frozen=True)
class OffloadStats:
    """What an :class:`OffloadedOptimizer` moved and held (this rank).

    Attributes:
        device: "cpu" or "disk".
        offloaded_params, kept_params: parameters offloaded / left in place (budget).
        offloaded_bytes: masters + optimizer state of the offloaded parameters (estimated
            before the first step, see [Note: sizing optimizer state]).
        host_master_bytes: host masters made for accelerator parameters (0 on CPU).
        state_size_source: how state bytes were first sized ("meta", "cpu", "assumed 2x").
        buffer_bytes: ``Offload.buffer_mb`` in bytes; chunk_bytes: the chunk limit.
        resident_bytes, peak_resident_bytes: disk: streamed optimizer state held in RAM now
            and at peak since the last ``reset_peak``; cpu: the state held (host memory).
        read_bytes, write_bytes, read_s, write_s: disk traffic and its time on the I/O thread.
        wait_s: time ``step`` blocked on I/O (not hidden by overlap).
        file_bytes: size of this rank's state file; run_dir: its directory (disk).
    """

    device: str
    offloaded_params: int
    kept_params: int
    offloaded_bytes: int
    host_master_bytes: int
    state_size_source: str
    buffer_bytes: int
    chunk_bytes: int
    resident_bytes: int
    peak_resident_bytes: int
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0
    file_bytes: int = 0
    run_dir: str | None = None
