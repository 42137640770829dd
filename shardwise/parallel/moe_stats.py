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
Under sequence parallelism the tensor ranks of one data rank route different tokens: the
reduction then runs over data x tensor ranks, and ``replicas`` (the data-parallel degree,
over which gradients are averaged; the tensor ranks sum theirs) replaces the reduced
replica count ``W``. In a pipeline those are the ranks of one stage, which no single group
spans: the reduction then runs over the data group and the tensor group in turn.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.compiled import refuse_in_compiled_region
from shardwise.models.moe import STATS_REPLICAS, moe_layers, set_stats_reducer
from shardwise.parallel.blocks import FORWARD_COLLECTIVES_ATTR

__all__ = ["apply_global_balance", "AllReduceStats"]


class AllReduceStats:
    """A ``stats_reducer``: the sum of a 1-D tensor over ``group`` (a new tensor).

    Args:
        group: the process group of the ranks whose tokens make the global batch (default
            None: the world), or a tuple of process groups of independent axes whose
            product is those ranks (summed over each in turn: e.g. a pipeline stage's data
            and tensor ranks, which no single group spans).
        replicas: the number of data-parallel replicas whose gradients are averaged when
            it is not the group's size (sequence parallelism: the group's size / tp);
            default None.
    """

    def __init__(self, group=None, replicas: int | None = None) -> None:  # noqa: ANN001
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                     or replicas < 1):
            raise ValueError(f"AllReduceStats: replicas={replicas!r}, expected an int >= 1")
        self.group, self.replicas = group, replicas

    def __call__(self, stats: torch.Tensor) -> torch.Tensor:
        refuse_in_compiled_region("MoE balance statistics (moe.stats all-reduce)")
        out = stats.clone()
        for group in self.group if isinstance(self.group, tuple) else (self.group,):
            comm.all_reduce(out, group, label="moe.stats")
        if self.replicas is not None:
            out[STATS_REPLICAS] = self.replicas
        return out

    def __repr__(self) -> str:
        return (f"AllReduceStats(group={'world' if self.group is None else self.group}, "
                f"replicas={self.replicas})")


def apply_global_balance(model: nn.Module, group=None,  # noqa: ANN001
                         replicas: int | None = None) -> nn.Module:
    """Make every MoE layer of ``model`` reduce its balance statistics over ``group``.

    Must then run on every rank of ``group``: each training-mode MoE forward issues one
    small all-reduce (evaluation-mode forwards issue none).

    Args:
        model: a model with :class:`~shardwise.models.moe.MoE` layers (sharded or not;
            a model without any is returned unchanged).
        group: the ranks whose tokens make the global batch: the data-parallel group, or,
            under sequence parallelism, the data x tensor ranks (default None: the world);
            a tuple of groups of independent axes sums over their product (a pipeline
            stage's ``(mesh.group("dp"), mesh.group("tp"))``).
        replicas: the data-parallel degree when it is not ``group``'s size (sequence
            parallelism); default None.

    Returns:
        ``model``, modified in place.
    """
    layers = moe_layers(model)
    if layers:
        set_stats_reducer(model, AllReduceStats(group, replicas))
        for _, layer in layers:  # compile_blocks refuses blocks that hold one
            setattr(layer, FORWARD_COLLECTIVES_ATTR, "MoE balance statistics all-reduce")
    return model
