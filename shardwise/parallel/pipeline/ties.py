"""Keep a tied embedding and the last stage's mirror of it one value ([Note: tied embeddings
across stages] in split.py).

Before a step the embedding's value goes to the mirror; after the last backward the mirror's
gradient is added to the embedding's and cleared. Between two ranks each is one
point-to-point message of this rank's shard of the matrix (under ZeRO both are sharded the
same way over data axes of the same size, so the shards line up row for row).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardwise.distributed.comm import p2p as p2p_comm
from shardwise.parallel.pipeline.split import PipelinePart

__all__ = ["TiedWeights"]


class TiedWeights:
    """The owner (the embedding, on the first stage's rank) and the mirror (the last stage's
    head) of one tied matrix, as seen from this rank; a no-op for an untied model."""

    def __init__(self, part: PipelinePart) -> None:
        self.groups = part.groups
        first, last = part.placement[0], part.placement[-1]
        me = part.groups.pp_rank
        # Looked up now, after sharding: the engine may have swapped the Parameter in.
        self.owner = _lookup(part, part.tie_owner) if part.tied and me == first else None
        self.mirror = part.mirror.weight if part.mirror is not None else None
        self.owner_rank, self.mirror_rank = first, last

    @property
    def active(self) -> bool:
        """Whether this rank holds either end."""
        return self.owner is not None or self.mirror is not None

    def _exchange(self, tensor: torch.Tensor, send: bool, label: str) -> None:
        peer = self.owner_rank if self.mirror is not None else self.mirror_rank
        msg = p2p_comm.Message(tensor, self.groups.global_rank(peer), send, label)
        for handle in p2p_comm.batch_isend_irecv([msg], self.groups.pp):
            handle.wait()

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the embedding's current value into the mirror (before a step)."""
        if self.owner is not None and self.mirror is not None:
            self.mirror.copy_(self.owner)
        elif self.owner is not None:
            self._exchange(self.owner.detach().contiguous(), True, "pp.tied.weight")
        elif self.mirror is not None:
            buf = torch.empty_like(self.mirror)
            self._exchange(buf, False, "pp.tied.weight")
            self.mirror.copy_(buf)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Add the mirror's gradient to the embedding's and clear it (after the last
        backward of a step)."""
        if self.owner is not None and self.mirror is not None:
            self._add(self.mirror.grad)
        elif self.mirror is not None:
            grad = self.mirror.grad
            self._exchange(torch.zeros_like(self.mirror) if grad is None else grad.contiguous(),
                           True, "pp.tied.grad")
        elif self.owner is not None:
            buf = torch.empty_like(self.owner)
            self._exchange(buf, False, "pp.tied.grad")
            self._add(buf)
        if self.mirror is not None:
            self.mirror.grad = None

    def _add(self, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.owner.grad is None:
            self.owner.grad = grad.clone()
        else:
            self.owner.grad.add_(grad)


def _lookup(part: nn.Module, name: str) -> torch.Tensor:
    """The attribute at the dotted ``name`` (as ``part.tok_embeddings.weight`` reads it,
    whatever tensor the engine has in place)."""
    return functools.reduce(getattr, name.split("."), part)
