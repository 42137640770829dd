"""One rank's watchdog: the polling thread, tripping, and the agreed report.

See watchdog.py for what trips it and how the report reaches every rank; this module holds
the per-rank machinery, watchdog.py the process-wide entry points.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import socket
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.watchdog.diagnosis import compose, short_group
from shardwise.distributed.optrack import GroupInfo, Op, OpTracker, fingerprint_text, where_text
from shardwise.distributed.watchdog.stacks import (
    backend_message,
    caller_stack,
    main_stack,
    traceback_text,
)
from shardwise.distributed.watchdog.config import CollectiveError, WatchdogConfig
from shardwise.distributed.watchdog.ending import hard_exit, process_gone, same_parent

__all__ = ["Watchdog"]


def _clone(store):
    """A connection of the watchdog's own to ``store`` (the store itself if it cannot)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - e.g. a FileStore or HashStore: share it
        return store


class Watchdog:
    """One rank's watchdog (see the module docstring); use :func:`start` / :func:`stop`.

    Args:
        store: the c10d store of the default process group (cloned: the watchdog talks to
            it on connections of its own).
        rank, world_size: this rank's place in the default group.
        config: timing and mode.
        prefix: key prefix inside the store (one per restart attempt).
    """

    def __init__(self, store, rank: int, world_size: int, config: WatchdogConfig,
                 prefix: str = "shardwise/watchdog/") -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.prefix = prefix
        timeout = datetime.timedelta(seconds=max(2.0, config.grace))
        self._store = dist.PrefixStore(prefix, _clone(store))       # this thread's connection
        self._main_store = dist.PrefixStore(prefix, _clone(store))  # the calling threads'
        for s in (self._store, self._main_store):
            s.set_timeout(timeout)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.context: dict[str, Any] = {}
        """Shown beside this rank in reports, e.g. ``{"step": 7}`` (the trainer sets it)."""
        self.tracker = OpTracker(self._on_collective_error)
        if config.mode == "debug":
            self.tracker.check = self._check_fingerprint
        self._lock = threading.Lock()
        self._report: CollectiveError | None = None
        self._stopped = threading.Event()
        self._taken = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardwise-watchdog",
                                        daemon=True)
        self.tripped_at: float | None = None
        self._ended = False
        self._exited_siblings: tuple[int, ...] = ()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Watchdog:
        comm.set_tracker(self.tracker)
        self._heartbeat(self._main_store)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread; a rank that ends without tripping leaves a last heartbeat that
        says so, with its real last collective ([Note: a rank that ended])."""
        self._stopped.set()
        if comm._RECORDER.tracker is self.tracker:
            comm.set_tracker(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.config.poll + 1)
        if self._report is None and not self._ended:
            self._ended = True
            try:
                self._heartbeat(self._main_store, ended=True)
            except Exception:  # noqa: BLE001 - the store may be gone already (its host ended)
                pass

    @property
    def tripped(self) -> bool:
        return self._report is not None

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        poll, store = self.config.poll, self._store
        while not self._stopped.wait(poll):
            try:
                self._heartbeat(store)
                reason = self._check_alarm(store) or self._check_blocked() \
                    or self._check_marks(store)
            except Exception as exc:  # noqa: BLE001 - an unreachable store must not kill us
                if self._stopped.is_set():
                    return
                reason = None
                if self._store_down_since(exc) > self.config.timeout_s:
                    reason = ("store", f"the c10d store is unreachable ({exc}); the rank that "
                                       "hosts it (rank 0 or the launcher) has probably died")
            if reason is not None and len(reason) == 3:
                # Another rank raised; if this one raises too (an error all ranks agreed on),
                # its own exception is its message: give the main thread a moment first.
                if reason[2] == "exception" and self._stopped.wait(
                        min(1.0, self.config.grace / 2)):
                    return
                reason = reason[:2]
            if reason is not None and not self._stopped.is_set():
                err = self.trip(*reason)
                self._deliver(err)
                return

    _down_since: float | None = None

    def _store_down_since(self, exc: BaseException) -> float:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        return now - self._down_since

    def _heartbeat(self, store, ended: bool = False) -> None:
        beat = {"rank": self.rank, "host": self.host, "pid": self.pid, "ppid": os.getppid(),
                "time": time.time(),
                "context": dict(self.context), **self.tracker.snapshot(recent=16)}
        if ended:
            beat["ended"] = True
        store.set(f"hb/{self.rank}", json.dumps(beat))
        self._down_since = None

    def _check_alarm(self, store) -> tuple[str, str, str] | None:
        if store.check(["alarm"]):
            alarm = json.loads(store.get("alarm"))
            return "alarm", f"rank {alarm['rank']} raised the alarm: {alarm['detail']}", \
                alarm["kind"]
        return None

    def _check_blocked(self) -> tuple[str, str] | None:
        blocked = self.tracker.longest_blocked()
        limit = self.config.timeout_s + self.config.poll
        if blocked is not None and blocked[2] > limit:
            op = blocked[1]
            return "timeout", (f"{fingerprint_text(op.kind, op.label, op.shape, op.dtype)} "
                               f"({where_text(op.group, op.seq, short_group)}) waited on for "
                               f"{blocked[2]:.1f} s (timeout {self.config.timeout_s:g} s)")
        on_device = self.tracker.oldest_on_device()  # [Note: watchdog on NCCL]
        if on_device is not None and on_device[1] > limit:
            op = on_device[0]
            return "timeout", (f"{fingerprint_text(op.kind, op.label, op.shape, op.dtype)} "
                               f"(seq {op.seq} of group {short_group(op.group)}) has not "
                               f"completed on the GPU {on_device[1]:.1f} s after it was issued "
                               f"(timeout {self.config.timeout_s:g} s)")
        return None

    def _check_marks(self, store) -> tuple[str, str] | None:
        mine = dict(self.tracker.marks)
        for info in dict(self.tracker.groups).values():
            leader = min(info.ranks)
            if leader == self.rank or not mine.get(info.name):
                continue
            if not store.check([f"hb/{leader}"]):
                continue
            theirs = json.loads(store.get(f"hb/{leader}")).get("marks", {}).get(info.name, [])
            ours = dict(mine[info.name])
            for seq, h in theirs:
                if seq in ours and ours[seq] != h:
                    return "divergence", (f"the collectives of group {short_group(info.name)} "
                                          f"up to seq "
                                          f"{seq} differ between rank {self.rank} and rank "
                                          f"{leader}")
        return None

    # ------------------------------------------------------------------ tripping

    def _state(self, kind: str, detail: str, failure: str | None = None,
               stack: str | None = None) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "time": time.time(),
                "trigger": {"kind": kind, "detail": detail}, "failure": failure,
                "stack": stack if stack is not None else main_stack(),
                "context": dict(self.context), **self.tracker.snapshot(recent=256)}

    def _raise_alarm(self, store, kind: str, detail: str) -> dict[str, Any]:
        mine = json.dumps({"rank": self.rank, "kind": kind, "detail": detail,
                           "time": time.time()})
        return json.loads(store.compare_set("alarm", "", mine))

    def publish_failure(self, exc: BaseException) -> None:
        """This rank raised ``exc`` on its own: publish it and raise the alarm, then return."""
        with self._lock:
            if self._report is not None:
                return
            failure = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            tb = traceback_text(exc)
            self._report = CollectiveError(failure, self.rank)
            self.tripped_at = time.monotonic()
            self._stopped.set()  # this exception is the message; the thread has nothing to add
        try:
            store = self._main_store
            store.set(f"state/{self.rank}", json.dumps(
                self._state("exception", failure, failure=failure.splitlines()[-1], stack=tb)))
            self._raise_alarm(store, "exception", f"rank {self.rank} raised "
                                                  f"{failure.splitlines()[-1]}")
        except Exception:  # noqa: BLE001 - the store may be gone too; the exception stands
            pass

    def trip(self, kind: str, detail: str, stack: str | None = None,
             by_caller: bool = False) -> CollectiveError:
        """Publish this rank's state, collect the others', compose and agree on the report.

        Runs once per process; later callers get the same :class:`CollectiveError`.

        Args:
            kind, detail: what this rank noticed.
            stack: this rank's stack to publish (default: the main thread's, now).
            by_caller: called from the thread that will raise the report itself (not the
                watchdog's own thread), so nothing needs delivering.
        """
        with self._lock:
            if by_caller:
                self._taken.set()
            if self._report is not None:
                return self._report
            self.tripped_at = time.monotonic()
            store = self._main_store if by_caller else self._store
            try:
                report, mine = self._exchange(store, kind, detail, stack)
            except Exception as exc:  # noqa: BLE001 - no store: report what this rank knows
                report, mine = self._local_report(kind, detail, stack, exc), True
            self._report = CollectiveError(report, self.rank, reporter=mine,
                                           exited_siblings=self._exited_siblings)
            return self._report

    def _local_report(self, kind: str, detail: str, stack: str | None,
                      exc: BaseException) -> str:
        """The report when the store cannot be reached: this rank's view alone."""
        state = self._state(kind, detail, stack=stack)
        unknown = {r: "could not be asked" for r in range(self.world_size) if r != self.rank}
        lines = compose({self.rank: state}, {}, unknown, self.world_size, self.config.timeout_s,
                        {"rank": self.rank, "detail": detail}).splitlines()
        lines[0] = (f"shardwise watchdog: {detail}; the other ranks could not be asked: the "
                    f"c10d store failed ({backend_message(exc)}), so the rank or launcher "
                    "hosting it (rank 0 without torchrun) has probably died")
        return "\n".join(line for line in lines if not line.startswith("  detected by"))

    def _exchange(self, store, kind: str, detail: str, stack: str | None) -> tuple[str, bool]:
        alarm = self._raise_alarm(store, kind, detail)
        store.set(f"state/{self.rank}", json.dumps(self._state(kind, detail, stack=stack)))
        states: dict[int, dict[str, Any]] = {}
        beats: dict[int, dict[str, Any]] = {}
        silent: dict[int, str] = {}
        deadline = time.monotonic() + self.config.grace
        while True:
            for r in range(self.world_size):
                if r not in states and store.check([f"state/{r}"]):
                    states[r] = json.loads(store.get(f"state/{r}"))
            missing = [r for r in range(self.world_size) if r not in states]
            for r in missing:
                if r not in beats and store.check([f"hb/{r}"]):
                    beats[r] = json.loads(store.get(f"hb/{r}"))
            gone = [r for r in missing if r in beats
                    and process_gone(beats[r].get("host"), beats[r].get("pid"))]
            if len(gone) == len(missing) or time.monotonic() > deadline:
                break
            time.sleep(min(0.05, self.config.poll))
        for r in missing:
            hb = beats.get(r)
            if r in gone and hb.get("ended"):  # [Note: a rank that ended]
                silent[r] = (f"its process {hb['pid']} on host {hb['host']} ended without an "
                             "error (its script returned, or it destroyed the process group) "
                             "while this rank still waited for it: the ranks ran different "
                             "numbers of collectives (uneven steps or micro-batches; for "
                             "inputs of different lengths use shardwise.join)")
            elif r in gone:
                if same_parent(hb):  # [Note: the launcher names a dead rank]
                    self._exited_siblings += (r,)
                silent[r] = (f"its process {hb['pid']} on host {hb['host']} has exited: "
                             "killed, out of memory, or crashed in native code")
            else:
                silent[r] = (f"no state within {self.config.grace:g} s: dead, or stuck in "
                             "native code")
        report = compose(states, beats, silent, self.world_size, self.config.timeout_s, alarm)
        mine = f"{self.rank}\n{report}"
        winner = store.compare_set("report", "", mine).decode()
        return winner.split("\n", 1)[1], winner == mine

    def _on_collective_error(self, op: Op, exc: BaseException) -> BaseException:
        """A collective failed in the calling thread: the report replaces the backend error."""
        if self._report is not None:
            self._taken.set()
            return self._report
        text = backend_message(exc)
        kind = "timeout" if "imed out" in text else "collective_error"
        where = f"{fingerprint_text(op.kind, op.label, op.shape, op.dtype)} " \
                f"({where_text(op.group, op.seq, short_group)})"
        stack = caller_stack()
        return self.trip(kind, f"{where} failed: {text}", stack=stack, by_caller=True)

    def _check_fingerprint(self, op: Op, info: GroupInfo) -> None:
        """Debug mode: every member publishes the collective it is about to run; compare."""
        if self._report is not None:
            raise self._report
        store, me = self._main_store, fingerprint_text(op.kind, op.label, op.shape, op.dtype)
        key = f"fp/{op.group}/{op.seq}/"
        store.set(key + str(self.rank), me)
        others = [r for r in info.ranks if r != self.rank]
        keys = [key + str(r) for r in others]
        deadline = time.monotonic() + self.config.timeout_s
        slice_ = datetime.timedelta(seconds=self.config.poll)
        while True:  # in slices, so an alarm raised meanwhile is not missed
            try:
                store.wait(keys, slice_)
                break
            except Exception:  # noqa: BLE001 - not there yet
                if self._report is not None:
                    self._taken.set()
                    raise self._report from None
                if time.monotonic() > deadline:
                    late = [r for r in others if not store.check([key + str(r)])]
                    raise self._raised("timeout", f"{me} (seq {op.seq} of group "
                                          f"{short_group(op.group)}): "
                                                  f"{'rank(s)'} {late} did not reach it within "
                                                  f"{self.config.timeout_s:g} s") from None
        theirs = {r: store.get(key + str(r)).decode() for r in others}
        if op.seq >= 2:
            store.delete_key(f"fp/{op.group}/{op.seq - 2}/{self.rank}")
        odd = {r: t for r, t in theirs.items() if t != me}
        if odd:
            detail = f"seq {op.seq} of group {short_group(op.group)}: rank {self.rank} " \
                f"issues {me}; " + \
                "; ".join(f"rank {r} issues {t}" for r, t in sorted(odd.items()))
            raise self._raised("mismatch", detail)

    def _raised(self, kind: str, detail: str) -> CollectiveError:
        return self.trip(kind, detail, stack=caller_stack(), by_caller=True)

    def _deliver(self, err: CollectiveError) -> None:
        """From the thread: hand the report to the main thread, or end the process."""
        if self._taken.is_set() or self._stopped.is_set():
            return
        main = threading.main_thread()
        taken = self._taken

        def __init__(exc_self) -> None:  # raised in the main thread: the report arrived
            CollectiveError.__init__(exc_self, err.report, err.rank, err.reporter,
                                     err.exited_siblings)
            taken.set()

        cls = type("CollectiveError", (CollectiveError,),
                   {"__init__": __init__, "__module__": CollectiveError.__module__})
        if main.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident),
                                                       ctypes.py_object(cls))
        # A rank waiting in a collective is woken when a peer exits, so the ranks that are
        # not (stuck elsewhere) are ended first: their exit unblocks the others.
        grace = self.config.exit_grace
        if self.tracker.longest_blocked() is not None:
            grace += max(2.0, self.config.grace)
        if self._taken.wait(grace) or self._stopped.wait(0.0):
            return
        if self._stopped.is_set():
            return
        hard_exit(err)
