"""A replica group that comes back with fewer ranks: its size, and the data it trains on.

A fault with ``ranks=M`` (``--faults "kill:group=1:step=30:ranks=1"``) leaves its group M
ranks from its next attempt on, as a node lost for good would. The group's restarted ranks
see that before they build anything (:func:`resize_due`) and return at once; the group's
agent launches it again with M ranks (launch.py), and they train on
(:class:`GroupShare`). On a cluster torchrun ``--nnodes MIN:MAX`` does the same after a node
loss: it rendezvouses again with the nodes left, and the ranks find a smaller WORLD_SIZE.

[Note: a resized group trains the same data] A group's share of every step is the sequences
of its original ``n0`` data ranks (data rank ``group * n0 + j``), whatever its current size
``m`` (``m`` divides ``n0``): rank ``r`` takes data ranks ``r * n0/m ... (r + 1) * n0/m - 1``,
whose windows of each global micro-batch are contiguous in the loader's order, so one
:class:`~shardwise.data.TokenLoader` of ``world = groups * m`` ranks and ``n0/m`` times the
batch gives exactly them (and its state, the global position, is the same number as every
other rank's). Each of those batches is cut into micro-batches of the group's layout
(:class:`Rebatched`), which ``forward_backward`` accumulates, dividing each micro-batch's
mean loss by the accumulation ``a``; the engine averages the ``m`` ranks' gradients. With
micro-batches of ``b`` sequences and ``m * a * b = n0 * batch_size * grad_accum``, the
group's gradient is ``1/m * sum_ranks 1/a * sum_micro mean_b`` = the mean over the same
``n0 * batch_size * grad_accum`` sequences as with ``n0`` ranks, so what a step is ([Note:
what a step is under fault tolerance] in loop.py) does not change. At ``m = n0`` with the
configured micro-batches the loader is the plain one of every run before: the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from shardwise.train.faults import LOG_ENV, Fault
from shardwise.train.fault_tolerant.rejoin import restart_size

__all__ = ["GROUP_RANKS_ENV", "GroupShare", "Rebatched", "group_ranks", "check_group_size",
           "check_resize_faults", "resize_due"]

#: A group's original number of ranks, ``n0`` (the launcher sets it; on a cluster whose
#: groups may come back smaller, set it to the full size). Unset: the group's WORLD_SIZE.
GROUP_RANKS_ENV = "SHARDWISE_FT_GROUP_RANKS"


def group_ranks(world_size: int) -> int:
    """The group's original size ``n0`` (``$SHARDWISE_FT_GROUP_RANKS``, else ``world_size``)."""
    return int(os.environ.get(GROUP_RANKS_ENV, world_size))


def check_group_size(ranks: int, n0: int, what: str = "the group's ranks") -> None:
    """Raises ValueError (naming both) unless ``ranks >= 1`` divides ``n0``."""
    if ranks < 1 or n0 % ranks:
        raise ValueError(f"parallel.fault_tolerant: {what} ({ranks}) must be at least 1 and "
                         f"divide the group's original size n0={n0}, so that each rank takes "
                         f"the same number of its data ranks")


def check_resize_faults(faults: list[Fault], n0: int) -> None:
    """Every ``ranks=M`` fault's M divides the groups' size ``n0`` (the launcher checks this
    before any rank starts).

    Raises:
        ValueError: naming the fault, M and n0.
    """
    for f in faults:
        if "ranks" in f.options:
            check_group_size(int(f.options["ranks"]), n0, f"ranks={f.options['ranks']} of "
                             f"fault {f.describe()!r}")


def resize_due(group: int, attempt: int, world_size: int) -> int | None:
    """The size this attempt of ``group`` must have when it differs from ``world_size`` (the
    ranks launched): the ranks then return ``{"resize": M}`` and the agent relaunches them;
    None: train with the ranks there are."""
    log = os.environ.get(LOG_ENV)
    if not log or attempt == 0:
        return None
    size = restart_size(Path(log).parent, group, attempt)
    return size if size is not None and size != world_size else None


class Rebatched:
    """Micro-batches of ``batch_size`` sequences cut from (or joined across) the batches of
    ``loader``, in order. A step takes a whole number of the loader's batches ([Note: a
    resized group trains the same data]), so at every step boundary nothing is held back
    and the state is the loader's own (loading one drops what was held)."""

    def __init__(self, loader: Any, batch_size: int) -> None:
        self.loader, self.batch_size = loader, batch_size
        self._held: list[torch.Tensor] | None = None

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``batch_size`` sequences: ``(inputs, targets)``, each ``(B, seq_len)``."""
        while self._held is None or self._held[0].shape[0] < self.batch_size:
            inputs, targets = self.loader.next_batch()
            self._held = [inputs, targets] if self._held is None else [
                torch.cat([self._held[0], inputs]), torch.cat([self._held[1], targets])]
        (inputs, targets), b = self._held, self.batch_size
        self._held = None if inputs.shape[0] == b else [inputs[b:], targets[b:]]
        return inputs[:b], targets[:b]

    def state_dict(self) -> dict[str, int]:
        """The wrapped loader's position (the global stream's: the same on every rank)."""
        assert self._held is None, "a loader state read in the middle of a step"
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the wrapped loader at ``state``; sequences held back are dropped."""
        self._held = None
        self.loader.load_state_dict(state)


@dataclass(frozen=True)
class GroupShare:
    """Which data ranks one rank of a (possibly resized) group stands for.

    Attributes:
        group, groups: the replica group's id and how many there are.
        n0: the group's original size (its data ranks); ``ranks``: its size now (divides n0).
        rank: this rank inside the group.
    """

    group: int
    groups: int
    n0: int
    ranks: int
    rank: int

    @property
    def per_rank(self) -> int:
        """Data ranks each rank takes (``n0 / ranks``)."""
        return self.n0 // self.ranks

    @property
    def first_data_rank(self) -> int:
        """The first of this rank's data ranks in the whole job."""
        return self.group * self.n0 + self.rank * self.per_rank

    def loader(self, tokens: torch.Tensor, cfg: Any, gcfg: Any) -> Any:
        """This rank's loader: its data ranks' sequences of the job's stream, in micro-batches
        of the group's layout (``gcfg.train.batch_size``)."""
        from shardwise.data import TokenLoader

        k, bs = self.per_rank, cfg.train.batch_size
        loader = TokenLoader(tokens, seq_len=cfg.data.seq_len, batch_size=k * bs,
                             rank=self.group * self.ranks + self.rank,
                             world_size=self.groups * self.ranks, seed=cfg.data.seed)
        micro = gcfg.train.batch_size
        return loader if micro == k * bs else Rebatched(loader, micro)

    def eval_batches(self, val_ids: torch.Tensor, cfg: Any) -> Iterator:
        """The validation batches of this rank's data ranks, one data rank after another
        (each ``train.batch_size`` sequences, as without a resize)."""
        from shardwise.data import iter_eval_batches

        for j in range(self.per_rank):
            yield from iter_eval_batches(
                val_ids, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                rank=self.first_data_rank + j, world_size=self.groups * self.n0,
                max_batches=cfg.train.eval_batches)
