"""``model.freeze``: submodules trained frozen (issue 34).

A frozen parameter has ``requires_grad`` False before :func:`shardwise.shard`, so the engine
gives it no gradient buffer, no reduction and no optimizer state (its units still gather in
forward at stage 3). Applied by the orchestrator after the parallelisms and before sharding.
"""

from __future__ import annotations

from torch import nn

__all__ = ["apply_freeze"]


def apply_freeze(model: nn.Module, names: tuple[str, ...]) -> None:
    """Freeze the submodules ``names`` (e.g. ``vision``): no gradient, so the engine gives
    them no gradient buffer, no reduction and no optimizer state.

    Raises:
        ValueError: a name that is not a submodule of the model (listing its children).
    """
    children = dict(model.named_children())
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"model.freeze: {name!r} is not a submodule of the model; "
                             f"expected one of {sorted(children)}") from None
        module.requires_grad_(False)
