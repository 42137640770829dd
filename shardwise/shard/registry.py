"""Where a sharded module keeps its engine state, and how to find every state in a model.

The bottom of the engine: ``api`` attaches a state to each module passed to ``shard``;
gradient clipping, state dicts, offload and checkpoints find the states through
:func:`engine_states`, so none of them imports the others to get at it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["STATE_ATTR", "engine_states", "attach_state", "is_sharded", "attach_tracker",
           "extra_trackers"]

STATE_ATTR = "_shardwise_state"
TRACKER_ATTR = "_shardwise_tracker"


def attach_state(module: nn.Module, state: Any) -> None:
    """Record ``state`` as the engine state of ``module`` (once per ``shard`` call)."""
    setattr(module, STATE_ATTR, state)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` itself was passed to ``shardwise.shard``."""
    return hasattr(module, STATE_ATTR)


def engine_states(model: nn.Module) -> list:
    """Every engine state inside ``model`` (its own and those of sharded submodules), in
    ``model.modules()`` order: the outermost ``shard`` call's state first."""
    return [getattr(m, STATE_ATTR) for m in model.modules() if hasattr(m, STATE_ATTR)]


def attach_tracker(module: nn.Module, tracker: Any) -> None:
    """Record a memory tracker of buffers held outside the engine (``apply_tp``'s), which
    :func:`shardwise.memory_report` adds to the engine's."""
    setattr(module, TRACKER_ATTR, tracker)


def extra_trackers(model: nn.Module) -> list:
    """Every tracker :func:`attach_tracker` recorded inside ``model``."""
    return [getattr(m, TRACKER_ATTR) for m in model.modules() if hasattr(m, TRACKER_ATTR)]
