"""How the calibration times things: best-of and median timers, the clock for one thread,
and a launcher for the Gloo ranks its collective micro-benchmarks run on.

    best_time(fn, 3, clock=kernel_clock())    # least seconds of >= 3 calls (and 0.05 s)
    median_time(fn, 5)                        # the median of 5 calls, this thread's time
    per_rank = run_local_ranks(worker, 2, (sizes,), "collective micro-benchmark")
"""

from __future__ import annotations

import math
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["best_time", "median_time", "kernel_clock", "run_local_ranks"]


def best_time(fn: Callable[[], object], repeats: int, min_seconds: float = 0.05,
              max_calls: int = 200, clock: Callable[[], float] = time.perf_counter) -> float:
    """Best of at least ``repeats`` calls, and of as many more as fit in ``min_seconds``
    (after one warm-up call): the minimum filters out the time slices other processes take
    on a shared machine. ``clock=time.thread_time`` (single-threaded kernels) does not
    count them at all."""
    fn()
    best, calls, start = math.inf, 0, time.perf_counter()
    while calls < repeats or (time.perf_counter() - start < min_seconds and calls < max_calls):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
        calls += 1
    return best


def median_time(fn: Callable[[], object], calls: int = 5) -> float:
    """The median CPU time of this thread over ``calls`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def kernel_clock() -> Callable[[], float]:
    """One thread: its own CPU time (other processes' time slices not counted)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def run_local_ranks(target: Callable, world: int, args: Sequence, what: str,
                    timeout_s: float = 120.0) -> list:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` local processes (each
    initialises its own Gloo group on ``127.0.0.1:port`` and puts one result on
    ``queue``); return the results in arrival order.

    Raises:
        RuntimeError: naming ``what``, when a rank dies or hangs past ``timeout_s`` (its
            traceback is on stderr).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork" if not torch.cuda.is_initialized() else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout_s) for _ in procs]
    except Exception:  # queue.Empty: a rank died or hung
        raise RuntimeError(f"{what} on {world} Gloo ranks did not finish within "
                           f"{timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
