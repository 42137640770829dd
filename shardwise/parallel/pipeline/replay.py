"""Replay per-rank action lists as the executor runs them: times, or the deadlock.

The one model of execution shared by the validator (zero costs: does every rank finish?), the
simulator (real costs: when does each action start and end?) and the planner (a cost callback
per action, and ranks that slow each other while they compute at once). See [Note:
communication semantics] in messages.py: compute actions run one after another on their rank
(the engine's actions take no time); consecutive communication actions are one batch,
reached when the rank gets there; its sends are posted then and never waited for; its
receives complete ``latency`` after their sends were posted, and the rank resumes when all
of them have.

    times = replay(ranks, placement, cost)                    # every rank at its own speed
    step, busy = replay_shared(ranks, placement, cost, (1.0, 1.3))  # 2 ranks computing: 1.3x
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.messages import batch_end, message_key, peer_rank

__all__ = ["DeadlockError", "replay", "replay_shared"]

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


def _post_batch(actions: Sequence[Action], pos: int, posted: dict, now, placement
                ) -> tuple[int, set[int], list]:
    """Reach the batch of communication actions at ``pos``: post its sends not posted yet
    (at ``now``). Returns (the index past the batch, the ranks the new sends go to, the
    messages its receives wait for)."""
    end = batch_end(actions, pos)
    woken: set[int] = set()
    receives = []
    for op in actions[pos:end]:
        key, is_send = _side(op)
        if not is_send:
            receives.append(key)
        elif key not in posted:
            posted[key] = now
            woken.add(peer_rank(op, placement))
    return end, woken, receives


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
        if action.is_compute or action.is_engine:  # engine actions take no time
            end = me.now + cost(action) if action.is_compute else me.now
            times[rank][me.pos] = (me.now, end)
            me.now = end
            me.pos += 1
            continue
        end_index, sent_to, keys = _post_batch(me.actions, me.pos, posted, me.now, placement)
        woken |= sent_to
        if not all(key in posted for key in keys):
            return woken
        done = max([me.now] + [posted[key] + latency for key in keys])
        for i in range(me.pos, end_index):
            key, is_send = _side(me.actions[i])
            times[rank][i] = (me.now, me.now + latency) if is_send else (me.now, done)
        me.now = done
        me.pos = end_index
    return woken


def replay_shared(ranks: Sequence[Sequence[Action]], placement: Sequence[int],
                  cost: Callable[[Action], float], slowdown: Sequence[float]
                  ) -> tuple[float, tuple[float, ...]]:
    """Replay the lists as processor sharing: between two events (an action starting or
    ending) each of the ``n`` ranks computing works at ``1 / slowdown[n - 1]`` of its own
    speed (the last factor holds for more); messages are free.

    Args:
        ranks, placement: as :func:`replay`.
        cost: seconds of a compute action at a rank's own speed.
        slowdown: per count of ranks computing at once, each one's slowdown (>= 1).

    Returns:
        (seconds from the first compute action's start to the last one's end, per rank its
        compute seconds as stretched by the ranks computing beside it).

    Raises:
        DeadlockError: when no rank can move and some have not finished.
    """
    state = [_Rank(list(actions)) for actions in ranks]
    work: list[float | None] = [None] * len(state)  # own-speed seconds left of the action
    busy, posted, now = [0.0] * len(state), {}, 0.0

    def advance(r: int) -> bool:  # to its next compute action, starting now; moved?
        me, moved = state[r], False
        while work[r] is None and me.pos < len(me.actions):
            action = me.actions[me.pos]
            if action.is_compute:
                work[r], me.now = float(cost(action)), now
                return True
            if action.is_engine:
                me.pos, moved = me.pos + 1, True
                continue
            end, sent_to, keys = _post_batch(me.actions, me.pos, posted, now, placement)
            moved = moved or bool(sent_to)
            if not all(key in posted for key in keys):
                return moved
            me.pos, moved = end, True
        return moved

    while True:
        while any([advance(r) for r in range(len(state)) if work[r] is None]):
            pass  # a send may let a rank already passed over move on
        running = [r for r in range(len(state)) if work[r] is not None]
        if not running:
            break
        slow = slowdown[min(len(running), len(slowdown)) - 1]
        dt = min(work[r] for r in running) * slow  # until the next action ends
        now += dt
        for r in running:
            work[r] -= dt / slow
            if work[r] <= 1e-12 * max(1.0, now):
                busy[r] += now - state[r].now
                state[r].pos, work[r] = state[r].pos + 1, None
    blocked = [r for r, s in enumerate(state) if s.pos < len(s.actions)]
    if blocked:
        raise DeadlockError(_deadlock_message(blocked, state, posted, placement))
    return now, tuple(busy)


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
