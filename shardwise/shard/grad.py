"""Gradient norms and clipping over sharded gradients, with no host sync per tensor.

Each parameter's :class:`~shardwise.distributed.placement.Placement` says over which axes
its squared norm is summed (``norm_reduce``): every element of the global gradient is held
by exactly one rank of them. A ZeRO shard is summed over ``dp_shard`` (copies across
``dp_replicate`` count once); a tensor-parallel piece over ``tp`` too; a parameter
replicated over the tensor ranks (a norm weight) is not summed over ``tp``; a KV head copied
to several tensor ranks is summed over one rank per head. Stage-0 and unmanaged gradients
are whole on every rank and count locally.

[Note: fused norms] Per set of groups to sum over, the local gradients' norms come from one
fused ``torch._foreach_norm`` (accumulated in fp32 whatever the gradients' dtype) and are
summed on the device they live on; then one all-reduce per group (on that group's device,
see [Note: device check] in comm.py) of the partial sums of every set that includes it
combines the ranks. Nothing is copied to the host: the
returned norm is a device tensor, and clipping multiplies every gradient by a device-side
coefficient. The trainer reads the norm once per step (:func:`get_total_norm`, shared by
its non-finite check and :func:`clip_grads_with_norm_`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.placement import placement_of

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"]


def _local_norm(grads: list[torch.Tensor], norm_type: float,
                device: torch.device) -> torch.Tensor:
    """The local sum of ``|g|^p`` (or max of ``|g|`` for p = inf), a 0-d fp32 tensor on
    ``device`` ([Note: fused norms])."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_device.setdefault(g.device, []).append(g)
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for dev, gs in by_device.items():
        norms = torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32))
        part = norms.max() if inf else norms.pow(norm_type).sum()
        part = part.to(device, non_blocking=True) if dev != device else part
        total = torch.maximum(total, part) if inf else total + part
    return total


def _grouped_grads(model: nn.Module) -> dict[tuple, tuple[tuple, list[torch.Tensor]]]:
    """``{key: (groups the norm is summed over, gradients)}`` from the placements."""
    out: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        pl = placement_of(p)
        groups = tuple(a.group for a in pl.norm_reduce if a.size > 1) if pl else ()
        out.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(p.grad)
    return out


def get_total_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The global p-norm of every gradient of a (sharded) model (collective).

    The same number ``torch.nn.utils.get_total_norm`` gives on the unsplit model, whatever
    rank holds each gradient and however tensor parallelism cut it; no host sync ([Note:
    fused norms]).

    Args:
        model: the model (sharded, partly sharded or plain).
        norm_type: p of the p-norm (default 2.0; ``inf`` for the max norm).

    Returns:
        A 0-d float32 tensor on the device of the model's first group (the CPU on Gloo),
        identical on every rank.

    Raises:
        ValueError: for norm_type <= 0.
    """
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type!r}")
    inf = math.isinf(norm_type)
    sets = _grouped_grads(model)
    first = next((gs[0] for gs, _ in sets.values() if gs), None)
    device = comm.group_device(first)
    parts = {k: _local_norm(grads, norm_type, comm.group_device(gs[0] if gs else first))
             for k, (gs, grads) in sets.items()}
    groups = {id(g): g for gs, _ in sets.values() for g in gs}
    for gid, group in groups.items():
        keys = [k for k in parts if gid in k]
        vec = torch.stack([parts[k].to(comm.group_device(group)) for k in keys])
        comm.all_reduce(vec, group, label="clip_grad_norm",
                        op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        for k, v in zip(keys, vec.unbind(0)):
            parts[k] = v
    total = torch.zeros((), dtype=torch.float32, device=device)
    for part in parts.values():
        part = part.to(device, non_blocking=True)
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total.pow(1.0 / norm_type)


def clip_grads_with_norm_(model: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))``, in place.

    Args:
        model: the model whose gradients ``total_norm`` measured (:func:`get_total_norm`).
        max_norm: the largest allowed global norm (> 0).
        total_norm: the global norm, a tensor (read on the device, never on the host).

    Raises:
        ValueError: for max_norm <= 0.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad)
    for dev, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(dev, non_blocking=True))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a (sharded) model by their global norm, in place.

    The same contract as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the norm
    is over every gradient of the model, whatever rank holds it. One fused norm and one
    all-reduce per shard group, no host sync unless ``error_if_nonfinite``.

    Args:
        model: the model (sharded, partly sharded or plain).
        max_norm: the largest allowed global norm (> 0).
        norm_type: p of the p-norm (default 2.0; ``inf`` for the max norm).
        error_if_nonfinite: raise if the global norm is nan or inf (default False; reading
            the norm on the host to decide is one sync).

    Returns:
        The global norm before clipping (a 0-d float32 tensor, identical on every rank).

    Raises:
        ValueError: for max_norm <= 0 or norm_type <= 0.
        RuntimeError: for a non-finite norm when ``error_if_nonfinite``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    norm = get_total_norm(model, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the global gradient norm is {norm.item()}; set "
                           f"error_if_nonfinite=False to clip anyway")
    clip_grads_with_norm_(model, max_norm, norm)
    return norm
