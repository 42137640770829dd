"""``torch.compile`` of a model's blocks, with the sharding engine's communication outside.

    model = build_model(cfg, device="meta")
    shardwise.checkpoint_activations(model, policy="selective")  # optional, first
    shardwise.compile_blocks(model, backend="inductor")          # then compile
    model = shardwise.shard(model, stage=3, wrap={TransformerBlock})

Each block's ``forward`` is compiled with ``fullgraph=True`` (a graph break is an error, not
a silent fallback), so a block is one graph. The block's ``__call__`` stays eager: the
engine's pre-forward hook gathers the unit's parameters and registers the full ones, the
compiled graph runs on them, and the post-forward hook frees them; the reduce-scatters run
from autograd hooks, outside the compiled backward too (see
[Note: collectives outside compiled regions] in shardwise/distributed/compiled.py).

[Note: no recompiles] Dynamo guards on what a graph reads: tensor shapes, dtypes, strides and
``requires_grad``, grad mode, module attributes. The engine keeps those fixed from step to
step: it swaps the *same* full ``nn.Parameter`` objects into the modules every step and
refills their storage in place ([Note: freeing gathered parameters] in shard/unit.py), so
neither a stage-3 free / gather nor an optimizer step changes anything a guard reads. Blocks
of one shape share the graph (one compile for all of them). What does compile again: a new
input shape (``dynamic=False`` specialises on it), and the first forward without gradients
(a validation pass), once each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.distributed.compiled import refusal_in
from shardwise.models.moe import MoE
from shardwise.parallel.blocks import FORWARD_COLLECTIVES_ATTR, select_blocks
from shardwise.shard import engine_states

__all__ = ["compile_blocks", "compiled_blocks", "COMPILED_ATTR", "CUDAGRAPH_MODES"]

COMPILED_ATTR = "_shardwise_compiled"
"""Attribute holding a compiled block's settings (a dict), and its eager ``forward``."""

CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that capture CUDA graphs, refused by :func:`compile_blocks`."""


def _refuse_collectives(name: str, block: nn.Module, sharded_units: list[str]) -> None:
    """Nothing in the block may communicate ([Note: collectives outside compiled regions])."""
    where = name or "<root>"
    if sharded_units:
        raise ValueError(
            f"compile_blocks: block {where!r} holds sharding units {sharded_units}; their "
            "all-gathers and reduce-scatters would run inside the compiled graph. Compile "
            "the units themselves (blocks= the classes passed to shard's wrap) or shard "
            "with wrap= the compiled blocks")
    for sub, module in block.named_modules():
        full = ".".join(filter(None, (name, sub))) or "<root>"
        if isinstance(module, MoE):
            raise ValueError(
                f"compile_blocks: block {where!r} holds an MoE feed-forward ({full!r}): its "
                "routing has data-dependent shapes (graph breaks) and over several ranks it "
                "all-reduces balance statistics in forward, a collective inside the compiled "
                "graph. Compile dense blocks only (pass blocks=... to select them)")
        what = getattr(module, FORWARD_COLLECTIVES_ATTR, None)
        if what:
            raise ValueError(f"compile_blocks: block {where!r} holds {full!r}, whose forward "
                             f"issues collectives ({what}) that torch.compile cannot trace")


def _with_refusals(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` with a refusal traced under ``fullgraph=True`` (which Dynamo reports as
    an unsupported exception) raised as the ``ValueError`` it was (see refusal_in)."""
    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as exc:
            refusal = refusal_in(exc)
            if refusal is None:
                raise
            raise refusal from None
    return forward


def _check_args(backend: Any, mode: str | None) -> None:
    if not (callable(backend) or isinstance(backend, str) and backend):
        raise ValueError(f"compile_blocks: backend={backend!r}, expected a backend name "
                         "('inductor', 'aot_eager', 'eager', ...) or a callable")
    if mode in CUDAGRAPH_MODES:
        raise ValueError(
            f"compile_blocks: mode={mode!r} captures CUDA graphs, which pin every tensor's "
            "address, while the engine refills gathered parameters in pooled memory; expected "
            "None, 'default' or 'max-autotune-no-cudagraphs'")


def compile_blocks(model: nn.Module, blocks=None, *, backend: str | Callable = "inductor",
                   mode: str | None = None, dynamic: bool = False,
                   options: dict[str, Any] | None = None) -> nn.Module:
    """Compile each block's ``forward`` with ``torch.compile(fullgraph=True)``, in place.

    Apply it after :func:`~shardwise.parallel.checkpoint_activations` and before ``shard``
    (``train/parallelize.py`` does so); a meta-device model is fine, nothing compiles until
    the first forward. Applied after ``shard``, it checks that no sharding unit sits inside
    a block. Blocks of one shape share one compiled graph ([Note: no recompiles]).

    Args:
        model: the model.
        blocks: a module class, a set of classes or a predicate ``(name, module) -> bool``
            (default None: every :class:`~shardwise.models.ModelBlock`, the blocks of every
            tower); see
            :func:`~shardwise.parallel.blocks.select_blocks`.
        backend: ``torch.compile`` backend (default "inductor", which needs a C++ compiler
            on CPU and Triton on GPU; "aot_eager" traces forward and backward without
            generating code, for tests).
        mode: ``torch.compile`` mode (default None); the CUDA-graph modes are refused.
        dynamic: compile for symbolic shapes (default False: specialise on each shape).
        options: backend options passed to ``torch.compile`` (default None).

    Returns:
        ``model``, its blocks compiled.

    Raises:
        ValueError: a bad backend or a CUDA-graph mode, no module matching ``blocks``, a
            block compiled already, or a block that would put collectives inside its graph
            (sharding units inside it, an MoE layer, a module declaring forward collectives)
            -- see [Note: collectives outside compiled regions].
    """
    _check_args(backend, mode)
    chosen = select_blocks(model, blocks, caller="compile_blocks")
    unit_labels = {id(u.module): u.label for s in engine_states(model)
                   for u in s.units}  # bucketed stage 0 has none
    for name, block in chosen:
        if getattr(block, COMPILED_ATTR, None) is not None:
            raise ValueError(f"compile_blocks: block {name or '<root>'!r} is compiled "
                             "already; compile it once")
        units = [unit_labels[id(m)] for m in block.modules()
                 if m is not block and id(m) in unit_labels]
        _refuse_collectives(name, block, units)
    settings = {"backend": backend, "mode": mode, "dynamic": dynamic, "options": options}
    extra = {k: v for k, v in (("mode", mode), ("options", options)) if v is not None}
    for _, block in chosen:
        eager = block.forward
        block.forward = _with_refusals(torch.compile(
            eager, fullgraph=True, backend=backend, dynamic=dynamic, **extra))
        setattr(block, COMPILED_ATTR, {**settings, "eager_forward": eager})
    return model


def compiled_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks of ``model`` that :func:`compile_blocks` compiled."""
    return [name for name, m in model.named_modules()
            if getattr(m, COMPILED_ATTR, None) is not None]
