"""When a restarted replica group comes back (at once, at a chosen step, or never), and with
how many ranks.

A group killed by a fault with ``rejoin=N`` (``--faults "kill:group=1:step=40:rejoin=90"``)
restarts at once, as its elastic agent does for any failure, but holds before it builds
anything or joins a quorum until another group has committed step ``N``: a node that comes
back later, or a replacement that takes a while to provision. With ``rejoin=never`` the
group's capacity is gone for good: the restarted ranks leave without training, the launcher
does not count the group as finished or wait for it, and the others finish the run. With
``ranks=M`` the group comes back with M ranks (:func:`restart_size`; resize.py).

Both read the run's own records: the fault log (``<log.dir>/ft/faults.jsonl``, which names
the attempt each fault fired in) and the other groups' journals beside it. That is the
fault-injection harness's world (one machine, or a shared run folder with
``SHARDWISE_FAULT_LOG`` set on a cluster); a group restarted by a real failure finds no fault
of its previous attempt and rejoins at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardwise.train.faults import LOG_ENV
from shardwise.train.fault_tolerant.summary import read_faults, read_journals

__all__ = ["rejoin_target", "restart_size", "hold_until_rejoin", "LEFT_EXIT"]

#: The exit code of a group agent whose group left the run for good (``rejoin=never``): not
#: a failure, and not a group that finished.
LEFT_EXIT = 75


def rejoin_target(ft_dir: Path, group: int, attempt: int) -> int | str | None:
    """The ``rejoin`` of the fault that ended ``group``'s previous attempt: a step, "never",
    or None (no such fault, or it did not say: rejoin at once)."""
    if attempt == 0:
        return None
    ended = [f for f in read_faults(ft_dir)
             if f.get("group") == str(group) and f.get("attempt") == attempt - 1]
    if not ended or ended[-1].get("rejoin") is None:
        return None
    value = ended[-1]["rejoin"]
    return value if value == "never" else int(value)


def restart_size(ft_dir: Path, group: int, attempt: int) -> int | None:
    """The ranks ``group``'s ``attempt`` has: the ``ranks=M`` of the latest fault of that
    group that fired in an earlier attempt (capacity is sticky: a later restart without
    ``ranks=`` keeps it), or None (no such fault: the group's original size)."""
    sized = [f for f in read_faults(ft_dir) if f.get("group") == str(group)
             and f.get("ranks") is not None and f.get("attempt", 0) < attempt]
    return int(sized[-1]["ranks"]) if sized else None


def hold_until_rejoin(group: int, attempt: int, poll_s: float = 0.2) -> bool:
    """Wait until this restarted group may rejoin ([module docstring]).

    Returns:
        True to go on and rejoin; False when the group leaves for good (``rejoin=never``), or
        when the run ended before the step it waits for (nothing is left to rejoin).
    """
    log = os.environ.get(LOG_ENV)
    if not log:
        return True
    ft_dir = Path(log).parent
    target = rejoin_target(ft_dir, group, attempt)
    if target is None:
        return True
    if target == "never":
        return False
    while True:
        others = {g: lines for g, lines in read_journals(ft_dir).items() if g != group}
        done = max((r["step"] for lines in others.values() for r in lines
                    if r.get("event") == "step" and r.get("committed")), default=0)
        if done >= target:
            return True
        if any(r.get("event") == "finish" for lines in others.values() for r in lines):
            return False
        time.sleep(poll_s)

