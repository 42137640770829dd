"""Expert parallelism: the experts of each MoE layer split over the ``ep`` ranks, tokens
dispatched to them and combined back by all-to-alls of uneven splits.

    mesh = ParallelDims(world_size=4, ep=4).build_mesh()
    model = apply_ep(model, mesh)                       # before shardwise.shard(..., mesh=mesh)

See :mod:`shardwise.parallel.expert.apply` (placement, composition) and
:mod:`shardwise.parallel.expert.dispatch` (the exchange and its byte count).
"""

from shardwise.parallel.expert.apply import (EPContext, apply_ep, ep_context, expert_modules,
                                             share_ep_context)
from shardwise.parallel.expert.dispatch import (EP_LABELS, AllToAll, ExpertGroup,
                                                dispatch_bytes, dispatch_compute_combine)

__all__ = ["apply_ep", "ep_context", "share_ep_context", "EPContext", "expert_modules",
           "ExpertGroup", "AllToAll", "dispatch_compute_combine", "dispatch_bytes", "EP_LABELS"]
