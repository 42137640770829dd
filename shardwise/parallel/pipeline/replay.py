"""Replay per-rank action lists as the executor runs them: times, or the deadlock.

The one model of execution shared by the validator (zero costs: does every rank finish?) and
the simulator (real costs: when does each action start and end?). See [Note: communication
semantics] in p2p.py: compute actions run one after another on their rank; consecutive
communication actions are one batch, reached when the rank gets there; its sends are posted
then and never waited for; its receives complete ``latency`` after their sends were posted, and
the rank resumes when all of them have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.p2p import batch_end, message_key, peer_rank

__all__ = ["DeadlockError", "replay"]

_SENDS = (Kind.SEND_F, Kind.SEND_B)


class DeadlockError(ValueError):
    """Some ranks wait forever; the message names each blocked rank and what it waits for."""


@dataclass
class _Rank:
    actions: Sequence[Action]
    pos: int = 0
    now: Any = 0


def _side(action: Action) -> tuple[tuple[str, int, int], bool]:
    return message_key(action), action.kind in _SENDS


def replay(ranks: Sequence[Sequence[Action]], placement: Sequence[int],
           cost: Callable[[Action], Any], latency: Any = 0) -> list[list[tuple[Any, Any]]]:
    """Run the lists; return per rank, per action, its ``(start, end)`` time.

    Replay is event-driven: a rank runs until a receive it waits for has not been sent yet, and
    is woken again when the sending rank posts it (O(actions) overall).

    Args:
        ranks: per rank, its actions (compute and communication).
        placement: stage -> rank (to find each message's peer).
        cost: duration of a compute action.
        latency: time from posting a send until its receive can complete.

    Returns:
        ``times[rank][i] = (start, end)`` of ``ranks[rank][i]``; for a send, when it was
        posted and ``latency`` later; for a receive, when its batch was reached and completed.

    Raises:
        DeadlockError: when no rank can move and some have not finished.
    """
    state = [_Rank(list(actions)) for actions in ranks]
    times: list[list[tuple[Any, Any]]] = [[(0, 0)] * len(a) for a in ranks]
    posted: dict[tuple[str, int, int], Any] = {}  # message -> when its send was posted
    work = deque(range(len(state)))
    queued = set(work)
    while work:
        rank = work.popleft()
        queued.discard(rank)
        for woken in _advance(rank, state, times, posted, placement, cost, latency):
            if woken not in queued:
                queued.add(woken)
                work.append(woken)
    blocked = [r for r, s in enumerate(state) if s.pos < len(s.actions)]
    if blocked:
        raise DeadlockError(_deadlock_message(blocked, state, posted, placement))
    return times


def _advance(rank: int, state: list[_Rank], times, posted, placement, cost, latency) -> set[int]:
    """Move ``rank`` as far as it can; return the ranks its new sends may unblock."""
    me = state[rank]
    woken: set[int] = set()
    while me.pos < len(me.actions):
        action = me.actions[me.pos]
        if action.is_compute:
            end = me.now + cost(action)
            times[rank][me.pos] = (me.now, end)
            me.now = end
            me.pos += 1
            continue
        end_index = batch_end(me.actions, me.pos)
        batch = me.actions[me.pos:end_index]
        for op in batch:
            key, is_send = _side(op)
            if is_send and key not in posted:
                posted[key] = me.now
                woken.add(peer_rank(op, placement))
        keys = [_side(op)[0] for op in batch if not _side(op)[1]]
        if not all(key in posted for key in keys):
            return woken
        done = max([me.now] + [posted[key] + latency for key in keys])
        for i in range(me.pos, end_index):
            key, is_send = _side(me.actions[i])
            times[rank][i] = (me.now, me.now + latency) if is_send else (me.now, done)
        me.now = done
        me.pos = end_index
    return woken


def _deadlock_message(blocked: list[int], state: list[_Rank], posted, placement) -> str:
    lines = []
    for rank in blocked:
        me = state[rank]
        end = batch_end(me.actions, me.pos)
        for i in range(me.pos, end):
            op = me.actions[i]
            key, is_send = _side(op)
            if is_send or key in posted:
                continue
            peer = peer_rank(op, placement)
            peer_state = state[peer]
            where = (f"its action #{peer_state.pos} {peer_state.actions[peer_state.pos]}"
                     if peer_state.pos < len(peer_state.actions) else "the end of its list")
            lines.append(f"rank {rank} waits at action #{i} {op.describe()} for rank {peer} to "
                         f"send it, but rank {peer} is stuck at {where}")
    return ("the schedule deadlocks: these ranks wait for messages that are never sent (see "
            "[Note: communication semantics]):\n  " + "\n  ".join(lines))
