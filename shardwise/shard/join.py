"""Inputs of different lengths on different ranks: ``shardwise.join``.

    for batch in (uneven := shardwise.join(model, loader)):   # loaders of any lengths
        loss = loss_fn(model(batch))
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
        if not uneven.shadowing:
            log(loss)                     # this rank's own data

[Note: uneven inputs] Every collective pairs the k-th call of each rank with the k-th call of
every other rank, so a rank whose loader has one batch more than its peers' (a last batch
without ``drop_last``, a filter that skips samples) runs collectives nobody answers, or,
worse, pairs them with its peers' next step ([Note: step identity] in identity.py catches
that). PyTorch's ``Join`` solves it for DDP by letting ranks that ran out *shadow* the
collectives of the others; shardwise does the same, for every stage of the engine and for
whatever the loop body does besides (gradient clipping, a loss all-reduce for logging,
expert all-to-alls): before each item, the ranks share whether they still have one (one
small all-gather); while any rank has, a rank that has not runs the loop body again on its
last batch (``shadowing`` is True), with the gradients of its parameters replaced by zeros
before they accumulate, so it issues exactly the collectives of a real iteration and adds
nothing to the gradient. Its optimizer still steps: under ZeRO it owns a shard of every
parameter and must update it with the others' averaged gradient.

What a step means then: the engine averages gradients over all ranks of the data-parallel
group, so a step where ``k`` of ``n`` ranks still had data takes the sum of their gradients
over ``n`` (PyTorch's ``Join`` for DDP with ``divide_by_initial_world_size=True``), the
same as if the others had contributed zeros. Statistics computed in forward from the data
(MoE routing counts, batch norm) include the shadowing rank's repeated batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.shard.controls import graph_parameters

__all__ = ["Join", "join"]


class Join:
    """Iterate ``batches`` on every rank until all ranks are out, shadowing the others'
    iterations on a rank that ran out ([Note: uneven inputs]).

    Args:
        model: a model passed to ``shardwise.shard`` (any stage).
        batches: this rank's iterable of batches (any length).
        group: the ranks that iterate together (default: the whole job).

    Attributes:
        shadowing: whether the current iteration replays this rank's last batch with zero
            gradients (its own data ran out).
        iterations: iterations run so far (the same on every rank).
    """

    def __init__(self, model: nn.Module, batches: Iterable[Any], group=None) -> None:
        self.params = graph_parameters(model)  # raises for an unsharded model
        self.batches, self.group = batches, group
        self.shadowing = False
        self.iterations = 0
        device = next((p.device for p in self.params if p.device.type != "meta"),
                      torch.device("cpu"))
        self._flags = torch.zeros(2, dtype=torch.int64, device=device)

    def __iter__(self) -> Iterator[Any]:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        handles = [p.register_hook(self._zeros_when_shadowing) for p in self.params
                   if p.requires_grad]
        items, last = iter(self.batches), None
        try:
            while True:
                batch, have = _next(items)
                if have:
                    last = batch
                every = self._share(have, last is not None, world)
                if not any(h for h, _ in every):
                    return
                empty = [r for r, (h, ex) in enumerate(every) if not h and not ex]
                if empty:  # every rank raises the same error: nothing is left waiting
                    raise ValueError(
                        f"shardwise.join: rank(s) {empty} of the group had no batch at all, so "
                        f"they cannot shadow the others' iterations (a shadowing rank replays "
                        f"its last batch); give every rank at least one batch")
                self.shadowing = not have
                self.iterations += 1
                yield batch if have else last
        finally:
            self.shadowing = False
            for h in handles:
                h.remove()

    def _share(self, have: bool, example: bool, world: int) -> list[tuple[int, int]]:
        self._flags[0], self._flags[1] = int(have), int(example)
        if world == 1:
            return [(int(have), int(example))]
        out = torch.empty(world * 2, dtype=self._flags.dtype, device=self._flags.device)
        comm.all_gather_into_tensor(out, self._flags, self.group, label="join.has_data")
        flat = out.tolist()  # the decision to go on is the host's (one sync per iteration)
        return [(flat[2 * r], flat[2 * r + 1]) for r in range(world)]

    def _zeros_when_shadowing(self, grad: torch.Tensor) -> torch.Tensor:
        # Zeros, not ``grad * 0``: a repeated batch may overflow, and inf * 0 is nan.
        return torch.zeros_like(grad) if self.shadowing else grad


def _next(items: Iterator[Any]) -> tuple[Any, bool]:
    try:
        return next(items), True
    except StopIteration:
        return None, False


def join(model: nn.Module, batches: Iterable[Any], group=None) -> Join:
    """Train on inputs whose length differs between ranks: iterate ``batches`` until every
    rank has run out; a rank that ran out first replays its last batch with zero gradients
    (``.shadowing``) so every rank issues the same collectives ([Note: uneven inputs]).

    Args:
        model: a model passed to ``shardwise.shard`` (any stage).
        batches: this rank's batches (any iterable, any length; at least one batch).
        group: the ranks that iterate together (default: the whole job).

    Returns:
        A :class:`Join` to iterate over (each item is a batch).

    Raises:
        ValueError: ``model`` is not sharded; (while iterating, on every rank) a rank with no
            batch at all.
    """
    return Join(model, batches, group)
