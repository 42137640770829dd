"""The non-tensor state of a run: every rank's RNG states and the caller's ``extra`` values.

[Note: exact resume]
Bitwise resumption needs every input of the next step to be what it would have been: weights
and optimizer state (DCP), the optimizer's hyper-parameters and the LR schedule's position
(manifest JSON; the schedule writes ``lr`` into the groups, and both are restored), the loss
scaler, the data loader's position (the caller's ``extra``), and each rank's random number
generators (torch CPU, CUDA when initialised, Python's ``random``, numpy's global generator
when numpy is imported), captured per rank and restored on the same rank when the world size
is unchanged. With another world size there is no rank-to-rank correspondence: RNG states are
left alone (``CheckpointInfo.rng_restored`` is False), and results differ from the
uninterrupted run anyway because reductions run in another order.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from shardwise.checkpoint import jsonable
from shardwise.checkpoint.errors import CheckpointError

__all__ = ["capture_rng", "restore_rng", "encode_extra", "restore_extra"]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states, JSON-encoded."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return jsonable.encode(state, "rng")


def restore_rng(encoded: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture_rng` output."""
    state = jsonable.decode(encoded)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def encode_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """``extra`` as JSON: objects with ``state_dict()`` (LR schedules, loss scalers, data
    loaders) are replaced by their state dicts.

    Raises:
        ValueError: a key is not a string, or a value cannot be stored (naming it).
    """
    out = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"extra keys must be strings, got {key!r}")
        value = value.state_dict() if _is_stateful(value) else value
        out[key] = jsonable.encode(value, f"extra[{key!r}]")
    return out


def restore_extra(saved: dict[str, Any], extra: dict[str, Any] | None, path) -> dict[str, Any]:
    """Decode the saved extras; call ``load_state_dict`` on each stateful object in ``extra``.

    Returns:
        Every saved extra value, decoded (state dicts for stateful ones).

    Raises:
        CheckpointError: ``extra`` names a key the checkpoint does not hold.
    """
    decoded = {k: jsonable.decode(v) for k, v in saved.items()}
    for key, obj in (extra or {}).items():
        if key not in decoded:
            raise CheckpointError(f"checkpoint {path} has no extra state {key!r} (it has "
                                  f"{sorted(decoded)})", path=path, file="manifest.json")
        if _is_stateful(obj):
            obj.load_state_dict(decoded[key])
    return decoded
