"""Who holds which elements of every parameter, in any replica group's layout, and which
pieces one rank sends another so that each gets what it needs.

[Note: layouts across groups] Replica groups need not be laid out alike: a group that came
back with fewer ranks shards its model over fewer ranks, and under ``parallel.plan = "auto"``
it may use another ZeRO stage. What every layout shares is the model's parameters, in the
same order, each a tensor of the same full shape. So a rank's share of a parameter is named
by a range ``[start, stop)`` of the parameter's flattened full tensor: ZeRO shards rows of
dim 0 (contiguous in the flattened tensor), and a whole copy is ``[0, numel)``. Both the
combine across groups and the healing of a group then move pieces of those ranges: for each
element, one rank of the sending group answers for it (:func:`responsibilities`), and a
receiving rank gets, from each sender, the intersection of what the sender answers for with
what the receiver holds (:func:`transfers`). Where two groups are laid out alike, rank ``r``
exchanges its whole shard with rank ``r`` of the other group and nobody else: the pairing
torchft's own process group makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RankHolding", "holding_of", "responsibilities", "transfers", "Piece", "runs"]

Range = tuple[int, int]


@dataclass(frozen=True)
class RankHolding:
    """What one rank of one replica group holds of each parameter.

    Attributes:
        group: the replica group's id.
        rank: the rank inside its group.
        size: the group's ranks.
        ranges: per parameter (``model.parameters()`` order), ``[start, stop)`` of its
            flattened full tensor held here.
        numels: per parameter, the full tensor's elements.
    """

    group: int
    rank: int
    size: int
    ranges: tuple[Range, ...]
    numels: tuple[int, ...]

    def to_row(self) -> list[int]:
        """As integers (one all-gathered tensor row; :meth:`from_row` reads it back)."""
        flat = [v for r in self.ranges for v in r]
        return [self.group, self.rank, self.size, len(self.ranges), *flat, *self.numels]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "RankHolding":
        group, rank, size, n = (int(v) for v in row[:4])
        flat = [int(v) for v in row[4:4 + 2 * n]]
        numels = tuple(int(v) for v in row[4 + 2 * n:4 + 3 * n])
        return cls(group, rank, size, tuple(zip(flat[::2], flat[1::2])), numels)


def holding_of(model: torch.nn.Module, group: int, rank: int, size: int) -> RankHolding:
    """This rank's holding of every parameter of ``model`` (a sharded or replicated
    shardwise model, or a plain one: whole)."""
    from shardwise.distributed.placement import placement_of
    from shardwise.shard.registry import engine_states

    rows = {}
    for state in engine_states(model):
        for r in state.param_rows():
            rows[id(r.param)] = r
    ranges, numels = [], []
    for p in model.parameters():
        r = rows.get(id(p))
        if r is None or r.whole:
            ranges.append((0, p.numel()))
            numels.append(p.numel())
            continue
        shape = placement_of(p).shape
        full = 1
        for d in shape:
            full *= d
        row_numel = full // shape[0] if len(shape) else 1
        start = r.row_offset * row_numel if len(shape) else 0
        ranges.append((start, start + p.numel()))
        numels.append(full)
    return RankHolding(group, rank, size, tuple(ranges), tuple(numels))


def responsibilities(ranks: Sequence[RankHolding]) -> list[list[Range]]:
    """Per rank of one group (in the order given), the part of each parameter it answers
    for: every element of every parameter by exactly one rank. A parameter every rank holds
    whole is split evenly (each sends an equal part); a sharded one by its shards.

    Raises:
        ValueError: the group's ranks do not hold all of a parameter between them.
    """
    n = len(ranks)
    out: list[list[Range]] = [[] for _ in ranks]
    for i, numel in enumerate(ranks[0].numels):
        held = [h.ranges[i] for h in ranks]
        if all(r == (0, numel) for r in held):
            for k in range(n):
                out[k].append((k * numel // n, (k + 1) * numel // n))
            continue
        covered = 0
        order = sorted(range(n), key=lambda k: held[k])
        for k in order:
            start, stop = held[k]
            if start > covered and stop > start:
                break
            lo = min(max(start, covered), stop)
            out[k].append((lo, stop))
            covered = max(covered, stop)
        if covered < numel or any(len(o) <= i for o in out):
            raise ValueError(f"replica group {ranks[0].group}'s {n} ranks do not hold all "
                             f"{numel} elements of parameter {i} between them (held: "
                             f"{held}): its layout is not one shard per rank or one copy each")
    return out


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param``'s flattened full tensor."""

    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def transfers(sends: Sequence[Range], needs: Sequence[Range]) -> list[Piece]:
    """What a sender answering for ``sends`` gives a receiver holding ``needs`` (both per
    parameter), in parameter order; empty pieces left out."""
    out = []
    for i, ((a, b), (c, d)) in enumerate(zip(sends, needs)):
        lo, hi = max(a, c), min(b, d)
        if hi > lo:
            out.append(Piece(i, lo, hi))
    return out


def runs(pieces: Sequence[Piece], ranges: Sequence[Range]) -> list[tuple[int, int, int]]:
    """Where ``pieces`` (in order, back to back in a message) sit in a rank's flat buffer of
    its own ``ranges`` (its parameters' held ranges, back to back): ``(flat offset, message
    offset, length)`` with neighbours merged, so a shard exchanged whole is one copy."""
    starts, offset = [], 0
    for a, b in ranges:
        starts.append(offset)
        offset += b - a
    out: list[tuple[int, int, int]] = []
    at = 0
    for p in pieces:
        flat = starts[p.param] + p.start - ranges[p.param][0]
        if out and out[-1][0] + out[-1][2] == flat and out[-1][1] + out[-1][2] == at:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + p.numel)
        else:
            out.append((flat, at, p.numel))
        at += p.numel
    return out
