"""Run one benchmark job on N fresh Gloo ranks, forked from a preloaded forkserver.

Why not ``shardwise.testing.run_ranks``: its forkserver preloads torch and shardwise but
not DeepSpeed or FSDP2, so a DeepSpeed rank would pay its imports (time and ~25 MiB of RSS)
inside the job while the others get theirs for free from the fork. Here the forkserver
preloads every framework the run needs, once, so every job of every framework starts from
the same resident baseline and peak RSS differences are the frameworks' own.

Each job is N new processes (ranks), so a job's peak RSS (``ru_maxrss``) is its own; ranks
talk over Gloo on a TCPStore whose port the OS picks. A job that outlives its timeout, or
in which a rank raises or dies, is killed and reported with every rank's error.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["JobFailure", "run_job", "preload_modules", "use_engine_rev"]

_CTX = None


class JobFailure(RuntimeError):
    """A rank raised, died or the job timed out; the message holds every rank's report."""


def preload_modules(with_deepspeed: bool) -> list[str]:
    """Modules the forkserver imports once before forking ranks."""
    mods = ["torch", "torch.distributed", "torch.nn.parallel",
            "torch.distributed.fsdp", "torch.profiler", "shardwise", "shardwise.models",
            "bench.frameworks", "bench.measure", "bench.worker"]
    if with_deepspeed:
        mods.insert(3, "deepspeed")
    return mods


def _context(with_deepspeed: bool):
    global _CTX  # one forkserver per parent process, started on first use
    if _CTX is None:
        # One intra-op thread per rank; set before the forkserver imports torch so that no
        # OpenMP pool exists in the process the ranks fork from.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Inside a private network namespace c10d warns, per rank, that it cannot resolve
        # the client socket's hostname; harmless, and it buries the progress lines.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # Python 3.11's forkserver ignores the parent's sys.path: it gets the repository
        # (for the bench modules it preloads) through PYTHONPATH, after any engine folder
        # from use_engine_rev, and no '' entry, so the working directory cannot shadow them.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        _pythonpath(root, first=False)
        os.environ["PYTHONSAFEPATH"] = "1"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(preload_modules(with_deepspeed))
        _CTX = ctx
    return _CTX


def use_engine_rev(rev: str, root: str) -> str:
    """Benchmark the shardwise package as committed at ``rev`` instead of the working tree:
    ``git archive`` it into a temporary folder that goes first on ``sys.path`` (the ranks'
    forkserver inherits it). Call before anything imports shardwise. Returns the commit."""
    import atexit
    import shutil
    import subprocess
    import sys
    import tarfile
    import tempfile
    if "shardwise" in sys.modules:
        raise RuntimeError("use_engine_rev must run before shardwise is imported")
    sha = subprocess.run(["git", "-C", root, "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    dest = tempfile.mkdtemp(prefix=f"shardwise-{sha[:10]}-")
    atexit.register(shutil.rmtree, dest, True)
    tar = os.path.join(dest, "src.tar")
    subprocess.run(["git", "-C", root, "archive", "-o", tar, sha, "shardwise"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    sys.path.insert(0, dest)
    _pythonpath(dest, first=True)
    return sha


def _pythonpath(folder: str, first: bool) -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in parts:
        parts = [folder, *parts] if first else [*parts, folder]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def _rank_main(rank: int, world_size: int, port: int, payload: bytes, conn, threads: int,
               timeout_s: float) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        fn, args = pickle.loads(payload)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        result = fn(*args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass


def run_job(fn: Callable, world_size: int, args: Sequence = (), *, threads: int = 1,
            timeout_s: float = 900.0, with_deepspeed: bool = True) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh ranks; return the per-rank results.

    Raises:
        JobFailure: a rank raised or died, or the job outlived ``timeout_s``.
    """
    import torch.distributed as dist
    ctx = _context(with_deepspeed)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    payload = pickle.dumps((fn, tuple(args)))
    procs, conns = [], []
    try:
        for r in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(r, world_size, store.port, payload, send, threads, timeout_s))
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, time.monotonic() + timeout_s, fn.__name__)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        del store


def _collect(procs, conns, deadline: float, name: str) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    status: list[str | None] = [None] * n
    errors: dict[int, str] = {}
    while not all(s is not None for s in status):
        for r in range(n):
            if status[r] is not None:
                continue
            if conns[r].poll():
                try:
                    kind, payload = pickle.loads(conns[r].recv_bytes())
                except EOFError:
                    kind, payload = "died", f"exit code {procs[r].exitcode}"
                status[r] = kind
                if kind == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
            elif not procs[r].is_alive() and not conns[r].poll():
                status[r], errors[r] = "died", f"exit code {procs[r].exitcode}"
        if errors:
            time.sleep(2.0)  # let the other ranks report their side, then give up
            break
        if time.monotonic() > deadline:
            errors.update({r: "timed out" for r in range(n) if status[r] is None})
            break
        time.sleep(0.01)
    if errors:
        body = "\n".join(f"--- rank {r}: {status[r] or 'running'}\n{e}"
                         for r, e in sorted(errors.items()))
        raise JobFailure(f"{name} on {n} ranks failed:\n{body}")
    return results
