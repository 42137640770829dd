"""Activation checkpointing of a model's blocks: recompute in backward instead of storing.

    model = build_model(cfg, device="meta")
    shardwise.checkpoint_activations(model, policy="selective")   # before compile and shard
    model = shardwise.shard(model, stage=3, wrap={TransformerBlock})

Policies (``train.activation_checkpoint`` in the trainer):

* ``"full"``: a block keeps only its inputs for backward; its whole forward runs again when
  backward reaches it. Activation memory drops from every block's intermediates to one
  block input per block (plus one block's intermediates while it is recomputed).
* ``"selective"``: a block also keeps the outputs of the expensive ops -- matmuls
  (``aten.mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``) and fused attention
  (``_scaled_dot_product_*``), :data:`SELECTIVE_SAVE_OPS` -- and recomputes the cheap rest
  (norms, rotary embedding, activations, elementwise products), as torchtitan's op-level
  policy does. Backward then repeats almost no FLOPs while the elementwise intermediates,
  which are most of a block's activations, are not stored.
* ``"none"``: nothing changes.

Checkpointing is non-reentrant (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``),
so it composes with hooks, ``torch.compile`` and keyword arguments, and recomputes the same
numbers (bitwise: the same ops run on the same inputs).

[Note: recompute under stage 3] The block's ``forward`` attribute is replaced, not its
``__call__``, so the sharding engine's hooks on the block run once, around the original
forward. When backward reaches a checkpointed block that is a sharding unit, the engine's
pre-backward hook (on the block's outputs) has already gathered the unit's parameters and
registered the full ones before the first saved tensor is unpacked, which is what triggers
the recompute; the recompute therefore reads gathered parameters and gathers nothing. When a
checkpointed block holds smaller units, the recompute calls their modules, whose pre-forward
hooks see ``in_backward()`` and gather them (a counted all-gather that stands in for the one
their pre-backward hook would issue, which then finds them gathered).
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from shardwise.models.moe import MoE
from shardwise.parallel.blocks import select_blocks
from shardwise.parallel.compile import COMPILED_ATTR

__all__ = ["checkpoint_activations", "checkpointed_blocks", "AC_POLICIES",
           "SELECTIVE_SAVE_OPS", "CHECKPOINT_ATTR"]

AC_POLICIES = ("none", "full", "selective")
"""The accepted ``policy`` values."""

_SAVE_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
               "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_fused_attention_overrideable")
SELECTIVE_SAVE_OPS = frozenset(getattr(torch.ops.aten, n) for n in _SAVE_NAMES
                               if hasattr(torch.ops.aten, n))
"""Ops (``torch.ops.aten`` overload packets) whose outputs ``"selective"`` keeps."""

CHECKPOINT_ATTR = "_shardwise_activation_checkpoint"
"""Attribute holding a checkpointed block's :class:`_Checkpointed` record."""


class _SavePolicy:
    """Selective policy: keep the outputs of ``ops``, recompute everything else."""

    def __init__(self, ops: frozenset) -> None:
        self.ops = ops

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) in self.ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class _Checkpointed:
    """What :func:`checkpoint_activations` did to one block."""

    policy: str
    inner: Callable[..., Any]        # the block's forward before, unbound when it was a method
    bound: bool                      # inner takes the block as its first argument
    context_fn: Callable[[], Any] | None


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a checkpointed block (bound to it; see [Note: recompute under stage 3]).

    A module-level function bound per block rather than a closure: ``torch.compile`` then
    traces one code object with the block as an argument, so every block of the same shape
    reuses one compiled graph instead of recompiling per closure.
    """
    rec: _Checkpointed = getattr(self, CHECKPOINT_ATTR)
    fn = functools.partial(rec.inner, self) if rec.bound else rec.inner
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return fn(*args, **kwargs)
    if rec.context_fn is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=rec.context_fn, **kwargs)


def _check_policy(policy: Any) -> str:
    if isinstance(policy, str) and policy in AC_POLICIES:
        return policy
    close = difflib.get_close_matches(str(policy), AC_POLICIES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"checkpoint_activations: policy={policy!r}, expected one of "
                     f"{', '.join(map(repr, AC_POLICIES))}{hint}")


def _check_block(name: str, block: nn.Module) -> None:
    where = name or "<root>"
    if hasattr(block, CHECKPOINT_ATTR):
        raise ValueError(f"checkpoint_activations: block {where!r} is checkpointed already "
                         f"(policy {getattr(block, CHECKPOINT_ATTR).policy!r}); apply it once")
    if getattr(block, COMPILED_ATTR, None) is not None:
        raise ValueError(f"checkpoint_activations: block {where!r} is compiled already; "
                         "checkpoint activations before compile_blocks (the order is "
                         "checkpointing -> compile -> shard, docs/compile.md)")
    moe = next((n for n, m in block.named_modules() if isinstance(m, MoE)), None)
    if moe is not None:
        raise ValueError(f"checkpoint_activations: block {where!r} holds an MoE feed-forward "
                         f"({'.'.join(filter(None, (name, moe)))!r}); its recompute would "
                         "route again and count the balance statistics twice. Checkpoint "
                         "dense blocks only (pass blocks=... to select them)")


def _selective_context(save_ops: Iterable | None) -> Callable[[], Any]:
    ops = SELECTIVE_SAVE_OPS if save_ops is None else frozenset(
        getattr(op, "overloadpacket", op) for op in save_ops)
    return functools.partial(create_selective_checkpoint_contexts, _SavePolicy(ops))


def checkpoint_activations(model: nn.Module, policy: str = "full", *, blocks=None,
                           save_ops: Iterable | None = None) -> nn.Module:
    """Checkpoint the activations of each block of ``model``, in place.

    Apply it before :func:`~shardwise.parallel.compile_blocks` and before ``shard`` (the
    documented order; either works on a meta-device model). Each block's ``forward``
    attribute is replaced; its hooks, parameters and names are untouched.

    Args:
        model: the model.
        policy: ``"full"`` (default: recompute each block's whole forward), ``"selective"``
            (keep matmul and attention outputs, recompute the rest) or ``"none"`` (return
            ``model`` unchanged).
        blocks: a module class, a set of classes or a predicate ``(name, module) -> bool``
            (default None: every :class:`~shardwise.models.ModelBlock`, the blocks of every
            tower); see
            :func:`~shardwise.parallel.blocks.select_blocks`.
        save_ops: ``"selective"`` only: the ops whose outputs are kept, as
            ``torch.ops.aten`` packets or overloads (default None: :data:`SELECTIVE_SAVE_OPS`).

    Returns:
        ``model``, its blocks checkpointed.

    Raises:
        ValueError: an unknown policy (with the closest valid one), ``save_ops`` with
            another policy, no module matching ``blocks``, a block already checkpointed or
            already compiled, or a block holding an MoE layer (its recompute would repeat
            the routing statistics).
    """
    policy = _check_policy(policy)
    if save_ops is not None and policy != "selective":
        raise ValueError(f"checkpoint_activations: save_ops is for policy 'selective', "
                         f"got policy={policy!r}")
    if policy == "none":
        return model
    chosen = select_blocks(model, blocks, caller="checkpoint_activations")
    for name, block in chosen:
        _check_block(name, block)
    context_fn = _selective_context(save_ops) if policy == "selective" else None
    for _, block in chosen:
        fwd = block.forward
        bound = isinstance(fwd, types.MethodType) and fwd.__self__ is block
        rec = _Checkpointed(policy, fwd.__func__ if bound else fwd, bound, context_fn)
        setattr(block, CHECKPOINT_ATTR, rec)
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, str]:
    """``{block name: policy}`` for every checkpointed block of ``model``."""
    return {name: getattr(m, CHECKPOINT_ATTR).policy for name, m in model.named_modules()
            if hasattr(m, CHECKPOINT_ATTR)}
