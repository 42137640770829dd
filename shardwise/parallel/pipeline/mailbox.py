"""The executor's messages: batches of sends and receives, local hand-overs, agreed shapes.

A message is keyed by what travels (``messages.message_key``: ``("F", stage, mb)`` for the output
of ``stage``, ``("B", stage, mb)`` for the gradient of its input). A compute action *posts*
what it produced and *takes* what it consumes; a batch of communication actions moves posted
tensors to the peer ranks and fills the receive buffers. Between two stages on one rank (the
bottom of a V) the posted tensor is handed over directly.

[Note: agreed shapes] A receive needs a buffer of the right shape and dtype before the data
arrives. The gradient of a stage's output has the output's shape, which the receiving rank
computed itself. An activation's shape is known only to its sender, so the first activation
on each link under a given micro-batch shape (every rank sees the batch, so every rank knows
when that shape changes) is preceded by a small int64 message carrying its shape and dtype;
the receiver takes it, allocates the buffer and then posts the receive of the data. After
that the shape is agreed and activations travel alone. Micro-batches of one step may differ
(a list of micro-batches whose inputs differ in shape: one with no image): each has its own
signature, the shapes of its inputs, which every rank knows, so a link agrees one shape per
signature. Sends are eager and sent in order, so waiting for the shape message before
posting the data receive never waits longer than waiting for the data itself
([Note: communication semantics] in messages.py); later receives from the same peer are
posted after it, keeping each link in order.

[Note: early receives] On Gloo (CPU ranks) the executor posts the receives of a rank's next
communication batch as soon as the current batch is done (``prepost``), before the compute
actions between them, so the data crosses while this rank computes and the batch, when
reached, only waits. Without it, a message sent while its receiver computes crosses only
after the receiver posts the receive (Gloo's sender and receiver meet in their transport
threads, which on a busy CPU costs milliseconds per message, several times a ping between
idle ranks). The simulator already assumes this: a receive completes ``latency`` after its
send was posted. Receives are still posted in list order, so each link stays in order; a
batch whose buffers need a shape message is posted when reached. NCCL posts receives when
reached: its sends and receives between two ranks share one communicator and stream, where
a receive posted early holds back this rank's later sends on that link until it completes
(some schedules would deadlock), and its waits do not block the host anyway (the compute
stream waits on the communication stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.distributed.comm import p2p as p2p_comm
from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.messages import message_key, peer_rank

__all__ = ["Mailbox"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)
_META_LEN = 12  # ndim, up to 10 dims, dtype code
_SENDS = (Kind.SEND_F, Kind.SEND_B)


def _encode(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _META_LEN - 2 or t.dtype not in _DTYPES:
        raise ValueError(f"a pipeline stage output of shape {tuple(t.shape)} and dtype "
                         f"{t.dtype} cannot be sent: at most {_META_LEN - 2} dims and one of "
                         f"{[str(d) for d in _DTYPES]}")
    meta = [t.dim(), *t.shape] + [0] * (_META_LEN - 2 - t.dim()) + [_DTYPES.index(t.dtype)]
    return torch.tensor(meta, dtype=torch.int64)


def _decode(meta: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = meta.tolist()
    ndim = values[0]
    return tuple(values[1:1 + ndim]), _DTYPES[values[-1]]


class Mailbox:
    """Posted tensors, received tensors and the link state of one pipeline rank.

    Args:
        placement: stage -> pipeline rank.
        pp_rank: this rank's pipeline rank.
        global_rank: pipeline rank -> global rank (for the peers).
        group: the pipeline process group.
        device: where receive buffers live.
    """

    def __init__(self, placement: Sequence[int], pp_rank: int, global_rank, group,
                 device: torch.device, early_receives: bool | None = None) -> None:
        self.placement, self.me, self.group, self.device = placement, pp_rank, group, device
        self.early = p2p_comm.early_receives_safe(group) if early_receives is None \
            else early_receives
        self.posted: dict[Action, object] = {}  # receives posted ahead -> their handles
        self.global_rank = global_rank
        self.shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        self.signatures: tuple = ()
        self.outbox: dict[tuple, torch.Tensor] = {}
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.pending: list = []  # handles of eager sends, waited at the end of the step

    def begin(self, signatures: Sequence[tuple]) -> None:
        """Start a step whose micro-batch ``mb`` has inputs of ``signatures[mb]`` (their
        shapes and dtypes; [Note: agreed shapes])."""
        self.signatures = tuple(signatures)
        self.outbox.clear()
        self.inbox.clear()

    # ---------------------------------------------------------------- compute side
    def post(self, key: tuple, tensor: torch.Tensor) -> None:
        """A compute action produced message ``key``: hand it over or keep it to send."""
        kind, stage, mb = key
        dest = stage + 1 if kind == "F" else stage - 1
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"pipeline stage {stage} produced a {type(tensor).__name__}; what "
                             f"crosses between stages is one tensor ([Note: declared pieces] "
                             f"in shardwise/models/pieces.py)")
        if kind == "F":
            self.shapes[("out", stage, self.signatures[mb])] = (tuple(tensor.shape),
                                                                tensor.dtype)
        if self.placement[dest] == self.me:
            self.inbox[key] = tensor.detach()
        else:
            self.outbox[key] = tensor.detach().contiguous()

    def take(self, key: tuple) -> torch.Tensor:
        """What a compute action consumes (received or handed over)."""
        try:
            return self.inbox.pop(key)
        except KeyError:
            raise RuntimeError(f"pipeline message {key} was neither received nor handed over "
                               f"before the action that needs it") from None

    # ---------------------------------------------------------------- communication side
    def run_batch(self, batch: Sequence[Action]) -> None:
        """Post the batch's sends (eager) and receives; return once every receive is in."""
        messages, waits, deferred, blocked = [], [], [], set()
        early = {a: self.posted.pop(a) for a in batch if a in self.posted}
        for a in batch:
            if a in early:  # posted ahead: only waited for below
                continue
            peer = peer_rank(a, self.placement)
            key = message_key(a)
            if a.kind in _SENDS:
                messages += self._sends(a, key, peer)
            elif peer in blocked:
                deferred.append(a)
            elif (buf := self._buffer(a)) is not None:
                messages.append(self._recv(a, key, peer, buf))
            else:  # [Note: agreed shapes]
                meta = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
                messages.append(p2p_comm.Message(meta, self.global_rank(peer), False,
                                                 f"pp.{a}.shape"))
                waits.append((a, meta))
                blocked.add(peer)
                deferred.append(a)
        handles = p2p_comm.batch_isend_irecv(messages, self.group) if messages else []
        for h in early.values():
            h.wait()
        self._sort(messages, handles)
        for a, meta in waits:
            self.shapes[("in", a.stage, self.signatures[a.microbatch])] = _decode(meta)
        if deferred:
            later = [self._recv(a, message_key(a), peer_rank(a, self.placement),
                                self._buffer(a)) for a in deferred]
            self._sort(later, p2p_comm.batch_isend_irecv(later, self.group))

    def prepost(self, batch: Sequence[Action]) -> None:
        """Post the receives of a coming batch now ([Note: early receives]); a no-op off Gloo,
        for a batch without receives, or when a buffer's shape is not agreed yet."""
        recvs = [a for a in batch if a.kind not in _SENDS]
        if not self.early or not recvs:
            return
        bufs = [self._known_buffer(a) for a in recvs]
        if any(b is None for b in bufs):
            return
        messages = [self._recv(a, message_key(a), peer_rank(a, self.placement), buf)
                    for a, buf in zip(recvs, bufs)]
        for a, h in zip(recvs, p2p_comm.batch_isend_irecv(messages, self.group)):
            self.posted[a] = h

    def _known_buffer(self, a: Action) -> torch.Tensor | None:
        side = "in" if a.kind is Kind.RECV_F else "out"
        known = self.shapes.get((side, a.stage, self.signatures[a.microbatch]))
        return None if known is None else torch.empty(known[0], dtype=known[1],
                                                      device=self.device)

    def _sort(self, messages, handles) -> None:
        """Keep the sends' handles for the end of the step; wait for the receives now."""
        for m, h in zip(messages, handles):
            if m.send:
                self.pending.append((h, m.tensor))
            else:
                h.wait()

    def _sends(self, a: Action, key: tuple, peer: int) -> list:
        try:
            tensor = self.outbox.pop(key)
        except KeyError:
            raise RuntimeError(f"{a.describe()}: nothing was produced to send") from None
        dest, out = self.global_rank(peer), []
        link = ("agreed", a.stage + 1, self.signatures[a.microbatch])
        if a.kind is Kind.SEND_F and link not in self.shapes:  # [Note: agreed shapes]
            self.shapes[link] = (tuple(tensor.shape), tensor.dtype)
            out.append(p2p_comm.Message(_encode(tensor).to(tensor.device), dest, True,
                                        f"pp.{a}.shape"))
        out.append(p2p_comm.Message(tensor, dest, True, f"pp.{a}"))
        return out

    def _buffer(self, a: Action) -> torch.Tensor | None:
        """An empty receive buffer for ``a``, or None when its shape is not agreed yet."""
        if a.kind is Kind.RECV_F:
            known = self.shapes.get(("in", a.stage, self.signatures[a.microbatch]))
        else:  # the gradient of this rank's own output
            known = self.shapes.get(("out", a.stage, self.signatures[a.microbatch]))
            if known is None:
                raise RuntimeError(f"{a.describe()} comes before any forward of stage "
                                   f"{a.stage} with this micro-batch shape")
        if known is None:
            return None
        return torch.empty(known[0], dtype=known[1], device=self.device)

    def _recv(self, a: Action, key: tuple, peer: int, buf: torch.Tensor):
        self.inbox[key] = buf
        return p2p_comm.Message(buf, self.global_rank(peer), False, f"pp.{a}")

    def finish(self) -> None:
        """Wait for every send of the step (they were never waited for before)."""
        pending, self.pending = self.pending, []
        for handle, _ in pending:
            handle.wait()
        if self.posted:
            raise RuntimeError(f"receives posted ahead but never reached: "
                               f"{sorted(map(str, self.posted))}")
        if self.outbox:
            raise RuntimeError(f"pipeline messages produced but never sent: "
                               f"{sorted(self.outbox)}")
