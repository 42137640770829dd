"""MoE balance statistics over the data-parallel ranks: one all-reduce per MoE forward.

    model = shardwise.shard(model, stage=3, wrap={TransformerBlock})
    apply_global_balance(model)                  # every replica balances the global batch

Models stay parallelism-unaware: each :class:`~shardwise.models.moe.MoE` layer hands its
float64 vector of local balance sums (tokens per expert, probability sums, log-sum-exp
squares, token count, 1, dropped assignments: ``2 * num_experts + 4`` numbers) to its
``stats_reducer``; this module sets that reducer to a sum over the data-parallel group, so
the aux loss, the z-loss, the logged token counts and the DeepSeek-V3 bias update are those
of the global batch, and identical on every replica (see [Note: global balance statistics]
in shardwise/models/moe.py). The reduction is counted under the label ``moe.stats``. With
expert parallelism the same reducer runs over the data axes the experts' tokens come from.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.compiled import refuse_in_compiled_region
from shardwise.models.moe import moe_layers, set_stats_reducer
from shardwise.parallel.blocks import FORWARD_COLLECTIVES_ATTR

__all__ = ["apply_global_balance", "AllReduceStats"]


class AllReduceStats:
    """A ``stats_reducer``: the sum of a 1-D tensor over ``group`` (a new tensor).

    Args:
        group: the data-parallel process group (default None: the world).
    """

    def __init__(self, group=None) -> None:  # noqa: ANN001 - a ProcessGroup or None
        self.group = group

    def __call__(self, stats: torch.Tensor) -> torch.Tensor:
        refuse_in_compiled_region("MoE balance statistics (moe.stats all-reduce)")
        out = stats.clone()
        comm.all_reduce(out, self.group, label="moe.stats")
        return out

    def __repr__(self) -> str:
        return f"AllReduceStats(group={'world' if self.group is None else self.group})"


def apply_global_balance(model: nn.Module, group=None) -> nn.Module:  # noqa: ANN001
    """Make every MoE layer of ``model`` reduce its balance statistics over ``group``.

    Must then run on every rank of ``group``: each training-mode MoE forward issues one
    small all-reduce (evaluation-mode forwards issue none).

    Args:
        model: a model with :class:`~shardwise.models.moe.MoE` layers (sharded or not;
            a model without any is returned unchanged).
        group: the data-parallel process group (default None: the world).

    Returns:
        ``model``, modified in place.
    """
    layers = moe_layers(model)
    if layers:
        set_stats_reducer(model, AllReduceStats(group))
        for _, layer in layers:  # compile_blocks refuses blocks that hold one
            setattr(layer, FORWARD_COLLECTIVES_ATTR, "MoE balance statistics all-reduce")
    return model
