"""Which modules are the *blocks* that activation checkpointing and compilation act on.

A block is the repeated unit of a model (by default every
:class:`~shardwise.models.ModelBlock`: the decoder's ``TransformerBlock`` and the vision
tower's ``VisionBlock``), selected as ``shard``'s ``wrap`` selects units: a class, a set of
classes, or a predicate ``(name, module) -> bool``. Only the outermost matches count: a match inside
another match is part of that block. Both :func:`~shardwise.parallel.checkpoint_activations`
and :func:`~shardwise.parallel.compile_blocks` replace the block's ``forward`` attribute
(never ``_call_impl``), so hooks registered on the block -- the sharding engine's gathers
and reductions among them -- keep running eagerly around it (see
[Note: collectives outside compiled regions] in shardwise/distributed/compiled.py), and
``named_parameters()`` keeps its names.
"""

from __future__ import annotations

from torch import nn

from shardwise.models import ModelBlock
from shardwise.shard.discover import wrap_predicate

__all__ = ["select_blocks", "DEFAULT_BLOCKS", "FORWARD_COLLECTIVES_ATTR"]

DEFAULT_BLOCKS = ModelBlock
"""The blocks chosen when the caller passes ``blocks=None``: every subclass of
:class:`~shardwise.models.ModelBlock` (a model's blocks of every tower)."""

FORWARD_COLLECTIVES_ATTR = "_shardwise_forward_collectives"
"""A module whose forward issues collectives sets this attribute to a short description of
them (e.g. ``"MoE balance statistics all-reduce"``); :func:`~shardwise.parallel.
compile_blocks` refuses a block holding such a module."""


def select_blocks(model: nn.Module, blocks=None, *, caller: str) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` matching ``blocks``, in ``named_modules()`` order.

    Args:
        model: the model to search (it can match itself).
        blocks: a module class, a set of classes, or a predicate ``(name, module) -> bool``
            (default None: :data:`DEFAULT_BLOCKS`).
        caller: the public function's name, for error messages.

    Returns:
        ``(name, module)`` pairs; the model itself is named ``""``.

    Raises:
        ValueError: ``blocks`` is not a class, set or predicate, or nothing matches.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller} expects an nn.Module, got {type(model).__name__}")
    chosen = DEFAULT_BLOCKS if blocks is None else blocks
    try:
        match = wrap_predicate(chosen)
    except ValueError as exc:
        raise ValueError(f"{caller}: {str(exc).replace('wrap', 'blocks', 1)}") from None
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():  # each module once, under its first name
        if match(name, module) and not any(_inside(name, outer) for outer, _ in found):
            found.append((name, module))
    if not found:
        raise ValueError(f"{caller}: no module of {type(model).__name__} matches "
                         f"blocks={chosen!r}; expected a class, set of classes or predicate "
                         f"that selects the model's repeated blocks")
    return found


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")
