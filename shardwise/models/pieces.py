"""How a model declares its pieces: ordered modules and how activations pass between them.

A model that can be cut into pipeline stages (or have any other parallelism applied piece by
piece) says what its pieces are instead of having its forward copied::

    class MyModel(nn.Module):
        def pipeline_pieces(self) -> PipelinePieces:
            return PipelinePieces(
                pieces=(Piece("embed", self.embed, "first"),
                        *(Piece(f"blocks.{i}", b, call=run_block)
                          for i, b in enumerate(self.blocks)),
                        Piece("head", self.head, "last")),
                side=lambda tokens: self.rope(tokens.shape[1]))

This module is plain data on the models' floor (it imports nothing of parallelism): the
pipeline split (``shardwise.parallel.pipeline.split_stages``) reads it.

[Note: declared pieces]
A model is a chain: ``x = inputs; for piece in pieces: x = piece(x, side)``, where
``side = declaration.side(inputs)`` is what every piece may need besides the running value
(RoPE tables, position ids, an attention mask), rebuilt by each stage from the micro-batch's
inputs, which every pipeline rank holds (it must depend only on what every rank is given:
the executor hands each stage the micro-batch's inputs as the caller passed them on that
rank). Running the chain must be the model's forward.

* ``"first"`` pieces (an embedding; an encoder tower and its projector) all run on the
  first stage, ``"last"`` pieces (final norm, output head) on the last stage, and the
  ``"block"`` pieces in between are what the split divides (contiguous runs of blocks per
  stage). The order is first*, block+, last*.
* Between pieces *on one stage* the running value can be anything (a tuple of image
  features and token ids, say); what crosses between two stages -- the value after the
  last ``"first"`` piece and after every ``"block"`` -- must be one tensor, whose shape the
  receiving rank learns from a shape message the first time a micro-batch of a new input
  shape comes ([Note: agreed shapes] in shardwise/parallel/pipeline/mailbox.py).
* **An encoder that must live on the first stage** (a VLA's vision tower and projector):
  declare its blocks and the projector as ``"first"`` pieces, ahead of the token
  embedding, carrying the tuple (inputs, features) until the piece that merges image
  features into the token sequence; e.g. ``Piece("vision.blocks.0", blk, "first", call=
  lambda m, x, side: (x[0], m(x[1])))``. A micro-batch without images runs the same
  pieces on an empty image tensor, so every rank takes part in the same collectives.
* ``name`` is the piece's dotted module path in the model (``"layers.3"``): a stage and a
  rank's part hold each piece under that name, so parameter names, state dicts and
  checkpoints are the unsplit model's.
* ``tie``: a ``"last"`` head that reads another piece's matrix as its ``weight``
  (``logits = x @ weight.T``, a tied embedding) names that parameter (e.g.
  ``"tok_embeddings.weight"``); the split gives the last stage a mirror and keeps both one
  value ([Note: tied embeddings across stages] in shardwise/parallel/pipeline/split.py).
* ``shared``: modules without trained parameters that every stage uses (a RoPE table), kept
  on every rank under their names.
* A model built on the meta device and initialised by the pipeline draws the unsplit
  model's random numbers only if its pieces are listed in ``named_modules()`` order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Piece", "PipelinePieces", "ROLES"]

ROLES = ("first", "block", "last")
"""Where a piece may go: the first stage, any stage (the split divides them), the last."""

PieceCall = Callable[[nn.Module, Any, Any], Any]
"""``(module, x, side) -> y``: how a piece runs on the running value."""


@dataclass(frozen=True)
class Piece:
    """One piece of a model ([Note: declared pieces]).

    Attributes:
        name: its dotted module path in the model, e.g. ``"layers.3"``.
        module: the module holding its parameters.
        role: ``"first"``, ``"block"`` (default) or ``"last"``.
        call: ``(module, x, side) -> y``; None (default): ``module(x)``.
        tie: for a ``"last"`` head that reads another piece's matrix as its weight, that
            parameter's name in the model (default None).
    """

    name: str
    module: nn.Module
    role: str = "block"
    call: PieceCall | None = None
    tie: str | None = None

    def run(self, module: nn.Module, x: Any, side: Any) -> Any:
        """Run the piece on ``x`` with ``module`` (the piece's own, or a stage's stand-in
        for it: a tied head's mirror)."""
        return module(x) if self.call is None else self.call(module, x, side)


@dataclass(frozen=True)
class PipelinePieces:
    """A model's declaration of its pieces ([Note: declared pieces]).

    Attributes:
        pieces: every piece, in data-flow order (first*, block+, last*).
        side: ``inputs -> side`` values every piece gets (default None: ``side`` is None).
        shared: ``(name, module)`` of modules without trained parameters that every stage
            uses (default none).
    """

    pieces: tuple[Piece, ...]
    side: Callable[[Any], Any] | None = None
    shared: tuple[tuple[str, nn.Module], ...] = ()

    @property
    def blocks(self) -> tuple[Piece, ...]:
        """The ``"block"`` pieces (what the split divides)."""
        return tuple(p for p in self.pieces if p.role == "block")

    def side_inputs(self, inputs: Any) -> Any:
        """``side(inputs)``, or None when the model declares none."""
        return None if self.side is None else self.side(inputs)
