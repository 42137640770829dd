"""Hang detection for collectives that run on the GPU (NCCL), where the host never waits.

[Note: watchdog on NCCL] On Gloo a rank that waits in a collective blocks a host thread, and
the watchdog sees the blocked thread (optrack). NCCL collectives are queued on CUDA streams:
``work.wait()`` only makes the compute stream wait and returns at once, so a collective that
never completes (a peer that skipped it, died, or issued another one) leaves the host
running ahead until some later host sync blocks inside CUDA, where Python cannot be
interrupted. Each NCCL collective is therefore remembered with a completion probe: the work
handle's ``is_completed()`` (which queries the collective's end event) for asynchronous
ones, an event recorded on the calling stream after synchronous ones (that stream waits for
the collective). The watchdog thread drops completed entries in issue order and, when the
oldest one is older than the timeout, trips with the collective named; its report goes
through the store like any other, and the NCCL communicators are aborted before the process
exits, so no rank waits for NCCL's own (longer) timeout or races its handler. Gloo groups
are not tracked here: their waits block a host thread as before.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["DeviceWatch", "probe_for", "abort_communicators"]

Probe = Callable[[], bool]


def probe_for(work, tensor: torch.Tensor | None) -> Probe | None:
    """A completion probe for a collective just issued, or None when no device tracking is
    needed (CPU tensors: the host waits itself)."""
    if tensor is None or tensor.device.type != "cuda":
        return None
    if work is not None and hasattr(work, "is_completed"):
        return work.is_completed
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event.query


class DeviceWatch:
    """Collectives queued on the device and not known to have completed, oldest first."""

    def __init__(self, max_kept: int = 4096) -> None:
        self._pending: deque[tuple[tuple, float, Probe]] = deque()
        self._lock = threading.Lock()
        self.max_kept = max_kept

    def add(self, op: tuple, probe: Probe) -> None:
        """Remember ``op`` (the tracker's op tuple) until ``probe()`` says it completed."""
        with self._lock:
            self._pending.append((op, time.monotonic(), probe))
            while len(self._pending) > self.max_kept:  # keep the oldest: they matter
                self._drop_completed_locked(limit=64)
                if len(self._pending) > self.max_kept:
                    self._pending.pop()
                    break

    def _drop_completed_locked(self, limit: int | None = None) -> None:
        checked = 0
        while self._pending and (limit is None or checked < limit):
            op, since, probe = self._pending[0]
            try:
                done = probe()
            except Exception:  # noqa: BLE001 - an aborted communicator: report it as stuck
                done = False
            if not done:
                return
            self._pending.popleft()
            checked += 1

    def oldest(self) -> tuple[tuple, float] | None:
        """(op, seconds since issue) of the oldest collective still running, or None."""
        with self._lock:
            self._drop_completed_locked()
            if not self._pending:
                return None
            op, since, _ = self._pending[0]
            return op, time.monotonic() - since

    def __len__(self) -> int:
        return len(self._pending)


def abort_communicators() -> None:
    """Abort every NCCL communicator of this process (after a reported hang), so that CUDA
    work blocked on them fails instead of waiting for NCCL's own timeout. Best effort."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:
            dist.group.WORLD.abort()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - the process exits next anyway
        pass
