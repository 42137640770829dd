"""BabyAI environments from the optional ``minigrid`` package, imported only when used.

``minigrid`` is not a core dependency of shardwise: ``pip install shardwise[vla]`` adds it.
Everything here imports it on call, so ``import shardwise.data.vla`` works without it and the
error, when it is missing, says how to install it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from typing import Any

import numpy as np

__all__ = ["ACTION_NAMES", "NUM_ACTIONS", "DEFAULT_TILE_SIZE", "require_minigrid", "make_env",
           "reset_env", "expert_bot", "frame_of"]

# minigrid.core.actions.Actions, in id order (BabyAI's 7 discrete actions).
ACTION_NAMES = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
NUM_ACTIONS = len(ACTION_NAMES)
DEFAULT_TILE_SIZE = 8  # pixels per grid cell: the 7x7 partial view -> 56x56 RGB frames


def require_minigrid() -> Any:
    """The ``minigrid`` module (which registers the ``BabyAI-*`` gymnasium levels).

    Raises:
        ImportError: minigrid (or gymnasium) is not installed; the message gives the fix.
    """
    try:
        return importlib.import_module("minigrid")
    except ImportError as exc:
        raise ImportError(
            "the VLA demonstrations need the optional package minigrid (BabyAI levels): "
            "install it with `pip install shardwise[vla]` (or `pip install minigrid>=3.2`); "
            f"importing it failed: {exc}") from exc


def make_env(level: str, tile_size: int = DEFAULT_TILE_SIZE) -> Any:
    """A BabyAI level whose observations are RGB frames of the agent's partial view.

    Args:
        level: a registered BabyAI id, e.g. ``"BabyAI-GoToLocal-v0"``.
        tile_size: pixels per grid cell (frames are ``7 * tile_size`` square).

    Returns:
        The wrapped gymnasium env; ``obs["image"]`` is ``(H, W, 3)`` uint8, ``obs["mission"]``
        a string; ``env.unwrapped.max_steps`` is the level's step limit.

    Raises:
        ImportError: minigrid is missing (see :func:`require_minigrid`).
        ValueError: ``level`` is not a registered BabyAI level, or ``tile_size`` < 1.
    """
    minigrid = require_minigrid()
    import gymnasium as gym  # a dependency of minigrid, so present once minigrid imports

    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")
    if not level.startswith("BabyAI-") or level not in gym.registry:
        known = sorted(k for k in gym.registry if k.startswith("BabyAI-"))
        raise ValueError(f"level {level!r} is not a registered BabyAI level; known: "
                         f"{', '.join(known[:8])}, ... ({len(known)} in all)")
    return minigrid.wrappers.RGBImgPartialObsWrapper(gym.make(level), tile_size=tile_size)


def reset_env(env: Any, seed: int) -> dict[str, Any]:
    """``env.reset(seed=seed)``'s observation, without minigrid's rejection-sampling prints."""
    # Level generation prints "Sampling rejected: ..." to stdout on retries; a CLI that prints
    # its own summary (and a rank's log) should not carry that noise.
    with contextlib.redirect_stdout(io.StringIO()):
        obs, _ = env.reset(seed=seed)
    return obs


def expert_bot(env: Any) -> Any:
    """minigrid's BabyAI expert (``BabyAIBot``) for ``env``'s current episode (call after
    reset); ``bot.replan()`` returns the next action."""
    require_minigrid()
    from minigrid.utils.baby_ai_bot import BabyAIBot

    return BabyAIBot(env.unwrapped)


def frame_of(obs: dict[str, Any]) -> np.ndarray:
    """The observation's RGB frame as a contiguous ``(H, W, 3)`` uint8 array."""
    return np.ascontiguousarray(obs["image"], dtype=np.uint8)
