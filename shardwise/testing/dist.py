"""Run a function on N real Gloo ranks from pytest, with a timeout that never hangs.

Usage (the function must be importable: a module-level function of a test module)::

    def _check(rank, world_size, n):
        ...                       # dist is initialised; return anything picklable
        return value

    def test_something():
        results = run_ranks(_check, world_size=3, args=(7,), timeout_s=60)

Each call gets a fresh rendezvous (a TCPStore on a port the OS picks, so no two tests ever
share one). Ranks are forked from a forkserver that has already imported torch, so a
launch costs tens of milliseconds rather than a fresh interpreter per rank.

When a rank raises, the others get a short grace period; whoever is still running then has
its Python stack dumped (faulthandler) and is killed, and :class:`RankFailure` carries every
rank's traceback or stack. When the whole job outlives ``timeout_s`` the same happens with
:class:`RankTimeout`, so a hung collective fails the test instead of freezing the suite.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.distributed.env import quiet_flight_recorder

__all__ = ["run_ranks", "RankFailure", "RankTimeout"]

_CTX = None


class RankFailure(RuntimeError):
    """One or more ranks raised or died; the message holds every rank's report."""


class RankTimeout(RankFailure):
    """The ranks did not finish within the timeout; the message holds every rank's stack."""


def _context():
    global _CTX  # the forkserver is per process by nature; created once on first use
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # Preloading what every rank imports anyway (checkpointing pulls in dynamo) makes a
        # launch cost a fork instead of seconds of imports per rank.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "torch.utils.checkpoint", "shardwise",
                                    "shardwise.testing.parity"])
        _CTX = ctx
    return _CTX


def _send(conn, msg) -> None:
    # Plain pickle, not multiprocessing's: tensors travel as bytes instead of shared-memory
    # handles that need the sending process to stay alive.
    conn.send_bytes(pickle.dumps(msg))


def _worker(rank: int, world_size: int, port: int, payload: bytes,
            conn, stack_path: str, threads: int, env: dict[str, str], collective_timeout_s: float,
            backend: str) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(threads)
    try:
        fn, args, kwargs = pickle.loads(payload)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        quiet_flight_recorder(backend)  # as shardwise.distributed.init() does
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        result = fn(*args, **kwargs)
        _send(conn, ("ok", result, time.time()))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        _send(conn, ("error", traceback.format_exc(), time.time()))
    finally:
        conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass


def _collect(procs, conns, deadline: float, grace_s: float):
    """Poll ranks until all report, one fails (then grace), or the deadline passes."""
    n = len(procs)
    results: list[Any] = [None] * n
    status: list[str | None] = [None] * n
    errors: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    fail_deadline = None
    while True:
        for r in range(n):
            if status[r] is not None:
                continue
            if conns[r].poll():
                try:
                    kind, payload, when = pickle.loads(conns[r].recv_bytes())
                except EOFError:
                    kind, payload, when = "died", _exit_reason(procs[r]), time.time()
                status[r] = kind
                if kind == "ok":
                    results[r] = payload
                else:
                    errors[r], failed_at[r] = payload, when
            elif not procs[r].is_alive() and not conns[r].poll():
                status[r] = "died"
                errors[r], failed_at[r] = _exit_reason(procs[r]), time.time()
            if r in errors and fail_deadline is None:
                fail_deadline = time.monotonic() + grace_s
        if all(s is not None for s in status):
            return results, status, errors, failed_at, False
        now = time.monotonic()
        if now > deadline or (fail_deadline is not None and now > fail_deadline):
            return results, status, errors, failed_at, now > deadline and not errors
        time.sleep(0.005)


def _exit_reason(proc) -> str:
    proc.join(timeout=1)
    code = proc.exitcode
    sig = f" (signal {signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return f"process exited with code {code}{sig} without reporting"


def _report(status, errors, stacks, header: str) -> str:
    parts = [header]
    for r, s in enumerate(status):
        if s == "ok":
            parts.append(f"--- rank {r}: finished")
        elif s is None:
            parts.append(f"--- rank {r}: still running; its Python stack:\n{stacks.get(r, '?')}")
        else:
            parts.append(f"--- rank {r}: {s}\n{errors.get(r, '')}")
    return "\n".join(parts)


def run_ranks(fn: Callable, world_size: int, args: Sequence = (), kwargs: dict | None = None, *,
              timeout_s: float = 120.0, grace_s: float = 5.0, backend: str = "gloo",
              threads: int | None = None, env: dict[str, str] | None = None,
              collective_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks with a process group initialised.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks (>= 1).
        args, kwargs: passed to ``fn`` on every rank.
        timeout_s: wall-clock limit for the whole job (default 120 s).
        grace_s: after one rank fails, how long the others may take to finish (default 5 s).
        backend: c10d backend (default "gloo").
        threads: intra-op threads per rank (default: cores // world_size, at least 1).
        env: extra environment variables for the ranks.
        collective_timeout_s: the process group's own timeout (default: ``timeout_s``).

    Returns:
        ``fn``'s return values, indexed by rank.

    Raises:
        ValueError: if ``world_size`` < 1.
        RankFailure: a rank raised or died; the message names it and holds every report.
        RankTimeout: the job outlived ``timeout_s``; the message holds every rank's stack.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    coll_timeout = collective_timeout_s or timeout_s
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=coll_timeout))
    tmp = tempfile.mkdtemp(prefix="shardwise-ranks-")
    procs, conns = [], []
    payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    for r in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, daemon=True, args=(
            r, world_size, store.port, payload, child_conn,
            os.path.join(tmp, f"stack{r}.txt"), threads, dict(env or {}), coll_timeout, backend))
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    try:
        results, status, errors, failed_at, timed_out = _collect(
            procs, conns, time.monotonic() + timeout_s, grace_s)
        stacks = {}
        if any(s is None for s in status):
            for r, p in enumerate(procs):
                if status[r] is None and p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.5)
            for r in range(world_size):
                if status[r] is None:
                    with open(os.path.join(tmp, f"stack{r}.txt")) as f:
                        stacks[r] = f.read() or "(no stack captured)"
        if timed_out:
            raise RankTimeout(_report(status, errors, stacks,
                                      f"{fn.__name__} on {world_size} ranks did not finish "
                                      f"within {timeout_s:.0f} s"))
        if errors:
            # A rank that died without reporting is the likeliest root cause: the others'
            # errors are usually their collectives noticing the dead peer.
            order = sorted(errors, key=lambda r: (status[r] != "died", failed_at[r]))
            header = f"{fn.__name__} failed on rank {order[0]} of {world_size} first"
            if len(order) > 1:
                header += f" (then rank(s) {', '.join(map(str, order[1:]))})"
            raise RankFailure(_report(status, errors, stacks, header))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        del store
