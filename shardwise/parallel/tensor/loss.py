"""Cross-entropy over vocab-sharded logits (loss parallel): the full logits never exist.

[Note: vocab-parallel cross-entropy] (Megatron-LM's ``vocab_parallel_cross_entropy``.)
Tensor rank ``r`` of ``n`` holds logits ``z[:, rV/n:(r+1)V/n]``. With ``m`` the global row
maximum, ``loss = log(sum_j exp(z_j - m)) - (z_target - m)``: one all-reduce (max) of the
row maxima, then one all-reduce (sum) of two numbers per row, the local sum of
``exp(z_j - m)`` and the target's shifted logit (zero on every rank but the one holding
the target). Backward needs no communication: each rank's gradient is its slice of
``softmax(z) - onehot(target)``, scaled by the upstream gradient over the token count. The
softmax is kept in fp32 (one ``(N, V/n)`` tensor, as the logits' own fp32 copy would be).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed import comm
from shardwise.distributed.comm import dims as comm_dims

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        n_local = logits.shape[-1]
        x = logits.reshape(-1, n_local).float()               # (N, V/n)
        t = targets.reshape(-1)
        start = comm.group_rank(group) * n_local
        m = x.max(dim=-1).values
        comm_dims.all_reduce_max(m, group, label="loss.tp_loss_max")
        x = x - m.unsqueeze(1)
        local = t - start
        hit = (local >= 0) & (local < n_local) & (t != ignore_index)
        local = local.clamp(0, n_local - 1)
        pred = x.gather(1, local.unsqueeze(1)).squeeze(1) * hit
        x.exp_()                                              # x is now exp(z - m)
        stats = torch.stack([x.sum(dim=-1), pred])             # (2, N)
        stats = comm_dims.all_reduce_sum(stats, group, label="loss.tp_loss_sum")
        valid = t != ignore_index
        count = valid.sum()
        per_token = (stats[0].log() - stats[1]) * valid
        x.div_(stats[0].unsqueeze(1))                          # softmax, kept for backward
        ctx.save_for_backward(x, local, hit, valid, count)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return per_token.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, local.unsqueeze(1), -hit.to(g.dtype).unsqueeze(1))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(1))
        return g.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_mesh,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of vocab-sharded logits, equal to
    ``F.cross_entropy(full_logits.flatten(0, -2).float(), targets.flatten())`` on every
    tensor rank ([Note: vocab-parallel cross-entropy]).

    Args:
        logits: ``(..., V / tp)``: this rank's contiguous slice of the vocabulary (what a
            model parallelised with ``apply_tp(..., loss_parallel=True)`` returns).
        targets: ``(...)`` int64 global token ids.
        tp_mesh: the tensor-parallel 1-D DeviceMesh (or its process group).
        ignore_index: targets equal to it count neither in the loss nor the mean
            (default -100, as ``F.cross_entropy``).

    Returns:
        The mean loss, a 0-d fp32 tensor, identical on every tensor rank.

    Raises:
        ValueError: when ``targets``' shape is not ``logits``' without the last dim.
    """
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: targets of shape "
                         f"{tuple(targets.shape)} do not match logits of shape "
                         f"{tuple(logits.shape)} (expected targets of shape "
                         f"{tuple(logits.shape[:-1])})")
    group = tp_mesh.get_group() if isinstance(tp_mesh, DeviceMesh) else tp_mesh
    return _VocabParallelCE.apply(logits, targets, group, ignore_index)
