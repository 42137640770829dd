"""Gradient clipping over sharded gradients.

Every gradient element is held by exactly one rank of its shard group (and replicated across
the replicate axis of a hybrid mesh), so the global norm is the sum of local sums of squares
over the shard group. Stage-0 and unmanaged gradients are whole on every rank and count
locally.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm

__all__ = ["clip_grad_norm_"]


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads],
                                norm_type)
    stacked = torch.stack([n.cpu() for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a (sharded) model by their global norm, in place.

    The same contract as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the norm
    is over every gradient of the model, whatever rank holds it.

    Args:
        model: the model (sharded, partly sharded or plain).
        max_norm: the largest allowed global norm (> 0).
        norm_type: p of the p-norm (default 2.0; ``inf`` for the max norm).
        error_if_nonfinite: raise if the global norm is nan or inf (default False).

    Returns:
        The global norm before clipping (a 0-d float32 tensor, identical on every rank).

    Raises:
        ValueError: for max_norm <= 0 or norm_type <= 0.
        RuntimeError: for a non-finite norm when ``error_if_nonfinite``.
    """
    from shardwise.shard.api import engine_states  # local: api imports grad users

    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type!r}")
    inf = math.isinf(norm_type)
    sharded_ids, all_grads = set(), []
    by_group: dict[int, tuple] = {}
    for st in engine_states(model):
        for u in getattr(st, "units", []):
            grads = [e.param.grad for e in u.trainable if e.param.grad is not None]
            sharded_ids.update(id(e.param) for e in u.trainable)
            key = id(st.groups.shard)
            group, acc = by_group.get(key, (st.groups.shard, []))
            acc.extend(grads)
            by_group[key] = (group, acc)
    local = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in sharded_ids]
    all_grads.extend(local)
    total = _local_norm(local, norm_type)
    for group, grads in by_group.values():
        all_grads.extend(grads)
        part = _local_norm(grads, norm_type)
        if group is not None and dist.get_world_size(group) > 1:
            comm.all_reduce(part, group, label="clip_grad_norm",
                            op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        total = torch.maximum(total, part) if inf else total + part
    norm = total if inf else total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the global gradient norm is {norm.item()}; set "
                           f"error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if all_grads:
        torch._foreach_mul_(all_grads, coef.to(all_grads[0].device))
    return norm
