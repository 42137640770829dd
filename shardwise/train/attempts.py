"""Which attempt of its job a rank is in, counted across a fault-tolerant group's relaunches.

torchrun's elastic agent numbers its restarts (``TORCHELASTIC_RESTART_COUNT``, 0 for the
first start). The fault-tolerant launcher relaunches a group's agent when the group's
capacity changes (a fault with ``ranks=M``: the group comes back with M ranks,
shardwise/train/fault_tolerant/resize.py); the new agent counts from 0 again, so the launcher
passes the attempts that came before in ``SHARDWISE_FT_ATTEMPT_BASE``. Every reader of the
attempt (fault conditions, the fault log, ``rejoin=``, the attempt's own store keys, resume)
reads :func:`ft_attempt`, so numbering continues across launches. Without that variable (no
fault tolerance, or torchrun on a cluster, whose one agent keeps counting across a
re-rendezvous) it is torchrun's count.
"""

from __future__ import annotations

import os

__all__ = ["ATTEMPT_BASE_ENV", "ft_attempt"]

#: Attempts of this group before its agent's current launch (set for each launch).
ATTEMPT_BASE_ENV = "SHARDWISE_FT_ATTEMPT_BASE"


def ft_attempt() -> int:
    """This rank's attempt: ``$SHARDWISE_FT_ATTEMPT_BASE + $TORCHELASTIC_RESTART_COUNT``
    (each 0 when unset)."""
    return (int(os.environ.get(ATTEMPT_BASE_ENV, "0"))
            + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
