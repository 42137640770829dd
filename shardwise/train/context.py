"""The trainer's side of context parallelism: ``--parallel.cp N`` and the ``cp_*`` keys.

    shardwise train --nproc 2 --parallel.cp 2                            # ring, zigzag
    shardwise train --nproc 4 --parallel.cp 4 --parallel.cp_impl hybrid  # a2a x ring
    shardwise train --nproc 4 --parallel.cp 2 --parallel.tp 2            # cp x tp
    shardwise train --config configs/long.toml                           # 16K tokens

The cp ranks of one data rank read the same sequences (``data_rank``: like tensor ranks,
they do not multiply the global batch), and each feeds the model its part of them in the
layout ``apply_cp`` gave the model (:func:`local_sequences`). ``apply_cp`` itself runs in
``shardwise.train.parallelize`` (and ``shardwise.train.pipeline``, before the split), in
the composition order; the engine shards and averages over ``dp_shard x cp``. The checks
here need the model's shape and run before any rank starts (the shape-free ones, the
sequence length against the chunks included, are the config checks').

[Note: the loss under context parallelism] Every cp rank holds ``seq_len / cp`` tokens of
each sequence, so its plain mean loss is over the same number of tokens as every other
rank's: the mean of the ``dp_cp`` ranks' means is the global batch's mean, the engine's
gradient average over ``dp_cp`` (``shard`` over a ParallelMesh with cp > 1) is that mean's
gradient, and the loop's average of every rank's loss (tensor and pipeline ranks repeat
their group's) is the loss one process computes. No token count is communicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.parallel.context import cp_context, ulysses_degree

__all__ = ["validate_cp", "local_sequences", "describe_cp"]


def validate_cp(cfg: Any, model_cfg: Any) -> None:
    """Context-parallel checks that need the model's shape, before any rank starts.

    Raises:
        ValueError: ``parallel.cp > 1`` with multi-head latent attention, or a
            ``parallel.cp_impl`` whose all-to-all degree the key/value heads per tensor rank
            cannot take (ulysses: cp must divide them; hybrid: a proper divisor of cp above 1
            must); each message names the key and the numbers.
    """
    par = cfg.parallel
    if par.cp == 1:
        return
    if getattr(model_cfg, "attention", "gqa") == "mla":
        raise ValueError(f"parallel.cp={par.cp}: model {cfg.model.name!r} has multi-head "
                         f"latent attention (attention='mla'), which context parallelism "
                         f"does not cover yet; expected a grouped-query attention model, or "
                         f"parallel.cp=1")
    kv = model_cfg.n_kv_heads
    per_rank = max(kv // par.tp, 1)  # fewer KV heads than tensor ranks: copies, one each
    try:
        ulysses_degree(par.cp_impl, par.cp, per_rank)
    except ValueError as exc:
        tp = f" / parallel.tp={par.tp}" if par.tp > 1 else ""
        raise ValueError(f"parallel.{exc} (model {cfg.model.name!r}: n_kv_heads={kv}{tp})"
                         ) from None


def local_sequences(model: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's part of each whole-sequence ``(B, T)`` tensor (inputs, targets) under
    context parallelism, in the model's layout; the tensors themselves otherwise. Every cp
    rank's part has ``T / cp`` tokens ([Note: the loss under context parallelism])."""
    ctx = cp_context(model)
    if ctx is None:
        return tensors
    return tuple(ctx.shard(t, dim=1) for t in tensors)


def describe_cp(dims: Any, par: Any) -> list[str]:
    """The start line's part for context parallelism: ``["cp 2 (ring, zigzag)"]``, or
    ``[]`` at cp 1."""
    if dims.cp == 1:
        return []
    return [f"cp {dims.cp} ({par.cp_impl}, {par.cp_load_balance})"]
