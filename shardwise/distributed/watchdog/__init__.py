"""The collective watchdog: no rank hangs silently, every failure names its rank.

    env = shardwise.distributed.init(timeout_s=600)      # starts the watchdog (watchdog="on")
    with shardwise.distributed.watchdog.guard():          # optional: publish own exceptions
        train(...)

While it runs, every collective issued through :mod:`shardwise.distributed.comm` is numbered
and remembered (optrack.py), and a daemon thread on every rank polls the c10d store every
``poll_s``: it writes this rank's heartbeat (progress per process group), checks the shared
alarm, compares its collective fingerprints with each group's first rank, and notices a
collective this rank has waited in for longer than the timeout.

[Note: tripping] The watchdog *trips* when, on some rank,

* a collective fails in the backend (Gloo's own timeout of ``timeout_s``, a peer that closed
  its connection because it died) -- noticed in the calling thread;
* a collective has been waited on for ``timeout_s`` plus a poll interval (a backend that
  does not time out by itself) -- noticed by the thread;
* this rank's fingerprints differ from its group's first rank (a skipped, reordered or
  reshaped collective, even one that Gloo silently matched with another) -- by the thread;
* in the debug mode, a collective's kind, label, shape or dtype differ between the ranks
  about to run it -- before it runs, in the calling thread;
* the code on this rank raised an exception (:func:`guard`, or the interpreter's excepthook);
* another rank raised the alarm.

The tripping rank sets the ``alarm`` key (first one wins) and publishes its *state*
(progress, the collective it waits in, its exception, its Python stack); every other rank's
thread sees the alarm within ``poll_s`` and publishes its own. Each rank then waits up to
``grace_s`` for the states of all ranks that are alive (a rank whose process is gone is not
waited for), composes the report (diagnosis.py) and offers it with ``compare_set``: the first
report stored is the one every rank raises, so there is exactly one message. A rank that
raised an exception of its own publishes it and leaves at once (its exception is the cause).

[Note: a rank that ended] A rank that simply finishes (its loop ran out of data one step
before its peers, a hand-written loop with one micro-batch fewer) is gone by the time a
peer's collective fails with "connection closed", just like a rank that crashed; and its last
periodic heartbeat may be a poll interval old, from before its last collectives. So a
watchdog that stops without having tripped (``destroy``, or the interpreter's exit) writes
one last heartbeat marked ``ended`` with its whole recent history: the report then says the
rank ended without an error and shows its real last collective.

[Note: unblocking] Gloo cannot abort a collective in progress (``ProcessGroupGloo.abort``
returns without waking the waiting thread; measured on torch 2.13), so the watchdog never
relies on it. The report reaches the main thread as :class:`CollectiveError`: raised directly
where the main thread noticed the failure, else injected as an asynchronous exception (taken
at its next Python bytecode). A main thread still blocked in native code is woken when a
peer exits (Gloo fails the collective with "connection closed", which is then re-raised as
the report). If nothing has taken the report after ``exit_grace_s``, the thread writes it
to stderr and to torchelastic's error file and ends the process with ``os._exit(1)``.
"""


from __future__ import annotations

import atexit
import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch.distributed as dist

from shardwise.distributed.watchdog.rank import Watchdog
from shardwise.distributed.watchdog.stacks import SYMPTOMS, backend_message, traceback_text
from shardwise.distributed.watchdog.config import MODES, CollectiveError, WatchdogConfig

__all__ = ["WatchdogConfig", "Watchdog", "CollectiveError", "start", "stop", "active", "guard",
           "guarded", "MODES"]

# ---------------------------------------------------------------------- process-wide


_ACTIVE: list[Watchdog] = []  # at most one: the watchdog of this process's default group


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _ACTIVE[0] if _ACTIVE else None


def start(config: WatchdogConfig | None = None) -> Watchdog | None:
    """Start the watchdog over the default process group (idempotent).

    Args:
        config: timing and mode (default :class:`WatchdogConfig`).

    Returns:
        The watchdog, or None for mode "off" or a world of one rank.
    """
    config = config or WatchdogConfig()
    if _ACTIVE:
        return _ACTIVE[0]
    if config.mode == "off" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    # Every rank starts once per generation (a restart attempt, or init after destroy in one
    # process): the k-th start of every rank reads a count in ((k-1) N, k N], so all ranks
    # agree on k without a collective, and a report of an earlier generation is never read.
    generation = (store.add("shardwise/watchdog/starts", 1) - 1) // world
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    wd = Watchdog(store, dist.get_rank(), world, config,
                  prefix=f"shardwise/watchdog/{attempt}.{generation}/")
    _ACTIVE.append(wd.start())
    _stop_at_exit()
    return wd


_AT_EXIT: list[bool] = []


def _stop_at_exit() -> None:
    """Stop the watchdog before the interpreter finalises (registered once).

    [Note: watchdog at exit] The watchdog's daemon thread spends its polls in the c10d
    store's C++ calls. A process that returns from its script with the thread still
    running (a survivor that caught a CollectiveError and ended) finalises while that
    thread may be inside such a call; when it comes back for the GIL, Python ends it with
    a forced unwind through pybind11's frames, which does not rethrow it, and the process
    aborts (SIGABRT, exit status -6, seen once in CI instead of a clean exit). ``atexit``
    handlers run before daemon threads are ended, so stopping (and joining) the thread
    there closes that window."""
    if not _AT_EXIT:
        atexit.register(stop)
        _AT_EXIT.append(True)


def stop() -> None:
    """Stop this process's watchdog, if one runs."""
    while _ACTIVE:
        _ACTIVE.pop().stop()


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Publish an exception raised inside to the other ranks before it propagates.

    The other ranks then stop within a poll interval with a report naming this rank and its
    exception, instead of waiting in their next collective until the timeout. An exception
    that is itself a symptom of another rank's failure (a collective that lost its peer) is
    replaced by the watchdog's report.
    """
    try:
        yield
    except CollectiveError:
        raise
    except BaseException as exc:
        wd = active()
        if wd is None or (isinstance(exc, SystemExit) and not exc.code):
            raise
        text = str(exc)
        if any(s in text for s in SYMPTOMS):
            raise wd.trip("collective_error", backend_message(exc),
                          stack=traceback_text(exc), by_caller=True) from exc
        wd.publish_failure(exc)
        raise


def guarded(fn: Callable) -> Callable:
    """Decorator: run ``fn`` inside :func:`guard`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with guard():
            return fn(*args, **kwargs)
    return wrapper
