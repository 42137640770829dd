"""Attention of a query block against one key/value block, returning the log-sum-exp, and
its backward from the merged output (the building block of ring and Ulysses attention).

[Note: blockwise attention] Attention over a sequence split into key blocks is exact when
each block's output ``o_j`` comes with its row log-sum-exp ``l_j``: the merged output is
``sum_j exp(l_j - l) o_j`` with ``l = logaddexp_j l_j``, accumulated in fp32 whatever the
inputs' dtype. The backward needs no per-block state: with the merged ``o`` and ``l``, each
block's probabilities are ``exp(s_j - l)`` and the softmax correction ``rowsum(dO * o)`` is
global, so the per-block gradients (``dQ`` summed over blocks, ``dK_j``, ``dV_j``) add up to
the gradients of the whole attention. This is the flash-attention backward applied per
block; on the CPU it is ATen's own flash kernels (``_scaled_dot_product_flash_attention_for_cpu``
and its backward, which take an additive mask and return the log-sum-exp), elsewhere the
same arithmetic in plain tensor ops (exact, but it materialises one block's scores).

Masks come from positions (see [Note: causal load balance]): a key block entirely before the
query block is ``full``, one entirely after it is skipped, the same range is ``causal``;
packed documents add ``document(q) == document(k)``. A query row that sees no key of a block
(possible with documents) gets ``l_j = -inf`` and weight 0; the CPU kernel reports 0 there,
so the row is reset from the mask.
"""

from __future__ import annotations

import torch

from shardwise.models.layers import repeat_kv

__all__ = ["pair_mode", "block_mask", "acc_dtype", "block_forward", "block_backward", "merge"]

Range = tuple[int, int]


def pair_mode(q_range: Range, k_range: Range) -> str:
    """``"skip"``, ``"full"``, ``"causal"`` or ``"masked"`` for queries at ``q_range`` against
    keys at ``k_range`` under a causal mask (key position <= query position)."""
    (qs, qe), (ks, ke) = q_range, k_range
    if ks > qe - 1:
        return "skip"
    if ke - 1 <= qs:
        return "full"
    if (qs, qe) == (ks, ke):
        return "causal"
    return "masked"


def block_mask(mode: str, q_range: Range, k_ranges: tuple[Range, ...],
               documents: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean ``(B | 1, 1, Tq, Tk)`` mask (True = attend) of queries at ``q_range``
    against keys at ``k_ranges`` (one call's chunks, in order), None when the kernel needs
    none (``full`` or ``causal`` without documents)."""
    if documents is None and mode in ("full", "causal"):
        return None
    device = documents.device if documents is not None else None
    mask = None
    if mode != "full":
        qp = torch.arange(*q_range, device=device)
        kp = torch.cat([torch.arange(*r, device=device) for r in k_ranges])
        mask = (kp[None, :] <= qp[:, None])[None, None]  # (1, 1, Tq, Tk)
    if documents is not None:
        dq = documents[:, q_range[0]:q_range[1]]
        dk = torch.cat([documents[:, s:e] for s, e in k_ranges], dim=1)
        same = (dq[:, :, None] == dk[:, None, :])[:, None]  # (B, 1, Tq, Tk)
        mask = same if mask is None else mask & same
    return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of a block's statistics and gradients: fp64 for fp64 inputs,
    fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cpu_kernels(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64,
                                                 torch.bfloat16, torch.float16)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str,
                  mask: torch.Tensor | None, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and row log-sum-exp.

    Args:
        q: ``(B, H, Tq, hd)``; k, v: ``(B, KV, Tk, hd)`` with ``KV`` dividing ``H``.
        mode: from :func:`pair_mode` (not ``"skip"``); mask: from :func:`block_mask`.
        scale: the softmax scale.

    Returns:
        ``(out, lse)``: ``(B, H, Tq, hd)`` in ``q``'s dtype and ``(B, H, Tq)`` fp32.
    """
    causal = mode == "causal" and mask is None
    if _cpu_kernels(q):  # grouped-query heads natively: no repeated copy of the block
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype),
            scale=scale)
        lse = lse.to(acc_dtype(q.dtype))
        if mask is not None:
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    f = acc_dtype(q.dtype)
    s = torch.matmul(q.to(f), k.to(f).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num_(0.0)
    return torch.matmul(p, v.to(f)).to(q.dtype), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, mode: str,
                   mask: torch.Tensor | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients, from the MERGED ``out`` and ``lse`` (see
    [Note: blockwise attention]).

    Returns:
        ``(dq, dk, dv)``: ``dq`` like ``q``; ``dk``, ``dv`` ``(B, KV, Tk, hd)`` in
        :func:`acc_dtype`, summed over the query heads that share each key head.
    """
    b, kv, tk, hd = k.shape
    rep = q.shape[1] // kv
    causal = mode == "causal" and mask is None
    f = acc_dtype(q.dtype)
    if _cpu_kernels(q):  # returns dK, dV of the KV heads, summed over their query heads
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(f), 0.0, causal,
            attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
        return dq, dk.to(f), dv.to(f)
    kr, vr = repeat_kv(k, rep), repeat_kv(v, rep)
    qf, kf, vf, df = q.to(f), kr.to(f), vr.to(f), dout.to(f)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None].to(f))
    dv = torch.matmul(p.transpose(-1, -2), df)
    dp = torch.matmul(df, vf.transpose(-1, -2))
    ds = p * (dp - (df * out.to(f)).sum(-1, keepdim=True))
    dq = (torch.matmul(ds, kf) * scale).to(q.dtype)
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    if rep > 1:
        dk = dk.view(b, kv, rep, tk, hd).sum(2)
        dv = dv.view(b, kv, rep, tk, hd).sum(2)
    return dq, dk, dv


def merge(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's ``(out, lse)`` into the fp32 running ``acc`` (None at first)."""
    out = out.to(lse.dtype)
    if acc is None:
        return out, lse
    o_acc, l_acc = acc
    new = torch.logaddexp(l_acc, lse)
    # Rows no block has reached yet stay -inf on both sides: weight 0, not nan.
    w_acc = torch.exp(l_acc - new).nan_to_num_(0.0)[..., None]
    w_blk = torch.exp(lse - new).nan_to_num_(0.0)[..., None]
    return o_acc * w_acc + out * w_blk, new
