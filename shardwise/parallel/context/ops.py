"""Context-parallel attention as custom operators, so ``torch.compile`` traces a block that
holds one without a graph break and activation checkpointing recomputes it like any op.

[Note: context-parallel operators] ``shardwise::cp_attention`` (ring or local attention
returning the output and the log-sum-exp), its backward ``shardwise::cp_attention_backward``,
and the all-to-all pair ``shardwise::cp_seq_to_heads`` / ``shardwise::cp_heads_to_seq``, each
the other's adjoint. Their communication is inside the operator (the compiler sees an opaque
call with a fake implementation for shapes), and the groups and layout they use travel as an
integer handle into :data:`_RUNTIMES`, because an operator's arguments are tensors and
scalars. Every rank of a cp group calls them in the same order (one per attention layer, the
same for the recomputation of a checkpointed block), which is what the ring's messages and
the all-to-alls need.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardwise.parallel.context.kernels import acc_dtype
from shardwise.parallel.context.runtime import ContextParallel

__all__ = ["register", "cp_attention"]

_RUNTIMES: list[ContextParallel] = []


def register(runtime: ContextParallel) -> ContextParallel:
    """Give ``runtime`` its handle (its index in the registry) and keep it alive."""
    runtime.handle = len(_RUNTIMES)
    _RUNTIMES.append(runtime)
    return runtime


@torch.library.custom_op("shardwise::cp_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               documents: Optional[torch.Tensor], handle: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return _RUNTIMES[handle].ring_forward(q, k, v, documents)


@_attention.register_fake
def _(q, k, v, documents, handle):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("shardwise::cp_attention_backward", mutates_args=())
def _attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        documents: Optional[torch.Tensor], handle: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _RUNTIMES[handle].ring_backward(dout, q, k, v, out, lse, documents)


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, documents, handle):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, documents, handle = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, documents)
    ctx.handle = handle


def _attention_grad(ctx, dout, dlse):
    q, k, v, out, lse, documents = ctx.saved_tensors
    dq, dk, dv = _attention_backward(dout.contiguous(), q, k, v, out, lse, documents,
                                     ctx.handle)
    return dq, dk, dv, None, None


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


@torch.library.custom_op("shardwise::cp_seq_to_heads", mutates_args=())
def _seq_to_heads(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _RUNTIMES[handle].seq_to_heads(x)


@_seq_to_heads.register_fake
def _(x, handle):
    n = _RUNTIMES[handle].a2a_size
    b, h, t, hd = x.shape
    return x.new_empty(b, h // n, n * t, hd)


@torch.library.custom_op("shardwise::cp_heads_to_seq", mutates_args=())
def _heads_to_seq(y: torch.Tensor, handle: int) -> torch.Tensor:
    return _RUNTIMES[handle].heads_to_seq(y)


@_heads_to_seq.register_fake
def _(y, handle):
    n = _RUNTIMES[handle].a2a_size
    b, hn, nt, hd = y.shape
    return y.new_empty(b, hn * n, nt // n, hd)


def _a2a_setup(ctx, inputs, output) -> None:
    ctx.handle = inputs[1]


_seq_to_heads.register_autograd(
    lambda ctx, g: (_heads_to_seq(g.contiguous(), ctx.handle), None), setup_context=_a2a_setup)
_heads_to_seq.register_autograd(
    lambda ctx, g: (_seq_to_heads(g.contiguous(), ctx.handle), None), setup_context=_a2a_setup)


def cp_attention(runtime: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens under context parallelism.

    Args:
        runtime: what ``apply_cp`` installed.
        q: ``(B, H, T_local, hd)`` queries (RoPE applied at global positions).
        k, v: ``(B, KV, T_local, hd)``, not repeated for grouped-query attention.
        documents: ``(B, T)`` document ids of the WHOLE sequence (packed documents), or None.

    Returns:
        ``(B, H, T_local, hd)``, exactly the rows one process computes for these tokens.
    """
    if runtime.a2a_size > 1:
        runtime.check_heads(k.shape[1], "key/value heads")
        q, k, v = (_seq_to_heads(t.contiguous(), runtime.handle) for t in (q, k, v))
    out, _ = _attention(q.contiguous(), k.contiguous(), v.contiguous(), documents,
                        runtime.handle)
    if runtime.a2a_size > 1:
        out = _heads_to_seq(out, runtime.handle)
    return out
