"""One pipeline stage: a run of a model's declared pieces, and the tied head's mirror.

A :class:`StageModule` holds the pieces the split gave it ([Note: declared pieces] in
shardwise/models/pieces.py) under their names in the unsplit model, and runs them in order:
``stage(x, inputs)``, where ``x`` is the micro-batch's inputs for the first stage and the
previous stage's output otherwise, and ``inputs`` the micro-batch's inputs, from which the
stage rebuilds the side inputs (RoPE tables, positions, masks) its pieces need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.pieces import Piece

__all__ = ["StageModule", "TiedHead", "attach"]


def attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``name`` in ``root``, creating ``ModuleDict``
    containers for the missing parents (``"layers.3"`` -> ``root.layers["3"]``), so that
    ``root``'s parameter names are the unsplit model's."""
    *parents, leaf = name.split(".")
    node = root
    for key in parents:
        child = node._modules.get(key)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(key, child)
        node = child
    node.add_module(leaf, module)


class TiedHead(nn.Module):
    """The last stage's mirror of a tied embedding matrix ([Note: tied embeddings across
    stages] in split.py): ``logits = h @ weight.T`` with a Parameter of its own."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # Its value is the embedding's, copied in before every step; zeros (or meta, for a
        # meta model: shard_stages materialises it) until then.
        self.weight = nn.Parameter(torch.zeros_like(weight))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)  # (B, T, C) -> (B, T, V)


class StageModule(nn.Module):
    """One pipeline stage: ``forward(x, inputs)`` runs its pieces (inputs -> activation for
    the first stage, activation -> output for the last, activation -> activation otherwise).

    Args:
        index: the stage's index.
        num_stages: ``pp * virtual``.
        pieces: ``(piece, module)`` in order; ``module`` is the piece's own, or the mirror
            standing in for a tied head.
        shared: ``(name, module)`` every stage keeps (e.g. the RoPE tables).
        side: ``inputs -> side`` (the declaration's), or None.

    Attributes:
        index: the stage's index (0 = holds the first pieces).
        is_first / is_last: whether it holds the first / the last pieces.
    """

    def __init__(self, index: int, num_stages: int, pieces: Sequence[tuple[Piece, nn.Module]],
                 shared: Sequence[tuple[str, nn.Module]] = (),
                 side: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        # Registration order first pieces, shared, blocks, last pieces: parameters() lists
        # them in data-flow order, as the unsplit model does.
        for piece, module in pieces:
            if piece.role == "first":
                attach(self, piece.name, module)
        for name, module in shared:
            attach(self, name, module)
        for piece, module in pieces:
            if piece.role != "first":
                attach(self, piece.name, module)
        self._run = list(pieces)  # a plain list: the modules are registered above
        self._side = side

    def forward(self, x: Any, inputs: Any = None) -> Any:
        """Run the stage's pieces on ``x``.

        Args:
            x: the micro-batch's inputs (first stage) or the previous stage's output.
            inputs: the micro-batch's inputs, for the side inputs (default None: ``x`` on the
                first stage; required by a later stage of a model that declares side inputs).

        Raises:
            ValueError: a later stage called without ``inputs`` when it needs them.
        """
        if inputs is None:
            if not self.is_first and self._side is not None:
                raise ValueError(f"stage {self.index} rebuilds its side inputs from the "
                                 f"micro-batch's inputs: call stage(x, inputs)")
            inputs = x
        side = None if self._side is None else self._side(inputs)
        for piece, module in self._run:
            x = piece.run(module, x, side)
        return x

    @property
    def piece_names(self) -> list[str]:
        """The names of the stage's pieces, in order."""
        return [piece.name for piece, _ in self._run]

    def extra_repr(self) -> str:
        return f"stage={self.index}/{self.num_stages}"
