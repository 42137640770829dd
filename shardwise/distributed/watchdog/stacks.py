"""Stacks and backend messages, trimmed to what tells a user where their code was.

The watchdog (``__init__.py`` and ``rank.py`` of this package) publishes these in its
reports; the frames of the process bootstrap and of the plumbing between a ``comm.*`` call
and the backend are left out, since they say nothing about the user's program.
"""

from __future__ import annotations

import re
import sys
import threading
import traceback

__all__ = ["SYMPTOMS", "backend_message", "format_frames", "main_stack", "caller_stack",
           "traceback_text"]

# Messages of backend errors that are a symptom of another rank's failure, not a cause.
SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
            "Read error", "Broken pipe", "Socket Timeout", "Connection refused")

_NOISE = ("/multiprocessing/", "<string>", "/shardwise/distributed/optrack.py",
          "/shardwise/distributed/watchdog/__init__.py", "/shardwise/distributed/watchdog/rank.py",
          "/shardwise/distributed/watchdog/stacks.py", "/torch/distributed/c10d_logger.py",
          "/torch/distributed/elastic/multiprocessing/")


def backend_message(exc: BaseException) -> str:
    """The first line of a backend error without its source location and boilerplate."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return text.split(". This is typically")[0]


def format_frames(frames: traceback.StackSummary | list, limit: int = 20) -> str:
    """The last ``limit`` frames of a stack, without bootstrap and comm plumbing."""
    kept = [f for f in frames if not any(n in f.filename for n in _NOISE)
            and not (f.filename.endswith("/shardwise/distributed/comm/__init__.py")
                     and f.name == "_issue")]
    return "".join(traceback.StackSummary.from_list(kept[-limit:]).format())


def main_stack() -> str:
    """The main thread's stack as it is now (called from any thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return format_frames(traceback.extract_stack(frame)) if frame is not None else ""


def caller_stack() -> str:
    """The calling thread's stack."""
    return format_frames(traceback.extract_stack())


def traceback_text(exc: BaseException) -> str:
    """``exc`` formatted like the interpreter does, without the plumbing frames."""
    tb = traceback.TracebackException.from_exception(exc)
    return ("Traceback (most recent call last):\n" + format_frames(tb.stack)
            + "".join(tb.format_exception_only()))

