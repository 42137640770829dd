"""Unit identity carried with every all-gather of parameters, checked on arrival.

[Note: gather identity] Collectives on a process group pair up by issue order: the k-th
all-gather of one rank meets the k-th all-gather of every other rank. If two ranks gathered
different units at the same position (another execution order, a skipped gather) and those
units have the same size, each would silently receive another unit's shards and train on
them. So every gather payload ends in an 8-byte trailer naming the unit: the number of the
``shard`` call that made it (``shard`` is called in the same order on every rank) and the
unit's index in it (4 bytes), and a CRC-32 of its label (4 bytes). The receiver compares
every rank's trailer with its own before it copies the data into the parameters and raises,
naming both units, on a mismatch, so a mispairing is an error, never corrupted weights.

The trailer costs 8 bytes per rank per gather. On the CPU the comparison is immediate; on
CUDA it is queued as a device-side assert (``torch._assert_async``), so no gather waits for
the host.
"""

from __future__ import annotations

import itertools
import zlib

import torch

__all__ = ["TAG_BYTES", "UnitTag", "next_state_id", "GatherMismatch"]

TAG_BYTES = 8

# Numbers the ``shard`` calls of this process. Every rank runs the same program, so the n-th
# call names the same module everywhere; a process-wide id source, not configuration state.
_STATE_IDS = itertools.count()


def next_state_id() -> int:
    """A fresh number for one ``shard`` call (the same on every rank for the same call)."""
    return next(_STATE_IDS)


class GatherMismatch(RuntimeError):
    """Ranks paired an all-gather of one unit with another unit's (see [Note: gather identity])."""


class UnitTag:
    """The 8-byte identity of one unit, and the check of a gather's received trailers.

    Args:
        state_id: the number of the ``shard`` call (see :func:`next_state_id`).
        index: the unit's index among that call's units.
        label: the unit's name, for messages.
        names: ``{(state_id, index): label}`` of the units this process knows (to name the
            unit another rank sent); shared by the units of one ``shard`` call.
    """

    def __init__(self, state_id: int, index: int, label: str,
                 names: dict[tuple[int, int], str]) -> None:
        if not (0 <= state_id < 1 << 16 and 0 <= index < 1 << 16):
            raise ValueError(f"unit identity out of range: shard call {state_id}, unit {index} "
                             f"(each must be < 65536)")
        self.state_id, self.index, self.label, self.names = state_id, index, label, names
        names[(state_id, index)] = label
        crc = zlib.crc32(label.encode())
        words = [(state_id << 16) | index, crc]
        self.bytes = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                  dtype=torch.int32).view(torch.uint8)
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The 8 tag bytes on ``device`` (cached)."""
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.bytes.to(device)
        return t

    def write(self, trailer: torch.Tensor) -> None:
        """Write the tag into ``trailer``: the last elements (8 bytes) of a send buffer."""
        trailer.view(torch.uint8).copy_(self.on(trailer.device))

    def check(self, received: torch.Tensor, kind: str) -> None:
        """Compare every rank's trailer (rows of ``received``, 8 bytes each) with this tag.

        Raises:
            GatherMismatch: (CPU) naming the first rank whose trailer differs and the unit
                that trailer names. On CUDA a device-side assert fires instead.
        """
        got = received.view(torch.uint8).reshape(received.shape[0], TAG_BYTES)
        mine = self.on(got.device)
        if got.device.type != "cpu":
            torch._assert_async((got == mine).all(), f"{self.label}.{kind}: ranks paired this "
                                                     f"unit's gather with another unit's")
            return
        if torch.equal(got, mine.expand_as(got)):
            return
        bad = int((got != mine).any(dim=1).nonzero()[0])
        raise GatherMismatch(
            f"{self.label}.{kind}: rank {bad} of the group sent {self._describe(got[bad])} "
            f"where this rank gathered unit {self.label!r} (shard call {self.state_id}, unit "
            f"{self.index}): the ranks issued their parameter gathers in different orders. "
            f"Every rank must run the same modules in the same order; run with "
            f"parallel.watchdog='debug' (or shardwise.distributed.watchdog in debug mode) to "
            f"find the first collective where the ranks differ.")

    def _describe(self, row: torch.Tensor) -> str:
        state_word, crc = (int(w) & 0xFFFFFFFF for w in row.contiguous().view(torch.int32))
        key = (state_word >> 16, state_word & 0xFFFF)
        name = self.names.get(key)
        if name is not None and zlib.crc32(name.encode()) == crc:
            return f"unit {name!r} (shard call {key[0]}, unit {key[1]})"
        return f"an unknown payload (shard call {key[0]}, unit {key[1]}, label crc {crc:#010x})"
