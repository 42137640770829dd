"""Point-to-point messages, counted, labelled and watched like the collectives of ``comm``.

    from shardwise.distributed.comm import p2p
    works = p2p.batch_isend_irecv([
        p2p.Message(activation, peer=1, send=True, label="pp.0SEND_F3"),
        p2p.Message(grad_buffer, peer=1, send=False, label="pp.0RECV_B2"),
    ], group=pp_group)
    for w in works:
        w.wait()

Every point-to-point message shardwise sends goes through :func:`batch_isend_irecv` (a test
fails on any direct ``torch.distributed`` send or receive elsewhere), so that

* each tensor's device is checked against the group's backend first ([Note: device check]
  in comm.py), with a message naming the label;
* :func:`shardwise.comm_stats` counts ``send`` (bytes sent) and ``recv`` (bytes received)
  calls beside the collectives;
* the watchdog sees every wait ([Note: point-to-point tracking]).

[Note: point-to-point tracking] The watchdog numbers the collectives of each process group
and compares their fingerprints across the group's members (optrack.py): every member issues
the same sequence. Point-to-point messages are between two ranks, and a send and its
receive differ by nature (and a pipeline rank talks to different peers than its neighbour),
so they take no part in that sequence: they get no sequence number, no fingerprint and no
place in the history. They are tracked for hangs only: while this rank waits for a message
it is marked blocked with the operation ``send`` / ``recv``, its label and the peer, so a
receive that never completes trips the watchdog after the timeout and the report names the
rank, the message and the peer (``recv 'pp.2RECV_F3' float32[2, 8, 16] (point-to-point
with rank 1)``), and a peer that died fails the wait with the watchdog's report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.optrack import P2P_GROUP, Op
from shardwise.sizes import nbytes

__all__ = ["Message", "batch_isend_irecv", "early_receives_safe"]


@dataclass(frozen=True)
class Message:
    """One send or receive of a batch.

    Attributes:
        tensor: what is sent, or the (contiguous) buffer a receive fills.
        peer: the other rank, as a global rank.
        send: True for a send, False for a receive.
        label: what the message is, shown by the watchdog and in errors (e.g.
            ``"pp.1SEND_F3"``).
    """

    tensor: torch.Tensor
    peer: int
    send: bool
    label: str = ""

    @property
    def kind(self) -> str:
        """``"send"`` or ``"recv"``."""
        return "send" if self.send else "recv"


class _Tracked:
    """A work handle whose ``wait()`` marks this rank blocked in a point-to-point message."""

    __slots__ = ("work", "op", "tracker")

    def __init__(self, work, op: tuple, tracker) -> None:
        self.work, self.op, self.tracker = work, op, tracker

    def wait(self, timeout=None) -> bool:
        return self.tracker.wait(self.work, self.op)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _Done:
    """The handle of a message to oneself (already delivered)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _check(messages: Sequence[Message], group) -> None:
    if not messages:
        raise ValueError("batch_isend_irecv needs at least one Message")
    for m in messages:
        if not isinstance(m, Message):
            raise ValueError(f"batch_isend_irecv takes p2p.Message objects, got "
                             f"{type(m).__name__}")
        comm.check_devices(m.kind, group, m.label, m.tensor)
        if not m.send and not m.tensor.is_contiguous():
            raise ValueError(f"recv {m.label!r}: the receive buffer must be contiguous")


def batch_isend_irecv(messages: Sequence[Message], group=None) -> list:
    """Post every send and receive of ``messages`` at once; return one handle per message.

    Sends and receives between the same two ranks are matched in the order they are posted
    (NCCL and Gloo both), so both ends must list their messages in the same order. With NCCL
    the first point-to-point call on a group must involve all its ranks (do a collective on
    the group first). A message to this very rank is not allowed.

    Args:
        messages: the batch, in posting order.
        group: the process group the peers belong to (default: the world).

    Returns:
        One handle per message, in order; ``wait()`` each (the watchdog marks the rank
        blocked meanwhile, see [Note: point-to-point tracking]). A send's tensor must not be
        modified before its handle is waited for.

    Raises:
        ValueError: no message, a buffer that is not contiguous, or a message to this rank.
        RuntimeError: a tensor on a device the group's backend does not serve (naming the
            label).
    """
    _check(messages, group)
    me = dist.get_rank() if dist.is_initialized() else 0
    for m in messages:
        if m.peer == me:
            raise ValueError(f"{m.kind} {m.label!r}: peer {m.peer} is this rank; hand the "
                             f"tensor over locally instead")
        size = nbytes(m.tensor)
        comm._RECORDER.record(m.kind, group, m.label, size if m.send else 0,
                              0 if m.send else size)
    ops = [dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, m.peer, group)
           for m in messages]
    tracker = comm._RECORDER.tracker
    if tracker is None:
        return list(dist.batch_isend_irecv(ops))
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as exc:  # noqa: BLE001 - re-raised as the watchdog's diagnosis
        op = _op(messages[0])
        raise tracker.on_error(Op(*op[:4], tuple(op[4]), str(op[5]).removeprefix("torch.")),
                               exc) from exc
    return [_Tracked(w, _op(m), tracker) if w is not None else _Done()
            for w, m in zip(works, messages)]


def early_receives_safe(group=None) -> bool:
    """Whether receives on ``group`` may be posted before the rank needs them without holding
    back its other messages: on Gloo (each message progresses on its own), not on NCCL (the
    messages between two ranks share one stream, in posting order). See [Note: early
    receives] in shardwise/parallel/pipeline/mailbox.py."""
    return dist.is_initialized() and dist.get_backend(group) == "gloo"


def _op(m: Message) -> tuple:
    """The tracker's raw operation tuple for ``m`` (see [Note: point-to-point tracking])."""
    return (P2P_GROUP, m.peer, m.kind, m.label, m.tensor.shape, m.tensor.dtype)

