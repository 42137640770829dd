"""Unit identity carried with every all-gather of parameters, checked on arrival.

[Note: gather identity] Collectives on a process group pair up by issue order: the k-th
all-gather of one rank meets the k-th all-gather of every other rank. If two ranks gathered
different units at the same position (another execution order, a skipped gather) and those
units have the same size, each would silently receive another unit's shards and train on
them. So every gather payload ends in an 8-byte trailer naming the unit: the identity of the
``shard`` call that made it and the unit's index in it (4 bytes), and a CRC-32 of its label
(4 bytes). The receiver compares every rank's trailer with its own before it copies the data
into the parameters and raises, naming both units, on a mismatch, so a mispairing is an
error, never corrupted weights.

A call's identity is 16 bits of a CRC of its ``name`` when the caller gives one (the
pipeline names each piece by its place in the unsplit model, ``layers.5``), else of its
parameters' names and shapes (:func:`call_identity`): what the call *is*, not how many calls
came before it, so ranks that shard different modules first (pipeline stages, a layout
rebuilt in the same processes) still agree, with no counter to keep in step. Two calls over
modules whose parameters are named and shaped alike (identical blocks sharded one by one)
share an identity: give them distinct ``name``s, or shard their parent with ``wrap``, for
their gathers to tell them apart.

[Note: step identity] Naming the unit is not enough when a rank runs one more micro-batch
than its peers (a loader without ``drop_last``, a filter that skips samples): its extra
forward gathers the same units, in the same order, with the same sizes as its peers' next
step, so every trailer agrees and the ranks train on gradients mixed across steps. So the
trailer also carries *when*: the step and the micro-batch of the ``shard`` call's latest
forward with gradients (:class:`StepCount`). A step is counted when the shards changed since
the previous such forward (an optimizer update, or a load: every rank does both), a
micro-batch by each such forward in between. Every rank of a gather receives every rank's
count, so a disagreement raises :class:`GatherMismatch` on every rank at the first gather
that pairs different steps, naming each rank's step and micro-batch. Counts travel modulo
2**31; only a difference matters.

The trailer costs 16 bytes per rank per gather. On the CPU the comparison is immediate; on
CUDA it is queued as a device-side assert (``torch._assert_async``), so no gather waits for
the host; the count reaches the device with ``fill_`` (no host synchronisation).
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["TAG_BYTES", "UnitTag", "StepCount", "call_identity", "GatherMismatch"]

_NAME_BYTES = 8   # shard call and unit (4), CRC-32 of the label (4)
_WHEN_BYTES = 8   # step (4), micro-batch (4): [Note: step identity]
TAG_BYTES = _NAME_BYTES + _WHEN_BYTES

def call_identity(name: str | None, params: list[tuple[str, tuple[int, ...]]]) -> int:
    """The 16-bit identity of one ``shard`` call ([Note: gather identity]): of ``name`` when
    given, else of its parameters' ``(name, shape)`` in order."""
    text = name if name is not None else ";".join(f"{n}:{s}" for n, s in params)
    return zlib.crc32(text.encode()) & 0xFFFF


class GatherMismatch(RuntimeError):
    """Ranks paired an all-gather of one unit with another unit's, or of one step with
    another step's (see [Note: gather identity], [Note: step identity])."""


class StepCount:
    """The step and micro-batch of one ``shard`` call's latest forward with gradients
    ([Note: step identity]); shared by the call's units, whose gathers carry it.

    ``step`` counts changes of the shards seen between such forwards (from 0), ``microbatch``
    the forwards since the last change (from 0).
    """

    def __init__(self) -> None:
        self.step, self.microbatch = 0, 0
        self._version: int | None = None
        self._on: dict[torch.device, torch.Tensor] = {}

    def forward(self, version: int) -> None:
        """A forward with gradients begins; ``version`` identifies the shards' values (the
        sum of their version counters: it grows whenever any of them changes)."""
        if self._version is None or version == self._version:
            self.microbatch += self._version is not None
        else:
            self.step, self.microbatch = self.step + 1, 0
        self._version = version
        for t in self._on.values():
            self._fill(t)

    def _fill(self, t: torch.Tensor) -> None:
        t[0].fill_(self.step % (1 << 31))
        t[1].fill_(self.microbatch % (1 << 31))

    def on(self, device: torch.device) -> torch.Tensor:
        """The count as 8 bytes on ``device`` (kept current by :meth:`forward`)."""
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = torch.empty(2, dtype=torch.int32, device=device)
            self._fill(t)
        return t.view(torch.uint8)


class UnitTag:
    """The 8-byte identity of one unit, and the check of a gather's received trailers.

    Args:
        state_id: the identity of the ``shard`` call (:func:`call_identity`).
        index: the unit's index among that call's units.
        label: the unit's name, for messages.
        names: ``{(state_id, index): label}`` of the units this process knows (to name the
            unit another rank sent); shared by the units of one ``shard`` call.
        count: the call's :class:`StepCount` (default: a count of its own, never advanced).
    """

    def __init__(self, state_id: int, index: int, label: str,
                 names: dict[tuple[int, int], str], count: StepCount | None = None) -> None:
        if not (0 <= state_id < 1 << 16 and 0 <= index < 1 << 16):
            raise ValueError(f"unit identity out of range: shard call {state_id}, unit {index} "
                             f"(each must be < 65536)")
        self.state_id, self.index, self.label, self.names = state_id, index, label, names
        self.count = count if count is not None else StepCount()
        names[(state_id, index)] = label
        crc = zlib.crc32(label.encode())
        words = [(state_id << 16) | index, crc]
        self.bytes = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                  dtype=torch.int32).view(torch.uint8)
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The 8 bytes naming the unit on ``device`` (cached)."""
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.bytes.to(device)
        return t

    def wire(self, device: torch.device) -> torch.Tensor:
        """The whole trailer as it is now (the unit's name, the step count): 16 bytes."""
        return torch.cat([self.on(device), self.count.on(device)])

    def write(self, trailer: torch.Tensor) -> None:
        """Write the tag into ``trailer``: the last elements (16 bytes) of a send buffer."""
        raw = trailer.view(torch.uint8)
        raw[:_NAME_BYTES].copy_(self.on(trailer.device))
        self.write_count(trailer)

    def write_count(self, trailer: torch.Tensor) -> None:
        """Refresh only the step count of ``trailer`` (the name never changes)."""
        raw = trailer.view(torch.uint8)
        raw[_NAME_BYTES:].copy_(self.count.on(trailer.device))

    def check(self, received: torch.Tensor, kind: str, ranks: list[int] | None = None
              ) -> None:
        """Compare every rank's trailer (rows of ``received``, 16 bytes each) with this tag:
        the unit's name with this rank's, the step counts with each other. ``ranks``: the
        global rank of each row, for messages (default: the rows' indices in the group).

        Raises:
            GatherMismatch: (CPU) naming the first rank whose trailer names another unit and
                that unit, or every rank's step and micro-batch when they differ. On CUDA a
                device-side assert fires instead.
        """
        got = received.view(torch.uint8).reshape(received.shape[0], TAG_BYTES)
        names, when = got[:, :_NAME_BYTES], got[:, _NAME_BYTES:]
        mine = self.on(got.device)
        if got.device.type != "cpu":
            torch._assert_async((names == mine).all(), f"{self.label}.{kind}: ranks paired "
                                                       f"this unit's gather with another unit's")
            torch._assert_async((when == when[:1]).all(), f"{self.label}.{kind}: ranks "
                                f"paired gathers of different steps or micro-batches")
            return
        if not torch.equal(names, mine.expand_as(names)):
            bad = int((names != mine).any(dim=1).nonzero()[0])
            who = f"rank {ranks[bad]}" if ranks and len(ranks) == len(names) else \
                f"rank {bad} of the group"
            raise GatherMismatch(
                f"{self.label}.{kind}: {who} sent "
                f"{self._describe(names[bad])} where this rank gathered unit {self.label!r} "
                f"(shard call {self.state_id}, unit {self.index}): the ranks issued their "
                f"parameter gathers in different orders. Every rank must run the same modules "
                f"in the same order; run with parallel.watchdog='debug' (or "
                f"shardwise.distributed.watchdog in debug mode) to find the first collective "
                f"where the ranks differ.")
        if not torch.equal(when, when[:1].expand_as(when)):
            raise GatherMismatch(
                f"{self.label}.{kind}: the ranks gathered unit {self.label!r} for different "
                f"steps: {self._steps(when, ranks)} (steps counted by updates of the parameters, "
                f"micro-batches by forward passes since; [Note: step identity]). Every rank "
                f"must run the same number of forward passes per optimizer step; for inputs "
                f"whose length differs between ranks, iterate them through shardwise.join "
                f"(docs/engine.md, 'Uneven inputs').")

    @staticmethod
    def _steps(when: torch.Tensor, ranks: list[int] | None) -> str:
        counts = when.contiguous().view(torch.int32).reshape(-1, 2).tolist()
        ranks = ranks if ranks is not None and len(ranks) == len(counts) else \
            list(range(len(counts)))
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, (step, micro) in zip(ranks, counts):
            groups.setdefault((step, micro), []).append(rank)
        return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} at step "
                         f"{step + 1}, micro-batch {micro + 1}"
                         for (step, micro), r in sorted(groups.items(), key=lambda kv: kv[1]))

    def _describe(self, row: torch.Tensor) -> str:
        state_word, crc = (int(w) & 0xFFFFFFFF for w in row.contiguous().view(torch.int32))
        key = (state_word >> 16, state_word & 0xFFFF)
        name = self.names.get(key)
        if name is not None and zlib.crc32(name.encode()) == crc:
            return f"unit {name!r} (shard call {key[0]}, unit {key[1]})"
        return f"an unknown payload (shard call {key[0]}, unit {key[1]}, label crc {crc:#010x})"
