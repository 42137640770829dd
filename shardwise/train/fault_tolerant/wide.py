"""One process group over every rank of every replica group in the quorum, reconfigured at
each new quorum, and what each of its ranks holds.

[Note: one group across all ranks] torchft's own process group joins rank ``r`` of every
replica group (one ring per rank), and its healing copies rank ``r``'s state from rank ``r``
of a peer. Both assume that every group has the same ranks, laid out alike. A group that came
back smaller, or laid out by the planner for its own ranks, breaks that: a ring waits for a
rank the smaller group does not have, and a healed rank would get another layout's shard. So
shardwise gives torchft's manager a process group that does nothing (it keeps the quorum, the
step count and the commit vote), turns its healing off, and joins every rank of the quorum's
groups in one reconfigurable group of its own (torchft's ``ProcessGroupGloo`` or
``ProcessGroupNCCL``, configured under a prefix of the quorum's store). Its ranks are the
groups in id order and each group's ranks in order; each group's size travels in its replica
id (``shardwise_n<ranks>_group<id>``). After a new quorum, and whenever one of its groups is
behind, the ranks all-gather one row each: their step, lineage and holding of every parameter
([Note: layouts across groups] in pieces.py). The combine and the healing are exchanges over
this group (combine.py, heal.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from shardwise.train.fault_tolerant.pieces import RankHolding

__all__ = ["WideGroup", "Roster", "replica_id", "parse_replica_id", "PeerLost", "wait_or_abort"]

_ID = re.compile(r"^shardwise_n(\d+)_group(\d+)(?::.*)?$")


class PeerLost(RuntimeError):
    """A collective across groups failed: a group died or froze during it."""


def replica_id(group: int, size: int) -> str:
    """The replica id a group of ``size`` ranks gives torchft (its trailing digits are the
    group id, as torchft's own rank arithmetic expects)."""
    return f"shardwise_n{size}_group{group}"


def parse_replica_id(text: str) -> tuple[int, int]:
    """``(group, size)`` of a replica id in a quorum (torchft appends ``:<uuid>``).

    Raises:
        ValueError: not a shardwise group's id (another job on the same quorum server).
    """
    m = _ID.match(text)
    if m is None:
        raise ValueError(f"replica id {text!r} in the quorum is not a shardwise replica "
                         f"group's (shardwise_n<ranks>_group<id>): is another job using the "
                         f"same parallel.ft_lighthouse?")
    return int(m.group(2)), int(m.group(1))


@dataclass
class Roster:
    """The wide group of one quorum: its ranks' holdings, steps and lineages (wide rank
    order), and this rank's place.

    Attributes:
        holdings: every rank's :class:`RankHolding`.
        steps, lineages: every rank's committed steps and lineage when the rows were
            gathered (this attempt).
        me: this rank's wide rank.
        max_step: the quorum's highest step.
    """

    holdings: list[RankHolding]
    steps: list[int]
    lineages: list[int]
    me: int
    max_step: int
    quorum_id: int = -1
    _by_group: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for w, h in enumerate(self.holdings):
            self._by_group.setdefault(h.group, []).append(w)

    @property
    def groups(self) -> list[int]:
        """The groups in the quorum, ascending."""
        return sorted(self._by_group)

    def ranks_of(self, group: int) -> list[int]:
        """The wide ranks of ``group``, by rank in the group."""
        return self._by_group[group]

    def behind(self) -> list[int]:
        """The groups some of whose ranks are behind the quorum's step (they heal)."""
        return sorted({self.holdings[w].group for w, s in enumerate(self.steps)
                       if s < self.max_step})


class _QuorumCapture:
    """torchft's manager client, passing every call on and keeping the last quorum's result
    (the manager keeps no public handle to it)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class WideGroup:
    """The wide group of one rank ([Note: one group across all ranks]).

    Args:
        manager: torchft's manager of this rank (its client is wrapped to see each quorum).
        holding: this rank's holding (:func:`~shardwise.train.fault_tolerant.pieces.holding_of`).
        device: where collective tensors live (the process group's device).
        timeout_s: the collectives' and the configuration's timeout.
    """

    def __init__(self, manager: Any, holding: RankHolding, device: torch.device,
                 timeout_s: float) -> None:
        from torchft import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else \
            ProcessGroupGloo(timeout=timeout)
        self.manager, self.holding, self.device = manager, holding, device
        self._capture = _QuorumCapture(manager._client)
        manager._client = self._capture
        self.quorum_id: int | None = None
        self.roster: Roster | None = None

    def groups_in_last_quorum(self) -> int:
        """How many groups the last quorum holds (0 before any)."""
        q = self._capture.last
        return 0 if q is None else len(q.replica_ids)

    def after_quorum(self, step: int, lineage: int) -> Roster | None:
        """After ``manager.start_quorum()``: the group reconfigured for a new quorum, and the
        rows gathered when the quorum is new or one of its groups is behind.

        Returns:
            The roster (its holdings are reused while the quorum lasts; steps and lineages
            are this attempt's where gathered).

        Raises:
            PeerLost: the configuration or the gathering failed (a group lost since the
                quorum formed); the step must not commit.
        """
        q = self._capture.last
        if q is None:
            raise PeerLost("no quorum result was seen (torchft's client changed?)")
        ids = sorted(parse_replica_id(r) for r in q.replica_ids)
        fresh = q.quorum_id != self.quorum_id
        if fresh:
            self._configure(q, ids)
        behind = step < q.max_step or q.max_world_size < q.replica_world_size
        if fresh or behind or self.roster is None:
            self.roster = self.gather_rows(ids, step, lineage, q.max_step, q.quorum_id)
        else:  # same quorum, nobody behind: every rank holds the quorum's step
            self.roster.steps = [q.max_step] * len(self.roster.steps)
            self.roster.max_step = q.max_step
        return self.roster

    def _store_address(self, q: Any) -> str:
        """The quorum's store as every group's rank 0 sees it. torchft gives each rank the
        store of an up-to-date group chosen by the rank's place in its group, so ranks of
        one group see different stores; rank 0 of every group sees the same one, and
        passes it on to its group's ranks through the group's own store."""
        key = f"shardwise/wide/{q.quorum_id}"
        if self.holding.rank == 0:
            self.manager._store.set(key, q.store_address)
            return q.store_address
        return self.manager._store.get(key).decode()

    def _configure(self, q: Any, ids: list[tuple[int, int]]) -> None:
        me = self._wide_rank(ids)
        world = sum(size for _, size in ids)
        try:
            address = self._store_address(q)
            self.pg.configure(f"{address}/shardwise/wide/{q.quorum_id}",
                              f"shardwise_wide_{self.holding.group}", me, world, q.quorum_id)
        except Exception as exc:  # a group lost between the quorum and now
            self.quorum_id = None
            raise PeerLost(f"configuring the group across replica groups for quorum "
                           f"{q.quorum_id} failed: {type(exc).__name__}: {exc}") from exc
        self.quorum_id = q.quorum_id

    def _wide_rank(self, ids: list[tuple[int, int]]) -> int:
        offset = 0
        for group, size in ids:
            if group == self.holding.group:
                if size != self.holding.size:
                    raise ValueError(f"replica group {group} is in the quorum with {size} "
                                     f"ranks, this process's group has {self.holding.size}")
                return offset + self.holding.rank
            offset += size
        raise PeerLost(f"replica group {self.holding.group} is not in the quorum's groups "
                       f"{[g for g, _ in ids]}")

    @classmethod
    def over(cls, pg: Any, holding: RankHolding, device: torch.device) -> "WideGroup":
        """A wide group over a process group already configured (tools and tests: no
        manager, no quorum; :meth:`gather_rows` makes its roster)."""
        wide = cls.__new__(cls)
        wide.pg, wide.holding, wide.device, wide.manager = pg, holding, device, None
        wide.quorum_id, wide.roster = None, None
        return wide

    def gather_rows(self, ids: list[tuple[int, int]], step: int, lineage: int,
                    max_step: int, quorum_id: int = -1) -> Roster:
        """Every rank's step, lineage and holding (one all-gather over the group).

        Args:
            ids: ``(group, ranks)`` of every group in the quorum, ascending.
        """
        from torch._C._distributed_c10d import AllgatherOptions

        row = torch.tensor([step, lineage, *self.holding.to_row()], dtype=torch.int64,
                           device=self.device)
        world = sum(size for _, size in ids)
        out = [torch.empty_like(row) for _ in range(world)]
        self.wait(self.pg.allgather([out], [row], AllgatherOptions()), "the layouts' rows")
        rows = torch.stack(out).tolist()
        holdings = [RankHolding.from_row(r[2:]) for r in rows]
        expected = [(g, r) for g, size in ids for r in range(size)]
        got = [(h.group, h.rank) for h in holdings]
        if got != expected:
            raise PeerLost(f"the wide group's ranks are {got}, the quorum says {expected}")
        if len({h.numels for h in holdings}) > 1:
            raise ValueError("replica groups hold different parameters (counts or sizes "
                             "differ): they must train the same model")
        return Roster(holdings, [int(r[0]) for r in rows], [int(r[1]) for r in rows],
                      self._wide_rank(ids), max_step, quorum_id)

    def wait(self, work: Any, what: str) -> None:
        """Wait for one collective of this group (:func:`wait_or_abort`)."""
        try:
            wait_or_abort(self.pg, work, what)
        except PeerLost:
            self.quorum_id = None  # the next quorum configures the group again
            raise

    def alltoall(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                 what: str) -> torch.Tensor:
        """One all-to-all of uneven pieces over the wide group."""
        from torch._C._distributed_c10d import AllToAllOptions

        out = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        self.wait(self.pg.alltoall_base(out, send, recv_sizes, send_sizes, AllToAllOptions()),
                  what)
        return out


def wait_or_abort(pg: Any, work: Any, what: str) -> None:
    """Wait for ``work``; on a failure abort ``pg`` and raise :class:`PeerLost`.

    Only the dead group's neighbours in Gloo's ring see its connection close; the others
    wait for data that will never come until ``ft_timeout_s`` (seen: 3 s of a 5.7 s
    recovery). Closing this rank's connections at once passes the failure on around the
    ring; the next quorum configures a new group anyway.
    """
    try:
        work.wait()
    except Exception as exc:
        pg.abort()
        raise PeerLost(f"{what}: {type(exc).__name__}: {exc}") from exc
