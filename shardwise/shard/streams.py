"""Where a unit's collectives run, and when their staging buffers may be reused.

[Note: CUDA streams] On a GPU, a unit's all-gathers run on one side stream and its
reduce-scatters on another, so that communication overlaps the compute stream (FSDP2's
layout). The side stream first waits for the compute stream (the shards or the packed
gradients are written there), NCCL's ``wait()`` makes the compute stream wait for the
collective, and the compute stream then copies the result out. A staging buffer allocated on
a side stream and read by the compute stream must not be reused by the next allocation on
that side stream before the compute stream has read it; instead of ``record_stream`` (which
delays frees non-deterministically), :meth:`CommStreams.release` records an event on the
compute stream and keeps the buffers referenced until the side stream's next use, which
first waits for that event: the memory is then free in the side stream's order, exactly
when it is safe, as FSDP2 does. On CUDA the caching allocator serves every buffer (the
engine's pool is for the CPU heap, [Note: buffer pool]).

On the CPU every method is a pass-through: collectives are issued from the calling thread
and buffers go straight back to the pool once their collective has completed.

[Note: held buffers are bounded] What :meth:`CommStreams.release` keeps on CUDA must not
outlive the pass that used it. Two ways it did: a reduction that never ran on the side
stream (a shard group of one rank: the packed gradients are copied on the compute stream)
released its buffers into a list that only the side stream's next use clears, which never
came, so every step kept two compute-dtype copies of every gradient (3.3 GiB a step for the
~1B model of bench/gpu_check.py: its H100 run ran out of 80 GB, bench/results/
gpu_check_h100.md); and at world sizes above one the last reductions' buffers lived through
the optimizer step into the next backward. Now buffers no side stream touched are dropped
at once (``on_side=False``), and :meth:`CommStreams.settle` at the end of each forward and
backward pass makes the side streams wait for the compute stream and drops the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardwise.distributed.pool import POOL

__all__ = ["CommStreams"]

KINDS = ("gather", "reduce")


class CommStreams:
    """The all-gather and reduce-scatter streams of one device (see [Note: CUDA streams]).

    Args:
        device: the device the units' buffers live on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._streams: dict[str, Any] = {}
        self._pending: dict[str, list[tuple[Any, tuple]]] = {k: [] for k in KINDS}

    def _stream(self, kind: str):
        s = self._streams.get(kind)
        if s is None:
            s = self._streams[kind] = torch.cuda.Stream(self.device)
        return s

    @contextlib.contextmanager
    def side(self, kind: str) -> Iterator[None]:
        """Issue a collective of ``kind`` ("gather" or "reduce") inside this context: on
        CUDA on its side stream, after the compute stream's work so far and after the
        compute stream has finished with the buffers released earlier."""
        if not self.cuda:
            yield
            return
        stream = self._stream(kind)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # The events only: a loop variable bound to a held group would keep its buffers
        # alive in this generator's frame for the whole collective.
        for event in [e for e, _ in self._pending[kind]]:
            stream.wait_event(event)
        self._pending[kind].clear()  # freed now, in the side stream's order
        with torch.cuda.stream(stream):
            yield

    def release(self, kind: str, *held: Any, on_side: bool = True) -> None:
        """The collective of ``kind`` has completed and the compute stream has queued its
        last use of ``held`` (tensors, work handles): return them for reuse.

        Args:
            kind: "gather" or "reduce".
            held: the tensors (and work handles) to give back; None entries are skipped.
            on_side: whether the side stream of ``kind`` used them. False (a one-rank group
                whose data never left the compute stream): CUDA frees them at once, in the
                compute stream's order ([Note: held buffers are bounded]).

        CPU: pooled tensors go back to the pool at once. CUDA: they stay referenced until
        the side stream's next use or :meth:`settle`, which wait for the compute stream.
        """
        if not self.cuda:
            for t in held:
                if isinstance(t, torch.Tensor):
                    POOL.give(t)
            return
        if not on_side:
            return  # dropping the references frees them on the compute stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._pending[kind].append((event, held))

    def settle(self) -> None:
        """A pass has ended: every side stream waits for the compute stream's uses of the
        buffers released so far, and they are freed (in the side stream's order, as at its
        next use). Queues waits only: no host synchronisation. A no-op on the CPU."""
        for kind, pending in self._pending.items():
            if not pending:
                continue
            stream = self._stream(kind)
            for event, _ in pending:
                stream.wait_event(event)
            pending.clear()

    def held(self) -> int:
        """How many released groups of buffers are still referenced (CUDA: awaiting the side
        streams; always 0 on the CPU)."""
        return sum(len(p) for p in self._pending.values())
