"""Meta-device initialisation, one module at a time, straight into shards.

[Note: module-by-module init] Eager construction initialises modules in registration order
from one RNG stream. Walking ``named_modules()`` in the same order, giving each module fresh
CPU tensors for its *direct* parameters and buffers and calling the init function on it,
consumes the RNG identically, so every rank computes the same full values as eager init;
each rank then keeps only its rows. A parameter laid out by tensor parallelism (see [Note:
placement is data]) is initialised at its global shape and cut to this rank's piece, so the
values are those of eager init at any tensor-parallel degree. A parameter's full tensor
lives only until the last module registering it (tied weights) has been initialised, so no
rank ever holds more than one module's parameters plus tied ones in flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.shard.placed import global_shape, model_piece
from shardwise.sizes import nbytes

__all__ = ["has_meta", "default_init", "materialize"]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(
        t.is_meta for t in module.buffers())


def default_init(module: nn.Module) -> None:
    """Initialise one module's direct tensors with its ``reset_parameters()``."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"module {type(module).__name__} has meta-device tensors but no reset_parameters(); "
            f"pass init_weights=callable(module) to shardwise.shard")
    reset()


def materialize(root: nn.Module, device: torch.device,
                init_weights: Callable[[nn.Module], None] | None,
                sink: Callable[[nn.Parameter, torch.Tensor], None]) -> int:
    """Initialise every meta parameter and buffer of ``root`` module by module.

    Args:
        root: the module tree (buffers are materialised in place; parameters are not).
        device: where full values are computed.
        init_weights: initialises one module's direct tensors (default: reset_parameters).
        sink: receives (original meta parameter, its initialised value: this rank's
            tensor-parallel piece of it, the whole value without tensor parallelism) after
            each module that registers it; it keeps what it needs (e.g. this rank's rows).
    """
    init = init_weights or default_init
    modules = list(root.named_modules(remove_duplicate=True))
    last_use: dict[int, int] = {}
    for i, (_, m) in enumerate(modules):
        for p in m._parameters.values():
            if p is not None and p.is_meta:
                last_use[id(p)] = i
    live: dict[int, nn.Parameter] = {}
    peak = 0
    for i, (name, m) in enumerate(modules):
        metas = [(a, p) for a, p in m._parameters.items() if p is not None and p.is_meta]
        bufs = [a for a, b in m._buffers.items() if b is not None and b.is_meta]
        if not metas and not bufs:
            continue
        for a in bufs:
            m._buffers[a] = torch.empty_like(m._buffers[a], device=device)
        for a, p in metas:
            if id(p) not in live:
                live[id(p)] = nn.Parameter(torch.empty(global_shape(p), dtype=p.dtype,
                                                       device=device),
                                           requires_grad=p.requires_grad)
            m._parameters[a] = live[id(p)]
        peak = max(peak, sum(nbytes(t) for t in live.values()))
        try:
            with torch.no_grad():
                init(m)
        except ValueError:
            raise
        except Exception as exc:  # name the module: init errors are otherwise anonymous
            raise ValueError(f"initialising module {name or '<root>'} "
                             f"({type(m).__name__}) failed: {exc}") from exc
        for a, p in metas:
            sink(p, model_piece(p, live[id(p)].detach()))
            m._parameters[a] = p
            if last_use[id(p)] == i:
                del live[id(p)]
    return peak
