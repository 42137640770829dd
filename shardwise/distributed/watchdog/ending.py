"""How a rank ends on the watchdog's report, and who names a rank that died.

A rank whose main thread never takes the report (stuck in native code) is ended by
:func:`hard_exit`. A rank that takes it, where a sibling died, first leaves the verdict to the
launcher (:func:`defer_to_launcher`), which knows the exit code and the signal.

[Note: the launcher names a dead rank] When a rank is killed (``kill -9``, the kernel's OOM
killer, a segfault), its peers' collectives fail at once and their watchdogs report "rank 1
stopped answering: its process ... has exited". Only the process's parent knows *how* it
ended (``exit code -9: killed by signal SIGKILL``). A torchelastic agent (torchrun, or
``shardwise train``'s own launch) polls its workers and reports the **first failed worker
it finds**, then stops the others; when a survivor has already exited with its report by
the time the agent polls, the agent finds both and names the survivor (the lowest index
wins), so the message said "rank 0 failed" for a job whose rank 1 was killed, depending on
which process the scheduler ran first (seen once in CI on a loaded machine).

So a survivor that saw a peer *under the same agent* exit abnormally prints its report at
once, then leaves the verdict to the agent: it waits until the agent, having found the dead
rank, stops it (SIGTERM), for at most :data:`LAUNCHER_GRACE_S`. "The same agent" is judged
from the heartbeat: the dead rank ran on this host with this process's parent (the agent, or
the server the agent forks its workers from), and this process runs under torchelastic
(``TORCHELASTIC_RUN_ID``). Without an agent (SLURM's ``srun`` alone, a test harness), or for a
peer on another host, nobody else knows more: the survivor raises its report as before.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from shardwise.distributed.device_watch import abort_communicators
from shardwise.distributed.watchdog.config import CollectiveError

__all__ = ["LAUNCHER_GRACE_S", "defer_to_launcher", "hard_exit", "process_gone", "same_parent"]

LAUNCHER_GRACE_S = 30.0
"""The longest a survivor waits for its agent to stop it (an agent polls every 0.1-5 s)."""


def process_gone(host: str | None, pid: int | None) -> bool:
    """Whether ``pid`` on ``host`` is known to have ended (only judged on this host)."""
    if host != socket.gethostname() or not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def same_parent(beat: Mapping[str, Any]) -> bool:
    """Whether the rank of heartbeat ``beat`` was a child of this process's parent, here."""
    return beat.get("host") == socket.gethostname() and beat.get("ppid") == os.getppid()


def defer_to_launcher(err: BaseException, grace_s: float = LAUNCHER_GRACE_S) -> None:
    """Where a sibling rank died under this process's torchelastic agent, let the agent name it.

    Prints the report (the whole of it on the rank that composed it, one line elsewhere) to
    stderr, then sleeps until the agent stops this process, for at most ``grace_s`` seconds;
    returns at once in every other case. Call it where ``err`` is about to end the rank.
    """
    if not isinstance(err, CollectiveError) or not err.exited_siblings \
            or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _print_report(err)
    time.sleep(grace_s)


def hard_exit(err: CollectiveError) -> None:
    """Report through stderr and torchelastic's error file, abort the NCCL communicators
    (work stuck on them fails instead of waiting for NCCL's timeout), end the process."""
    _print_report(err)
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(CollectiveError(err.report, err.rank, err.reporter))
    except Exception:  # noqa: BLE001 - best effort; stderr already has it
        pass
    abort_communicators()
    os._exit(1)


def _print_report(err: CollectiveError) -> None:
    """The whole report on the rank that composed it, its first line on the others."""
    text = err.report if err.reporter else (
        f"rank {err.rank}: stopped by the shardwise watchdog (report printed by another rank)"
        f"\n{err.report.splitlines()[0]}")
    print(text, file=sys.stderr, flush=True)
