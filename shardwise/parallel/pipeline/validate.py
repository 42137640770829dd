"""Prove a schedule runnable: complete, dependencies in order, messages paired, no deadlock.

Checks, in order (each error names the rank, the action and what is missing):

1. shape: one list per pipeline rank; every action's stage and micro-batch in range; every
   action on the rank that holds its stage.
2. completeness: each (stage, micro-batch) has exactly one F, and either one B or one I and
   one W (never both kinds of backward). A schedule without any backward action is a
   forward-only one (validation, inference): one F each is complete.
3. local order on each rank: F of stage s after F of s-1 (or after the receive of its input);
   B / I after this stage's F and after the next stage's B / I (or the receive of the output
   gradient); W after I; a send after the compute that produced it.
4. messages: every send has its receive and vice versa, only across ranks, and both ends of a
   link list them in the same order (NCCL / Gloo match point-to-point messages in order).
5. no deadlock: the lists are replayed as the executor runs them (replay.py): every receive
   must eventually be sent.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Protocol

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.messages import message_key, needs_message, peer_rank
from shardwise.parallel.pipeline.replay import DeadlockError, replay

__all__ = ["validate_schedule", "ScheduleData"]


class ScheduleData(Protocol):
    """What the checks read of a schedule: ``action_lists.Schedule`` is one (it validates
    itself with :func:`validate_schedule`, so this module sits below it). Read-only, as a
    frozen dataclass's fields are."""

    @property
    def name(self) -> str: ...
    @property
    def pp(self) -> int: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def virtual(self) -> int: ...
    @property
    def placement(self) -> Sequence[int]: ...
    @property
    def ranks(self) -> Sequence[Sequence[Action]]: ...
    @property
    def num_stages(self) -> int: ...

_MAX_LISTED = 8
_BACKWARD = (Kind.B, Kind.I)


def validate_schedule(schedule: ScheduleData) -> None:
    """Raise if ``schedule`` cannot run correctly on real ranks.

    Args:
        schedule: the schedule to check (generated or loaded from CSV).

    Raises:
        ValueError: listing the first problems found, each naming its rank, action and the
            missing dependency; :class:`DeadlockError` (a ValueError) when the lists are sound
            but ranks would wait on each other forever, naming each and what it waits for.
    """
    problems = _shape(schedule)
    if not problems:
        problems = _completeness(schedule)
    if not problems:
        problems = _local_order(schedule) + _messages(schedule)
    head = (f"schedule {schedule.name!r} (pp={schedule.pp}, microbatches="
            f"{schedule.microbatches}, virtual={schedule.virtual}) is invalid:\n  ")
    if problems:
        shown = problems[:_MAX_LISTED]
        more = len(problems) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        raise ValueError(head + "\n  ".join(shown) + tail)
    try:
        replay(schedule.ranks, schedule.placement, cost=lambda a: 0)
    except DeadlockError as exc:
        raise DeadlockError(head + str(exc)) from None


def _shape(s: ScheduleData) -> list[str]:
    problems = []
    for rank, actions in enumerate(s.ranks):
        for i, a in enumerate(actions):
            if not isinstance(a, Action):
                problems.append(f"rank {rank}, action #{i}: {a!r} is not an Action (use "
                                f"Action.parse for text such as '0F3')")
            elif not 0 <= a.stage < s.num_stages:
                problems.append(f"rank {rank}, action #{i} {a}: stage {a.stage} is out of range "
                                f"(the schedule has stages 0..{s.num_stages - 1})")
            elif not 0 <= a.microbatch < s.microbatches:
                problems.append(f"rank {rank}, action #{i} {a}: micro-batch {a.microbatch} is out "
                                f"of range (0..{s.microbatches - 1})")
            elif s.placement[a.stage] != rank:
                problems.append(f"rank {rank}, action #{i} {a}: stage {a.stage} is placed on rank "
                                f"{s.placement[a.stage]}, not rank {rank}")
    return problems


def _completeness(s: ScheduleData) -> list[str]:
    counts = Counter((a.kind, a.stage, a.microbatch) for acts in s.ranks for a in acts
                     if a.is_compute)
    problems = []
    forward_only = not any(k in (Kind.B, Kind.I, Kind.W) for k, _, _ in counts)
    for stage in range(s.num_stages):
        rank = s.placement[stage]
        for mb in range(s.microbatches):
            n = {k: counts[(k, stage, mb)] for k in (Kind.F, Kind.B, Kind.I, Kind.W)}
            if forward_only:
                n[Kind.B] = 1  # nothing to complete: no backward is expected
            for kind, count in n.items():
                if count > 1:
                    problems.append(f"rank {rank}: {Action(stage, kind, mb).describe()} appears "
                                    f"{count} times (expected once)")
            if n[Kind.F] == 0:
                problems.append(f"rank {rank}: {Action(stage, Kind.F, mb).describe()} is missing")
            if n[Kind.B] and (n[Kind.I] or n[Kind.W]):
                problems.append(f"rank {rank}: stage {stage}, micro-batch {mb} has both a full "
                                f"backward (B) and a split one (I/W); use one or the other")
            elif not n[Kind.B] and not (n[Kind.I] and n[Kind.W]):
                missing = [str(Action(stage, k, mb)) for k in (Kind.I, Kind.W) if not n[k]]
                what = (f"{Action(stage, Kind.B, mb)} (or {Action(stage, Kind.I, mb)} + "
                        f"{Action(stage, Kind.W, mb)})" if len(missing) == 2
                        else " and ".join(missing) + " to complete its split backward")
                problems.append(f"rank {rank}: stage {stage}, micro-batch {mb} lacks {what}")
    return problems


def _local_order(s: ScheduleData) -> list[str]:
    problems = []
    for rank, actions in enumerate(s.ranks):
        done: set[tuple[Kind, int, int]] = set()
        backward_done: set[tuple[int, int]] = set()
        for i, a in enumerate(actions):
            for missing in _unmet(s, a, done, backward_done):
                problems.append(f"rank {rank}, action #{i} {a.describe()} runs before "
                                f"{missing}, which it needs, earlier on rank {rank}")
            done.add((a.kind, a.stage, a.microbatch))
            if a.kind in _BACKWARD:
                backward_done.add((a.stage, a.microbatch))
    return problems


def _unmet(s: ScheduleData, a: Action, done, backward_done) -> list[str]:
    """The dependencies of ``a`` that have not run earlier on its rank (as text)."""
    st, mb = a.stage, a.microbatch
    needed: list[tuple[bool, str]] = []
    if a.kind is Kind.F and st > 0:
        dep = (Action(st, Kind.RECV_F, mb) if needs_message(Kind.RECV_F, st, s.placement)
               else Action(st - 1, Kind.F, mb))
        needed.append(((dep.kind, dep.stage, mb) in done, str(dep)))
    elif a.kind in _BACKWARD:
        needed.append(((Kind.F, st, mb) in done, str(Action(st, Kind.F, mb))))
        if st < s.num_stages - 1:
            if needs_message(Kind.RECV_B, st, s.placement):
                needed.append(((Kind.RECV_B, st, mb) in done, str(Action(st, Kind.RECV_B, mb))))
            else:
                needed.append(((st + 1, mb) in backward_done,
                               f"{Action(st + 1, Kind.B, mb)} or {Action(st + 1, Kind.I, mb)}"))
    elif a.kind is Kind.W:
        needed.append(((Kind.I, st, mb) in done, str(Action(st, Kind.I, mb))))
    elif a.kind is Kind.SEND_F:
        needed.append(((Kind.F, st, mb) in done, str(Action(st, Kind.F, mb))))
    elif a.kind is Kind.SEND_B:
        needed.append(((st, mb) in backward_done,
                       f"{Action(st, Kind.B, mb)} or {Action(st, Kind.I, mb)}"))
    return [text for ok, text in needed if not ok]


def _messages(s: ScheduleData) -> list[str]:
    problems = []
    links: dict[tuple[int, int, bool], list[tuple[int, Action]]] = defaultdict(list)
    for rank, actions in enumerate(s.ranks):
        for i, a in enumerate(actions):
            if not a.is_comm:
                continue
            if not needs_message(a.kind, a.stage, s.placement):
                problems.append(f"rank {rank}, action #{i} {a}: no message is needed there "
                                f"(the neighbouring stage is on the same rank, or there is none)")
                continue
            is_send = a.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = peer_rank(a, s.placement)
            src, dst = (rank, peer) if is_send else (peer, rank)
            links[(src, dst, is_send)].append((i, a))
    for (src, dst, is_send), ops in sorted(links.items(), key=lambda kv: kv[0]):
        if not is_send:
            continue
        recvs = links.get((src, dst, False), [])
        problems += _pair_link(src, dst, ops, recvs)
    for (src, dst, is_send), recvs in links.items():
        if not is_send and (src, dst, True) not in links:
            i, a = recvs[0]
            problems.append(f"rank {dst}, action #{i} {a.describe()}: rank {src} never sends it")
    return problems


def _pair_link(src: int, dst: int, sends, recvs) -> list[str]:
    """Both ends of the link src -> dst must list the same messages in the same order."""
    for k, ((i, send), (j, recv)) in enumerate(zip(sends, recvs, strict=False)):
        if message_key(send) != message_key(recv):
            return [f"link rank {src} -> rank {dst}: message #{k} is {send} (rank {src}, action "
                    f"#{i}) but rank {dst} receives {recv} (action #{j}) at that position; "
                    f"point-to-point messages match in order, so both lists must agree"]
    if len(sends) > len(recvs):
        i, send = sends[len(recvs)]
        return [f"rank {src}, action #{i} {send.describe()}: rank {dst} never receives it"]
    if len(recvs) > len(sends):
        j, recv = recvs[len(sends)]
        return [f"rank {dst}, action #{j} {recv.describe()}: rank {src} never sends it"]
    return []
