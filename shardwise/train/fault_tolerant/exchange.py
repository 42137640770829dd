"""The gradients' exchange of the combine across groups, in any groups' layouts: each rank
gets, from every other group in the quorum, that group's gradient over what this rank holds
([Note: layouts across groups] in pieces.py), as the contribution :mod:`combine` sums.

Every message is the sender's header (:func:`~shardwise.train.fault_tolerant.combine.
flatten_grads`: group, taking part, lineage, parameters, loss, one flag per parameter) and
then the pieces of its gradients the receiver holds. Where the other group is laid out as
this rank's, the contribution is its rank's of the same place, whole: exactly what the
all-gather of rank ``r`` across groups delivered before, so the same bits. Otherwise the
group's loss is the mean of its ranks' losses, and a parameter has a gradient there when any
rank that sent a piece of it had one (where this rank holds none of it: its own flag).

[Note: one clipping norm across layouts] After the combine every group holds the same mean
gradient, but each computes its norm from its own shards: partial sums of squares grouped
differently round differently, and a clipping coefficient a bit apart makes the groups'
weights drift apart. Where the groups are laid out alike their shards and reductions are the
same, so are the norms' bits; otherwise every group clips with the norm of the lowest
participating group (one all-gather of a scalar).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.train.fault_tolerant.combine import _HEADER
from shardwise.train.fault_tolerant.pieces import RankHolding, responsibilities, runs, transfers
from shardwise.train.fault_tolerant.wide import Roster, WideGroup

__all__ = ["GradientExchange"]


class GradientExchange:
    """The exchange of one roster (:class:`~shardwise.train.fault_tolerant.wide.Roster`),
    planned once and reused while the quorum lasts.

    Args:
        wide: the group across replica groups.
        roster: its ranks' holdings.
        trainable: the indices (in ``model.parameters()``) of the parameters whose
            gradients are combined, the same in every group.
    """

    def __init__(self, wide: WideGroup, roster: Roster, trainable: Sequence[int]) -> None:
        self.wide, self.roster = wide, roster
        hold = [[h.ranges[i] for i in trainable] for h in roster.holdings]
        self.n = len(trainable)
        me = roster.me
        mine = roster.holdings[me]
        answers: dict[int, list] = {}
        for g in roster.groups:
            ws = roster.ranks_of(g)
            sub = [RankHolding(g, k, len(ws), tuple(hold[w]),
                              tuple(roster.holdings[w].numels[i] for i in trainable))
                   for k, w in enumerate(ws)]
            for w, resp in zip(ws, responsibilities(sub)):
                answers[w] = resp
        head = _HEADER + 1 + self.n
        world = len(roster.holdings)
        self.send_runs: list[list[tuple[int, int, int]]] = []
        self.recv_runs: list[list[tuple[int, int, int]]] = []
        self.recv_pieces: list[list] = []
        self.send_sizes, self.recv_sizes = [0] * world, [0] * world
        for w in range(world):
            other = roster.holdings[w].group != mine.group
            out = transfers(answers[me], hold[w]) if other else []
            inc = transfers(answers[w], hold[me]) if other else []
            self.send_runs.append(runs(out, hold[me]))
            self.recv_runs.append(runs(inc, hold[me]))
            self.recv_pieces.append(inc)
            self.send_sizes[w] = head + sum(p.numel for p in out) if other else 0
            self.recv_sizes[w] = head + sum(p.numel for p in inc) if other else 0
        self.total = sum(b - a for a, b in hold[me])
        # Whether every group is laid out like every other (the same on every rank).
        shapes = {tuple(tuple(hold[w]) for w in roster.ranks_of(g)) for g in roster.groups}
        self.alike = len(shapes) == 1
        # Groups laid out as this rank's group: their rank of the same place holds what this
        # rank holds (its header is the one the all-gather of rank r delivered before), and
        # where it also answers for all of it (shards, not copies) it sends it whole.
        self.paired: dict[int, int] = {}
        self.whole: set[int] = set()
        for g in roster.groups:
            ws = roster.ranks_of(g)
            if g != mine.group and len(ws) == mine.size and \
                    hold[ws[mine.rank]] == hold[me]:
                w = ws[mine.rank]
                self.paired[g] = w
                if [tuple(r) for r in answers[w]] == [tuple(r) for r in hold[me]]:
                    self.whole.add(g)

    def __call__(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every group's contribution over this rank's holding, this rank's own (``flat``)
        among them, from one all-to-all over the wide group.

        Raises:
            PeerLost: a group died or froze during the exchange.
        """
        if len(self.roster.groups) == 1:  # a group alone: nothing to exchange
            return [flat]
        head = _HEADER + 1 + self.n
        header, payload = flat[:head], flat[head:]
        chunks = []
        for w, rs in enumerate(self.send_runs):
            if self.send_sizes[w]:
                chunks.append(header)
                chunks.extend(payload[a:a + n] for a, _, n in rs)
        send = torch.cat(chunks) if chunks else flat.new_empty(0)
        out = self.wide.alltoall(send, self.send_sizes, self.recv_sizes,
                                 "the combine across groups (gradients)")
        offsets, at = [], 0
        for size in self.recv_sizes:
            offsets.append(at)
            at += size
        roster = self.roster
        contributions = [flat]
        for g in roster.groups:
            if g == roster.holdings[roster.me].group:
                continue
            ws = roster.ranks_of(g)
            if g in self.whole:
                w = self.paired[g]
                contributions.append(out[offsets[w]:offsets[w] + self.recv_sizes[w]])
                continue
            contributions.append(self._assemble(out, offsets, ws, flat, head,
                                                self.paired.get(g)))
        return contributions

    def agreed_norm(self, norm: torch.Tensor, source: int) -> torch.Tensor:
        """Group ``source``'s gradient norm, on every rank ([Note: one clipping norm across
        layouts]); one small all-gather over the wide group.

        Raises:
            PeerLost: a group died or froze during it.
        """
        from torch._C._distributed_c10d import AllgatherOptions

        row = norm.detach().float().reshape(1)
        out = [torch.empty_like(row) for _ in self.roster.holdings]
        self.wide.wait(self.wide.pg.allgather([out], [row], AllgatherOptions()),
                       "the gradient norm across groups")
        return out[self.roster.ranks_of(source)[0]].reshape(()).to(norm.dtype)

    def _assemble(self, out: torch.Tensor, offsets: list[int], ws: list[int],
                  flat: torch.Tensor, head: int, paired: int | None) -> torch.Tensor:
        """One group's contribution from its ranks' pieces: a layout unlike this rank's, or
        one that holds copies (each of its ranks sends a part). A group laid out alike gives
        its paired rank's header (its loss and flags, as before); another, the mean of its
        ranks' losses."""
        contribution = flat.new_zeros(head + self.total)
        if paired is not None:
            contribution[:head] = out[offsets[paired]:offsets[paired] + head]
        headers = torch.stack([out[offsets[w]:offsets[w] + head] for w in ws])
        contribution[:_HEADER] = headers[0, :_HEADER]
        if paired is None:
            contribution[_HEADER] = headers[:, _HEADER].mean()
        for w in ws:
            for dst, src, n in self.recv_runs[w]:
                at = offsets[w] + head + src
                contribution[head + dst:head + dst + n] = out[at:at + n]
        if paired is None:
            rows = headers[:, _HEADER + 1:].tolist()  # one host read: the flags
            flags = flat[_HEADER + 1:head].tolist()  # this rank's own where it holds none
            sent: dict[int, float] = {}
            for k, w in enumerate(ws):
                for p in self.recv_pieces[w]:
                    sent[p.param] = max(sent.get(p.param, 0.0), rows[k][p.param])
            for i, v in sent.items():
                flags[i] = v
            contribution[_HEADER + 1:head] = torch.tensor(flags, dtype=flat.dtype)
        return contribution
