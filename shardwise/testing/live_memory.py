"""Live tensor bytes on the CPU, and the engine's CUDA-only code paths taken on the CPU.

[Note: CUDA lifetimes on the CPU] No CPU test ran the engine's CUDA branches: the buffer
pool hands allocation to the caching allocator there, gathered parameters are resized
instead of swapped, and :class:`~shardwise.shard.streams.CommStreams` keeps released buffers
until a side stream waits for the compute stream. :func:`cuda_code_paths` takes those
branches on the CPU (events and streams become no-ops that keep the same references), so
the lifetimes of every buffer are the ones a GPU sees, and :class:`LiveStorages` counts the
bytes still alive after every op, as ``torch.cuda.memory_allocated`` would.

One lifetime differs on the CPU and is evened out here: Gloo's worker thread wakes the rank
waiting on a collective and only then drops its own reference to the work, which holds the
collective's tensors. When the streams let released buffers go (``side``, ``settle``), the
buffers could outlive that moment by however long the thread waits for a core, so a step's
peak once counted two reduction buffers more than the step before (seen in CI, 1 run in ~7,
on 2 busy cores). Inside :func:`cuda_code_paths` the streams wait until what they let go is
really freed (bounded, :data:`RELEASE_TIMEOUT_S`; past it a buffer is held elsewhere, a leak,
and that raises). The ~1B
stage-3 step of bench/gpu_check.py ran out of 80 GB on an H100 through one of those
branches ([Note: held buffers are bounded] in shard/streams.py); bench/memory_phases.py
measures the phases of a step with both.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from unittest import mock

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveStorages", "cuda_code_paths"]

#: How long a buffer the streams let go may stay referenced by a communication thread.
RELEASE_TIMEOUT_S = 30.0


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates or returns, with the op, step and phase that first
    produced it, until it dies (weak references, checked after every op). Sizes are read
    again after every op: storages resized or swapped in place (gathered parameters) count
    what they hold now, not what they held when first seen.

    Attributes:
        step, phase: set by the caller; recorded with each storage first seen.
        peaks: ``(step, phase) -> (bytes, snapshot)``: the most bytes alive in that phase
            and what was alive then, ``[(nbytes, step, phase, op)]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # key -> [weak ref, nbytes now, step, phase, op]
        self.total = 0
        self.step, self.phase = 0, "setup"
        self.peaks: dict[tuple[int, str], tuple[int, list]] = {}

    def adopt(self, tensors: Iterable[torch.Tensor], label: str = "existing") -> None:
        """Count storages that exist already (parameters made before tracking)."""
        for t in tensors:
            self._add(t, label)
        self._refresh()

    def _add(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        if st._cdata not in self.live:
            self.live[st._cdata] = [StorageWeakRef(st), 0, self.step, self.phase, op]

    def _refresh(self) -> None:
        total = 0
        for k in list(self.live):
            entry = self.live[k]
            if entry[0].expired():
                del self.live[k]
                continue
            entry[1] = torch.UntypedStorage._new_with_weak_ptr(entry[0].cdata).nbytes()
            total += entry[1]
        self.total = total

    def now(self) -> int:
        """Bytes alive now."""
        self._refresh()
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t, func.__name__.split(".")[0])
        self._refresh()
        key = (self.step, self.phase)
        if key not in self.peaks or self.total > self.peaks[key][0]:
            snap = [(n, s, p, op) for _, n, s, p, op in self.live.values() if n]
            self.peaks[key] = (self.total, snap)
        return out


class _Event:
    def record(self, stream=None) -> None:
        pass


class _Stream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def _storages(pending: Iterable[tuple]) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for _, held in pending for t in held
            if isinstance(t, torch.Tensor)]


def _await_freed(refs: list[StorageWeakRef], where: str) -> None:
    """Wait until every storage in ``refs`` is freed ([Note: CUDA lifetimes on the CPU])."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(not r.expired() for r in refs):
        if time.monotonic() > deadline:
            alive = [r for r in refs if not r.expired()]
            raise RuntimeError(
                f"{len(alive)} buffer(s) released by the engine's streams ({where}) are still "
                f"referenced {RELEASE_TIMEOUT_S:.0f} s later: something besides the finished "
                "collective holds them")
        time.sleep(0.0005)


@contextlib.contextmanager
def cuda_code_paths() -> Iterator[None]:
    """Inside, the engine takes its CUDA branches on the CPU ([Note: CUDA lifetimes on the
    CPU]): ``CommStreams`` made inside are in CUDA mode with no-op streams and events, the
    buffer pool allocates plainly and keeps nothing, gathered buffers are resized."""
    from shardwise.distributed.pool import POOL
    from shardwise.shard import streams as streams_mod

    cls = streams_mod.CommStreams
    real_init, real_side, real_settle = cls.__init__, cls.side, cls.settle

    def init(self, device):
        real_init(self, device)
        self.cuda = True

    @contextlib.contextmanager
    def side(self, kind):
        refs = _storages(self._pending[kind])
        with real_side(self, kind):
            _await_freed(refs, f"before a {kind}")
            yield

    def settle(self):
        refs = _storages(p for pending in self._pending.values() for p in pending)
        real_settle(self)
        _await_freed(refs, "at the end of a pass")

    cuda = streams_mod.torch.cuda
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(cls, "__init__", init))
        patch(mock.patch.object(cls, "side", side))
        patch(mock.patch.object(cls, "settle", settle))
        patch(mock.patch.object(cuda, "Event", _Event))
        patch(mock.patch.object(cuda, "Stream", lambda device=None: _Stream()))
        patch(mock.patch.object(cuda, "current_stream", lambda device=None: None))
        patch(mock.patch.object(cuda, "stream", lambda s: contextlib.nullcontext()))
        patch(mock.patch.object(POOL, "take", lambda numel, dtype, device, exact=False:
                                torch.empty(int(numel), dtype=dtype, device=device)))
        patch(mock.patch.object(POOL, "give", lambda buf: None))
        patch(mock.patch("shardwise.shard.unit._CAN_SWAP", False))
        yield
