"""The process local ranks fork from: a forkserver that has imported torch and shardwise once.

Started with "spawn", every local rank is a new interpreter importing torch and shardwise
again: about 3 CPU-seconds a rank before it does anything, paid by every rank of every
launch (and every restart) on the cores the others train on. A forkserver imports them once
and forks each rank from there, so a rank starts in milliseconds. The server initialises no
device and starts no threads, so a fork of it is as clean as a new interpreter; ranks get
their rank, world and rendezvous through the environment the elastic agent hands each one
(``torch.distributed.elastic``), as they would under "spawn".

    method = start_rank_server(fn)  # "forkserver" ("spawn" if another one runs here)
    ...                             # launch run_rank(fn, *args) with start_method=method
    stop_rank_server()              # after the launch: reaped, its ranks' CPU time counted

The server takes this process's environment and standard streams when it starts: set what
the ranks must inherit (``OMP_NUM_THREADS``, ``SHARDWISE_*``) before
:func:`start_rank_server`.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

__all__ = ["run_rank", "start_rank_server", "stop_rank_server"]

_started_here = False
_their_preload: list[str] = []  # the preload list before this module set its own


def start_rank_server(fn: Callable[..., Any]) -> str:
    """Start the forkserver (if this module has not), preloading this module (its
    :func:`run_rank` starts each rank) and the module that defines ``fn`` (the ranks' entry
    point), and everything they import.

    A function of ``__main__`` (a user's script) is not preloaded: the server prepares each
    rank's ``__main__`` as "spawn" does.

    Returns:
        The start method for the ranks: "forkserver", or "spawn" where this process already
        runs a forkserver of someone else's (the standard library keeps one per process: a
        test harness's, say). Forks inherit the server's standard output and error, not
        this process's, so ranks forked from a server started earlier would print where
        this process printed then; and stopping it would cost its owner a new one.
    """
    global _started_here, _their_preload
    from multiprocessing import forkserver

    if _started_here:
        return "forkserver"
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return "spawn"
    _their_preload = list(getattr(forkserver._forkserver, "_preload_modules", []))
    module = fn.__module__
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [__name__] + ([] if module == "__main__" else [module]))
    forkserver.ensure_running()
    _started_here = True
    return "forkserver"


def stop_rank_server() -> None:
    """Stop and reap the forkserver :func:`start_rank_server` started, which reaped the
    ranks: their CPU time then reaches this process's children's, and whoever waits for it
    (a benchmark's accounting) sees it. ``_stop`` is the standard library's own way (used by
    its tests); without it the server exits on its own when this process does, unreaped."""
    global _started_here
    from multiprocessing import forkserver

    if not _started_here:
        return
    forkserver._forkserver._stop()
    forkserver.set_forkserver_preload(_their_preload)
    _started_here = False


def run_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """One launched rank (of :func:`launch_local`, or of torchrun): ``fn(*args)``. Where the
    watchdog's report blames a sibling rank that was killed, the rank waits for the launcher
    to name that rank and its signal
    (:func:`shardwise.distributed.watchdog.ending.defer_to_launcher`)."""
    from shardwise.distributed.watchdog import CollectiveError
    from shardwise.distributed.watchdog.ending import defer_to_launcher

    try:
        return fn(*args)
    except CollectiveError as exc:
        defer_to_launcher(exc)
        raise
