"""Per-collective bookkeeping for the watchdog: sequence numbers, history, blocking, hashes.

While a :class:`~shardwise.distributed.watchdog.Watchdog` runs, ``comm`` hands every
collective that reaches the backend to :meth:`OpTracker.run`. The tracker

* numbers it within its process group (``seq``, from 0, per c10d group name, so rank ``r``'s
  seq 41 on group "0" is the same collective as every other member's seq 41 on group "0");
* remembers it in a short history (group, seq, kind, label, shape, dtype);
* folds its fingerprint (kind, label, shape, dtype) into a running per-group hash and keeps
  the hash every ``mark_every`` collectives: two ranks whose hashes differ at the same seq
  issued different collectives somewhere before it (a skipped, reordered or reshaped one),
  which the watchdog thread notices without any communication on the hot path;
* marks the calling thread as blocked while a synchronous collective runs or while an
  asynchronous one is waited on, so the watchdog can tell a rank that waits in a collective
  from one that computes (or is stuck elsewhere);
* turns an exception from the backend into the watchdog's diagnosis (``on_error``).

[Note: tracking cost] The hot path is a few dict and deque operations, one cached hash
lookup and one ``time.monotonic()`` per collective, plus a small wrapper object for each
asynchronous work handle: microseconds per collective, small against the smallest Gloo
collective (``python bench/soak.py --overhead`` measures both; docs/engine.md,
"Measurements behind the notes").
Nothing is communicated per collective except in the debug mode (``check``), which
exchanges fingerprints through the c10d store before every collective.

All collectives of one process group are expected to be issued from one thread at a time
(as the engine does); the bookkeeping relies on the GIL, not on a lock.
"""

from __future__ import annotations

import time
import zlib
from threading import get_ident
from time import monotonic
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

from shardwise.distributed.device_watch import DeviceWatch, probe_for

__all__ = ["Op", "GroupInfo", "OpTracker", "op_dict", "fingerprint_text", "where_text",
           "P2P_GROUP"]

_MASK = (1 << 61) - 1

P2P_GROUP = "p2p"
"""The group name of a point-to-point message the tracker marks as blocking; its ``seq``
holds the peer's global rank ([Note: point-to-point tracking] in p2p.py)."""


class Op(NamedTuple):
    """One collective as the tracker saw it."""

    group: str
    seq: int
    kind: str
    label: str
    shape: tuple[int, ...] | None
    dtype: str | None

    def text(self) -> str:
        return fingerprint_text(self.kind, self.label, self.shape, self.dtype)


def _op(name: str, seq: int, kind: str, label: str, shape, dtype) -> Op:
    """An :class:`Op` from the tracker's raw tuple (torch.Size / torch.dtype inside)."""
    return Op(name, seq, kind, label, tuple(shape) if shape is not None else None,
              str(dtype).removeprefix("torch.") if dtype is not None else None)


class GroupInfo(NamedTuple):
    """A process group as all its members name it."""

    name: str
    ranks: tuple[int, ...]


def fingerprint_text(kind: str, label: str, shape, dtype) -> str:
    """What must agree across the ranks of a group: ``"all_reduce 'lbl' float32[4, 2]"``."""
    if shape is None:
        return f"{kind} {label!r}"
    return f"{kind} {label!r} {dtype}[{', '.join(map(str, shape))}]"


def where_text(group: str, seq: int, short: Callable[[str], str] = str) -> str:
    """Where an operation sits: ``seq 41 of group 0``, or ``point-to-point with rank 1``.

    Args:
        group: the group name (``P2P_GROUP`` for a point-to-point message).
        seq: its sequence number in the group (the peer rank for a message).
        short: how to show a group name (e.g. diagnosis.short_group).
    """
    if group == P2P_GROUP:
        return f"point-to-point with rank {seq}"
    return f"seq {seq} of group {short(group)}"


def op_dict(op: Op, **extra: Any) -> dict[str, Any]:
    """A JSON-ready form of ``op`` (for the store)."""
    return {"group": op.group, "seq": op.seq, "kind": op.kind, "label": op.label,
            "shape": list(op.shape) if op.shape is not None else None, "dtype": op.dtype,
            **extra}


class _Watched:
    """An asynchronous work handle whose ``wait()`` is tracked (see :class:`OpTracker`)."""

    __slots__ = ("work", "op", "tracker")

    def __init__(self, work, op: tuple, tracker: OpTracker) -> None:
        self.work, self.op, self.tracker = work, op, tracker

    def wait(self, timeout=None) -> bool:
        return self.tracker.wait(self.work, self.op)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.work, name)


class OpTracker:
    """Bookkeeping of the collectives this rank issues (see the module docstring).

    Args:
        on_error: ``(op, exc) -> BaseException``: the exception to raise instead of ``exc``
            when the backend fails inside ``op`` (called in the failing thread).
        history: collectives remembered (all groups together).
        mark_every: keep the running hash of a group every this many collectives.
        marks_kept: hashes kept per group.
    """

    def __init__(self, on_error: Callable[[Op, BaseException], BaseException], *,
                 history: int = 256, mark_every: int = 16, marks_kept: int = 32) -> None:
        self.on_error = on_error
        self.mark_every = mark_every
        self.marks_kept = marks_kept
        self.groups: dict[int, GroupInfo] = {}
        self.seq: dict[str, int] = {}
        self.hash: dict[str, int] = {}
        self.marks: dict[str, deque[tuple[int, int]]] = {}
        self.history: deque[Op] = deque(maxlen=history)
        self.blocked: dict[int, tuple[Op, float]] = {}
        self._fp_cache: dict[tuple, int] = {}
        self.check: Callable[[Op, GroupInfo], None] | None = None
        """Debug mode: called before every collective; raises when the ranks disagree."""
        self.device = DeviceWatch()
        """Collectives queued on a GPU stream ([Note: watchdog on NCCL])."""
        self.fault: Callable[[str, str], str | None] | None = None
        """Fault injection, ``(kind, label) -> "skip" | None``: "skip" drops the collective
        on this rank as if the code never called it."""

    # ------------------------------------------------------------------ hot path

    def _group(self, group) -> GroupInfo:
        pg = group if group is not None else dist.group.WORLD
        info = GroupInfo(pg.group_name, tuple(dist.get_process_group_ranks(pg)))
        self.groups[id(group)] = info
        self.marks.setdefault(info.name, deque(maxlen=self.marks_kept))
        return info

    def _fingerprint(self, key: tuple) -> int:
        if len(self._fp_cache) > 4096:
            self._fp_cache.clear()
        fp = self._fp_cache[key] = zlib.crc32(_op("", 0, *key).text().encode())
        return fp

    def run(self, kind: str, group, label: str, tensor, async_op: bool, fn, /, *args,
            **kwargs):
        """Issue ``fn(*args, **kwargs)`` (a c10d collective) with bookkeeping.

        ``tensor`` is what every rank of the group must agree on (None: only kind and label,
        e.g. an all-to-all with per-rank split sizes).
        """
        if self.fault is not None and self.fault(kind, label) == "skip":
            return None
        info = self.groups.get(id(group)) or self._group(group)
        name = info.name
        seq = self.seq.get(name, 0)
        self.seq[name] = seq + 1
        key = (kind, label, tensor.shape, tensor.dtype) if tensor is not None else \
            (kind, label, None, None)
        # A plain tuple (name, seq, kind, label, shape, dtype): an Op costs 3x more to build.
        op = (name, seq) + key
        self.history.append(op)
        fp = self._fp_cache.get(key)
        if fp is None:
            fp = self._fingerprint(key)
        h = self.hash[name] = (self.hash.get(name, 0) * 1000003 + fp) & _MASK
        if seq % self.mark_every == self.mark_every - 1:
            self.marks[name].append((seq, h))
        if self.check is not None:
            self.check(_op(*op), info)
        if async_op:
            try:
                work = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a broken group fails at issue
                raise self.on_error(_op(*op), exc) from exc
            probe = probe_for(work, tensor)
            if probe is not None:
                self.device.add(op, probe)
            return _Watched(work, op, self) if work is not None else None
        blocked, tid = self.blocked, get_ident()
        blocked[tid] = (op, monotonic())
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised as the watchdog's diagnosis
            raise self.on_error(_op(*op), exc) from exc
        finally:
            del blocked[tid]
        probe = probe_for(None, tensor)
        if probe is not None:
            self.device.add(op, probe)
        return result

    def wait(self, work, op: tuple) -> bool:
        """Wait for an asynchronous collective, marked as blocked meanwhile."""
        blocked, tid = self.blocked, get_ident()
        blocked[tid] = (op, monotonic())
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised as the watchdog's diagnosis
            raise self.on_error(_op(*op), exc) from exc
        finally:
            del blocked[tid]
        return True

    # ------------------------------------------------------------------ snapshots

    def longest_blocked(self) -> tuple[int, Op, float] | None:
        """(thread id, op, seconds blocked) of the longest wait in progress, or None."""
        now = time.monotonic()
        best = None
        for tid, (op, since) in dict(self.blocked).items():
            if best is None or now - since > best[2]:
                best = (tid, _op(*op), now - since)
        return best

    def oldest_on_device(self) -> tuple[Op, float] | None:
        """(op, seconds since issue) of the oldest GPU collective not yet complete, or None
        ([Note: watchdog on NCCL])."""
        oldest = self.device.oldest()
        return (_op(*oldest[0]), oldest[1]) if oldest is not None else None

    def snapshot(self, recent: int = 32) -> dict[str, Any]:
        """This rank's progress, JSON-ready: next seq and kept hashes per group, recent ops."""
        ops = [_op(*op) for op in list(self.history)[-recent:]]
        blocked = self.longest_blocked()
        return {
            "seqs": dict(self.seq),
            "marks": {g: [list(m) for m in marks] for g, marks in dict(self.marks).items()},
            "groups": {info.name: list(info.ranks) for info in dict(self.groups).values()},
            "recent": [op_dict(op) for op in ops],
            "blocked": (op_dict(blocked[1], seconds=round(blocked[2], 3))
                        if blocked is not None else None),
        }
