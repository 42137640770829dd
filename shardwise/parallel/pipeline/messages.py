"""Which point-to-point messages a stage placement needs, and inserting them into action lists.

A message crosses between neighbouring stages held by different ranks: the forward activation
of stage ``s`` goes to ``s + 1`` and the input gradient of ``s`` goes back to ``s - 1``.
Neighbouring stages on the same rank (the bottom of a V placement, or one rank holding
everything) hand over locally and need no message.

[Note: communication semantics]
The executor and the simulator read communication actions the same way (the way
``torch.distributed.pipelining``'s runtime and DeepSeek's DualPipe run them):

- Consecutive communication actions of one rank form one *batch*, issued together (one
  ``torch.distributed.batch_isend_irecv`` for its receives) when the rank reaches it.
- Sends are eager: posted when the batch is reached, never waited for before the end of the
  step (the executor keeps their handles and waits at the end). A rank therefore never stalls
  on a send, and two ranks sending to each other cannot block each other.
- The rank waits for every receive of the batch before its next compute action. Placing a
  receive early (as DualPipe does) makes the rank wait for it early.
- NCCL and Gloo match the messages between two ranks in the order they were posted, so the
  k-th send from rank a to rank b must be the k-th receive on b from a (a mismatch would hand
  a tensor to the wrong micro-batch, or deadlock).

The validator checks the ordering rule and replays the lists under these semantics to prove
that every receive is eventually sent (no cycle of ranks waiting on each other); the
simulator times the same replay.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.parallel.pipeline.actions import Action, Kind

__all__ = ["add_communication", "message_key", "peer_rank", "needs_message", "batch_end",
           "steps"]


def needs_message(kind: Kind, stage: int, placement: Sequence[int]) -> bool:
    """Whether ``stage`` needs a communication action of ``kind`` under ``placement``.

    Args:
        kind: SEND_F, RECV_F, SEND_B or RECV_B.
        stage: the stage owning the action.
        placement: stage -> rank.
    """
    neighbour = stage + 1 if kind in (Kind.SEND_F, Kind.RECV_B) else stage - 1
    if not 0 <= neighbour < len(placement):
        return False
    return placement[neighbour] != placement[stage]


def peer_rank(action: Action, placement: Sequence[int]) -> int:
    """The rank at the other end of a communication action."""
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        return placement[action.stage + 1]
    return placement[action.stage - 1]


def message_key(action: Action) -> tuple[str, int, int]:
    """What travels: ``("F"|"B", sending stage, micro-batch)``; a send and its receive share it."""
    if action.kind is Kind.SEND_F:
        return ("F", action.stage, action.microbatch)
    if action.kind is Kind.RECV_F:
        return ("F", action.stage - 1, action.microbatch)
    if action.kind is Kind.SEND_B:
        return ("B", action.stage, action.microbatch)
    if action.kind is Kind.RECV_B:
        return ("B", action.stage + 1, action.microbatch)
    raise AssertionError(f"{action} is not a communication action")


def batch_end(actions: Sequence[Action], start: int) -> int:
    """Index just past the batch of communication actions that begins at ``start``."""
    end = start
    while end < len(actions) and actions[end].is_comm:
        end += 1
    return end


def steps(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """A rank's list as the executor runs it: each compute action alone, and each run of
    consecutive communication actions together (one batch, see [Note: communication
    semantics]).

    Args:
        actions: one rank's actions.

    Returns:
        The steps in order; a step is ``(compute,)`` or a tuple of communication actions.
    """
    out, i = [], 0
    while i < len(actions):
        end = batch_end(actions, i) if actions[i].is_comm else i + 1
        out.append(tuple(actions[i:end]))
        i = end
    return out


def add_communication(ranks: Sequence[Sequence[Action]],
                      placement: Sequence[int]) -> tuple[tuple[Action, ...], ...]:
    """Insert the sends and receives a compute-only schedule needs.

    A send goes right after the compute action that produced it. Before a compute action that
    consumes a message, the rank receives it together with every message its peer sent on that
    link before it and that is not received yet: the link then lists its messages in the same
    order at both ends (see [Note: communication semantics]), and since those earlier messages
    were sent first, receiving them early never makes the rank wait longer.

    Args:
        ranks: per pipeline rank, its compute actions (F, B, I, W) in order.
        placement: stage -> rank.

    Returns:
        Per rank, the actions with communication inserted.

    Raises:
        ValueError: if a list already holds communication actions (naming rank and action).
    """
    sends = [_with_sends(rank, actions, placement) for rank, actions in enumerate(ranks)]
    link_order: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> receives, in order
    for rank, row in enumerate(sends):
        for a in row:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                link_order.setdefault((rank, peer_rank(a, placement)), []).append(_receive_of(a))
    return tuple(_with_receives(rank, row, placement, link_order)
                 for rank, row in enumerate(sends))


def _with_sends(rank: int, actions: Sequence[Action], placement: Sequence[int]) -> list[Action]:
    row: list[Action] = []
    for action in actions:
        if action.is_comm:
            raise ValueError(f"rank {rank} already has communication action {action}: "
                             f"add_communication takes compute-only lists (F, B, I, W)")
        row.append(action)
        s, mb = action.stage, action.microbatch
        if action.kind is Kind.F and needs_message(Kind.SEND_F, s, placement):
            row.append(Action(s, Kind.SEND_F, mb))
        if action.kind in (Kind.B, Kind.I) and needs_message(Kind.SEND_B, s, placement):
            row.append(Action(s, Kind.SEND_B, mb))
    return row


def _receive_of(send: Action) -> Action:
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    return Action(send.stage - 1, Kind.RECV_B, send.microbatch)


def _with_receives(rank: int, row: Sequence[Action], placement: Sequence[int],
                   link_order: dict[tuple[int, int], list[Action]]) -> tuple[Action, ...]:
    position = {(src, recv): i for (src, dst), recvs in link_order.items() if dst == rank
                for i, recv in enumerate(recvs)}
    received: dict[int, int] = {}  # peer -> how many of its messages this rank has received
    out: list[Action] = []
    for action in row:
        s, mb = action.stage, action.microbatch
        need = None
        if action.kind is Kind.F and needs_message(Kind.RECV_F, s, placement):
            need = Action(s, Kind.RECV_F, mb)
        elif action.kind in (Kind.B, Kind.I) and needs_message(Kind.RECV_B, s, placement):
            need = Action(s, Kind.RECV_B, mb)
        if need is not None:
            peer = peer_rank(need, placement)
            if (peer, need) not in position:
                raise ValueError(f"rank {rank}: {action.describe()} needs {need}, but rank {peer}"
                                 f" never runs the action that produces it")
            start, stop = received.get(peer, 0), position[(peer, need)] + 1
            out.extend(link_order[(peer, rank)][start:stop])
            received[peer] = max(start, stop)
        out.append(action)
    return tuple(out)
