"""The disk store behind ``Offload(device="disk")``: one file per rank, one I/O thread,
exact accounting of the optimizer-state bytes held in RAM.

See [Note: disk offload] in ``offload.py`` for how the optimizer wrapper uses it.

[Note: disk layout]
Each rank owns a run directory ``<path>/shardwise-offload-<host>-rank<r>-<random>/`` made by
``mkdtemp`` (unique even when ranks or jobs share ``path``) holding one file, ``state.bin``.
Every parameter's state is one record: its tensors' raw bytes back to back, each starting
on a 64-byte boundary, at a region of the file reserved the first time the record is
written (and moved to the end of the file if the record ever grows). The index (offsets,
dtypes, shapes) and non-tensor state values (a few Python numbers) stay in memory.

[Note: one FIFO I/O thread]
Reads and writes run on a single worker thread, in submission order. That order is what
bounds memory: the read of chunk i+1 is queued after the write-back of chunk i-1, so it
allocates only once chunk i-1's bytes are on disk and freed; at most two chunks are held
at once (the one stepping and the one read ahead). The reads allocate their chunk's buffer
on the worker, after the writes before them, for the same reason. ``os.preadv`` /
``os.pwrite`` release the GIL, so the transfers overlap the optimizer's step.

[Note: cleanup]
The run directory goes away on ``close()``, when the store is garbage-collected, and at
interpreter exit (one ``weakref.finalize`` covers the three; a process started by
``multiprocessing`` exits through ``os._exit``, skipping atexit, so a multiprocessing
finalizer calls it there too). A process killed with
SIGKILL cannot clean up; the next store created in the same ``path`` on the same host
removes such orphans: every live store holds an exclusive ``flock`` on its ``state.bin``
(the kernel drops it when the process dies, however it dies), so an orphan is a directory
of this host whose file can be locked. The file is locked under a temporary name and then
renamed, so a store never sees another's file unlocked.
"""

from __future__ import annotations

import ctypes
import fcntl
import multiprocessing.util
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from shardwise.shard.offload.host import aligned, tensor_nbytes

__all__ = ["DiskStore", "IOStats", "RUN_PREFIX", "remove_orphans"]

RUN_PREFIX = "shardwise-offload"
_FILE = "state.bin"


@dataclass
class _Record:
    offset: int  # file offset of the region
    capacity: int  # bytes reserved there
    nbytes: int  # bytes used: the tensors, each aligned
    tensors: list[tuple[str, torch.dtype, torch.Size, int, int]]  # key, dtype, shape, offset, bytes
    other: dict[str, Any]  # non-tensor state values
    order: list[str]  # the state dict's key order


@dataclass
class IOStats:
    """Bytes and seconds moved by a store; resident state bytes now and at peak."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hold(self, nbytes: int) -> None:
        with self.lock:
            self.resident_bytes += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.resident_bytes -= nbytes
            assert self.resident_bytes >= 0, self.resident_bytes

    def snapshot(self) -> dict[str, int | float]:
        """The counters, read together under the lock (the I/O thread updates them)."""
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _view(t: torch.Tensor, offset: int, nbytes: int) -> memoryview:
    """Bytes ``[offset, offset + nbytes)`` of contiguous CPU tensor ``t``, writable, no copy."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr() + offset)).cast("B")


def _pread(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read of the offload file at byte {offset + done}")
        done += n


def _pwrite(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def remove_orphans(path: str) -> list[str]:
    """Remove run directories under ``path`` left by dead processes of this host.

    Returns:
        The directories removed. See [Note: cleanup].
    """
    removed, mine = [], f"{RUN_PREFIX}-{_host_tag()}-"
    for name in os.listdir(path):
        run = os.path.join(path, name)
        if not name.startswith(mine):
            continue
        try:
            fd = os.open(os.path.join(run, _FILE), os.O_RDONLY)
        except OSError:  # no state file yet (being created) or not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


def _cleanup(pool: ThreadPoolExecutor, fd: int, run_dir: str) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
    shutil.rmtree(run_dir, ignore_errors=True)


def _read(fd: int, records: list[_Record | None], stats: IOStats):
    """Worker: read ``records`` into one new buffer; returns (buffer, state dicts)."""
    total = sum(r.nbytes for r in records if r is not None)
    flat = torch.empty(total, dtype=torch.uint8)
    stats.hold(total)
    t0, off, states, moved = time.perf_counter(), 0, [], 0
    for r in records:
        if r is None:
            states.append(None)
            continue
        end = max((o + n for _, _, _, o, n in r.tensors), default=0)  # padding after: unwritten
        _pread(fd, _view(flat, off, end), r.offset)
        moved += end
        tensors = {key: flat[off + o:off + o + n].view(dt).view(shape)
                   for key, dt, shape, o, n in r.tensors}
        states.append({k: tensors[k] if k in tensors else r.other[k] for k in r.order})
        off += r.nbytes
    with stats.lock:
        stats.read_bytes += moved
        stats.read_s += time.perf_counter() - t0
    return flat, states


def _write(fd: int, items: list[tuple[torch.Tensor, int]], held: int, stats: IOStats) -> None:
    """Worker: write each (tensor, file offset), then release ``held`` resident bytes."""
    t0, total = time.perf_counter(), 0
    try:
        for t, offset in items:
            n = tensor_nbytes(t)
            _pwrite(fd, _view(t, 0, n), offset)
            total += n
    finally:
        items.clear()  # drop the tensors before releasing their bytes
        stats.release(held)
    with stats.lock:
        stats.write_bytes += total
        stats.write_s += time.perf_counter() - t0


class DiskStore:
    """Optimizer state of parameters (by integer key) in a per-rank file, streamed by one
    FIFO I/O thread. See [Note: disk layout] and [Note: one FIFO I/O thread].

    Args:
        path: an existing, writable directory (checked by the caller).
        rank: this process's rank, part of the run directory's name.
    """

    def __init__(self, path: str, rank: int) -> None:
        remove_orphans(path)
        self.dir = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}-{_host_tag()}-rank{rank}-", dir=path)
        tmp = os.path.join(self.dir, _FILE + ".tmp")
        self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.file = os.path.join(self.dir, _FILE)
        os.rename(tmp, self.file)  # visible to remove_orphans only once locked
        self.records: dict[int, _Record] = {}
        self.stats = IOStats()
        self._end = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardwise-offload-io")
        self._pending: deque[Future] = deque()
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, self.fd, self.dir)
        # Processes started by multiprocessing leave through os._exit, which skips atexit
        # (and so weakref.finalize); multiprocessing runs its own finalizers first.
        self._mp_finalizer = multiprocessing.util.Finalize(None, self._finalizer,
                                                           exitpriority=0)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def record_bytes(self, key: int) -> int | None:
        """Bytes of ``key``'s stored state, or None if it has none on disk."""
        r = self.records.get(key)
        return None if r is None else r.nbytes

    def file_bytes(self) -> int:
        return self._end

    def _submit(self, fn, *args) -> Future:
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # surface an I/O error at the next call
        fut = self._pool.submit(fn, *args)
        self._pending.append(fut)
        return fut

    def load_async(self, keys: list[int]) -> Future:
        """Queue a read of the state of ``keys``; the future gives (buffer, [state or None])."""
        return self._submit(_read, self.fd, [self.records.get(k) for k in keys], self.stats)

    def wait(self, fut: Future) -> tuple[torch.Tensor, list[dict | None]]:
        t0 = time.perf_counter()
        out = fut.result()
        self.stats.wait_s += time.perf_counter() - t0
        return out

    def load(self, keys: list[int]) -> list[dict | None]:
        """Read the state of ``keys`` now, each tensor in its own memory, not accounted
        (for state dicts, which hand the tensors to the caller)."""
        self.flush()
        out = []
        for k in keys:
            r = self.records.get(k)
            if r is None:
                out.append(None)
                continue
            tensors = {}
            for key, dt, shape, o, n in r.tensors:
                t = torch.empty(shape, dtype=dt)
                _pread(self.fd, _view(t, 0, n), r.offset + o)
                tensors[key] = t
            out.append({k2: tensors[k2] if k2 in tensors else r.other[k2] for k2 in r.order})
        return out

    def _place(self, key: int, state: dict) -> list[tuple[torch.Tensor, int]]:
        """Lay out ``state`` as ``key``'s record (reserving file space); (tensor, offset)s."""
        layout, other, off = [], {}, 0
        writes = []
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                t = v.detach()
                if t.device.type != "cpu" or not t.is_contiguous():
                    t = t.to("cpu").contiguous()
                layout.append((k, t.dtype, t.shape, off, tensor_nbytes(t)))
                writes.append((t, off))
                off += aligned(tensor_nbytes(t))
            else:
                other[k] = v
        old = self.records.get(key)
        if old is not None and old.capacity >= off:
            region, cap = old.offset, old.capacity
        else:  # new, or grown: a fresh region at the end (the old one is left unused)
            region, cap = self._end, off
            self._end += off
        self.records[key] = _Record(region, cap, off, layout, other, list(state))
        return [(t, region + o) for t, o in writes]

    def store_async(self, items: list[tuple[int, dict]], held: int) -> None:
        """Queue the write-back of ``(key, state)`` items; ``held`` resident bytes are
        released once written."""
        writes = []
        for key, state in items:
            writes += self._place(key, state)
        self._submit(_write, self.fd, writes, held, self.stats)

    def forget(self, key: int) -> None:
        self.records.pop(key, None)

    def flush(self) -> None:
        """Wait for every queued read and write; raise the first I/O error."""
        t0 = time.perf_counter()
        while self._pending:
            self._pending.popleft().result()
        self.stats.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Finish queued I/O, close and delete the run directory (idempotent)."""
        if self._finalizer.alive:
            try:
                self.flush()
            finally:
                self._finalizer()
                self._mp_finalizer.cancel()
