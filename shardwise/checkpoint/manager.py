"""``Checkpointer``: periodic, optionally background, checkpoints under one folder.

    ckpt = Checkpointer("runs/x/checkpoints", keep_last=3, async_save=True)
    info = ckpt.load("auto", model, optimizer, extra=stateful)   # None: nothing to resume
    for step in range(start + 1, steps + 1):
        train_step(...)
        if step % interval == 0:
            ckpt.save(step, model, optimizer, extra={"step": step, **stateful})
    ckpt.close()                                                   # waits for the last save

[Note: background saves]
``save`` with ``async_save=True`` first waits for the previous save, then copies this rank's
local shards (model, optimizer state; never a whole tensor) into a private CPU snapshot in
the foreground, and hands the snapshot to a thread that writes, hashes and commits it while
training goes on. The snapshot is the only extra memory: ``snapshot_bytes`` per rank (the
rank's share of model + optimizer state), at most one snapshot at a time because a save
waits for the previous one, and ``max_snapshot_bytes`` turns a save that would exceed the
bound into a synchronous one (no copy at all). The thread coordinates over its own Gloo
process group, created once by the Checkpointer, so its collectives never interleave with
training's on the default group. Errors in the thread are raised by the next ``save``,
``wait`` or ``close``.

[Note: resuming past a damaged checkpoint] ``resume="auto"`` means "the newest checkpoint I
can trust". A newest checkpoint damaged after its commit (a file truncated or altered on
disk, a disk that lost a block) used to stop the run after every rank had started; now the
candidates are verified newest first (every file's sha256 against the manifest, the work
split over the ranks, every rank reaching the same verdict) and a damaged one is skipped
with a warning naming it, its step and the failing file. ``shardwise train`` does the same
before any rank starts when it launches the ranks itself (:func:`newest_intact`), and pins
the checkpoint it chose. Only when every checkpoint is damaged does ``auto`` refuse: starting
over silently would throw the run's progress away.
"""

from __future__ import annotations

import datetime
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import atomic
from shardwise.checkpoint.dcp import (
    CheckpointInfo,
    SaveResult,
    copy_tensors,
    load,
    snapshot,
    verify,
    write,
)
from shardwise.checkpoint.errors import CheckpointError
from shardwise.distributed import comm
from shardwise.distributed.comm import objects as comm_objects

__all__ = ["Checkpointer", "resolve_resume", "newest_intact"]


def resolve_resume(resume: str, root: str | os.PathLike) -> Path | None:
    """The checkpoint a ``resume`` setting points to.

    Args:
        resume: ``"auto"`` (the latest complete checkpoint under ``root``, or None when
            there is none), ``"none"`` / ``""`` (None), or a checkpoint folder.
        root: the checkpoint folder of the run.

    Returns:
        The checkpoint folder, or None to start fresh.

    Raises:
        CheckpointError: an explicit path that is not a complete checkpoint.
    """
    if resume in ("", "none"):
        return None
    if resume == "auto":
        return atomic.latest_checkpoint(root)
    path = Path(resume).expanduser()
    atomic.read_manifest(path)
    return path


def newest_intact(root: str | os.PathLike, verify: Callable[[Path], Any] | None = None
                  ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest committed checkpoint under ``root`` that passes ``verify``, and the newer
    ones that did not ([Note: resuming past a damaged checkpoint]).

    Args:
        root: the checkpoint folder of the run.
        verify: called with each candidate, newest first; raises :class:`CheckpointError`
            for a damaged one (default: :func:`atomic.verify_checkpoint`, every file's
            checksum in this process).

    Returns:
        ``(the checkpoint or None when there is none, [(damaged checkpoint, why)])``.
    """
    verify = verify or atomic.verify_checkpoint
    skipped = []
    for _, path in reversed(atomic.list_checkpoints(Path(root))):
        try:
            verify(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return path, skipped
    return None, skipped


class Checkpointer:
    """Checkpoints ``<root>/step_<N>``: save (sync or background), keep the last few, resume.

    Construct it on every rank at the same point (it creates a process group: collective).

    Args:
        root: the folder holding the checkpoints (created on first save).
        keep_last: committed checkpoints to keep; older ones are deleted (0: keep all;
            default 3).
        async_save: write in a background thread (see [Note: background saves]).
        max_snapshot_bytes: largest per-rank snapshot for a background save; a bigger one is
            saved synchronously (default None: no bound).
        timeout_s: collective timeout of the checkpoint process group (default 1800 s).

    Raises:
        ValueError: ``keep_last < 0``.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, async_save: bool = False,
                 max_snapshot_bytes: int | None = None, timeout_s: float = 1800.0) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.root = Path(root)
        self.keep_last, self.async_save = keep_last, async_save
        self.max_snapshot_bytes = max_snapshot_bytes
        self.peak_snapshot_bytes = 0
        self.results: list[SaveResult] = []
        self._pg = None
        if dist.is_initialized():
            self._pg = dist.new_group(backend="gloo",
                                      timeout=datetime.timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def latest(self) -> Path | None:
        """The latest complete checkpoint under ``root``, or None."""
        return atomic.latest_checkpoint(self.root)

    def _agree_bytes(self, nbytes: int) -> int:
        """The largest snapshot of any rank (every rank decides async vs sync alike)."""
        if self._pg is None:
            return nbytes
        t = torch.tensor([nbytes], dtype=torch.int64)  # the manager's own Gloo group: CPU
        comm.all_reduce(t, self._pg, label="checkpoint.snapshot_bytes", op=dist.ReduceOp.MAX)
        return int(t.item())

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None) -> SaveResult | None:
        """Save ``<root>/step_<step>`` (collective); background if ``async_save``.

        Waits for the previous save first. See :func:`shardwise.checkpoint.save` for
        ``extra``.

        Returns:
            The :class:`SaveResult` of a synchronous save; None when it runs in the
            background (:meth:`wait` returns it).

        Raises:
            RuntimeError: the previous background save failed, or this one did.
        """
        self.wait()
        path = self.root / atomic.step_name(step)
        snap = snapshot(model, optimizer, extra, step, copy=False)
        background = self.async_save
        if background and self.max_snapshot_bytes is not None:
            largest = self._agree_bytes(snap.nbytes)
            if largest > self.max_snapshot_bytes:
                warnings.warn(f"checkpoint snapshot of step {step} needs {largest} bytes on "
                              f"some rank, more than max_snapshot_bytes="
                              f"{self.max_snapshot_bytes}; saving synchronously", stacklevel=2)
                background = False
        if not background:
            result = write(path, snap, self._pg, self.keep_last, clean_root=True)
            self.results.append(result)
            return result
        snap.tensors, snap.copied = copy_tensors(snap.tensors), True
        self.peak_snapshot_bytes = max(self.peak_snapshot_bytes, snap.nbytes)
        self._thread = threading.Thread(target=self._run, args=(path, snap),
                                        name=f"shardwise-checkpoint-{step}", daemon=True)
        self._thread.start()
        return None

    def _run(self, path: Path, snap) -> None:
        try:
            self.results.append(write(path, snap, self._pg, self.keep_last, clean_root=True))
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException too
            self._error = exc

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> SaveResult | None:
        """Wait for the background save, if any.

        Returns:
            The last :class:`SaveResult`, or None if nothing was saved.

        Raises:
            RuntimeError: the background save failed (its error chained).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {error}") from error
        return self.results[-1] if self.results else None

    def load(self, resume: str | os.PathLike, model: nn.Module,
             optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, **kwargs: Any) -> CheckpointInfo | None:
        """Load what ``resume`` points to (see :func:`resolve_resume`); None if nothing.

        Every rank resolves ``"auto"`` and rank 0's answer is used, so all load the same one.

        Raises:
            CheckpointError: see :func:`shardwise.checkpoint.load`.
        """
        if str(resume) == "auto":  # [Note: resuming past a damaged checkpoint]
            path = self._newest_intact()
            if path is None:
                return None
            return load(path, model, optimizer, extra=extra, process_group=self._pg,
                        **{"verify_files": False, **kwargs})  # verified just now
        path = resolve_resume(str(resume), self.root)
        if self._pg is not None:
            agreed = comm_objects.broadcast_object(
                str(path) if path is not None else None, dist.get_global_rank(self._pg, 0),
                self._pg, label="checkpoint.resume_path")
            path = Path(agreed) if agreed is not None else None
        if path is None:
            return None
        return load(path, model, optimizer, extra=extra, process_group=self._pg, **kwargs)

    def _newest_intact(self) -> Path | None:
        """``resume="auto"``: rank 0's list of checkpoints, each verified by all ranks
        together (newest first) until one passes; a damaged one is skipped with a warning
        naming it and why."""
        found = [str(p) for _, p in atomic.list_checkpoints(self.root)]
        if self._pg is not None:
            found = comm_objects.broadcast_object(found, dist.get_global_rank(self._pg, 0),
                                                  self._pg, label="checkpoint.resume_list")
        rank = dist.get_rank(self._pg) if self._pg is not None else 0
        for candidate in reversed(found):
            try:
                verify(candidate, self._pg)  # every rank gets the same outcome
            except CheckpointError as exc:
                if rank == 0:
                    warnings.warn(f"checkpoint.resume auto: skipping {candidate}: {exc}; "
                                  f"trying the one before it", stacklevel=3)
                continue
            return Path(candidate)
        if found:
            raise CheckpointError(f"checkpoint.resume auto: every checkpoint under "
                                  f"{self.root} is damaged ({len(found)} checked); expected an "
                                  f"intact one, or resume 'none' to start over", path=self.root)
        return None

    def close(self) -> SaveResult | None:
        """Wait for the last save; the Checkpointer stays usable."""
        return self.wait()



