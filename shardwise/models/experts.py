"""Routed experts: SwiGLU feed-forwards stored as stacked 3-D parameters, computed per group.

The experts see tokens already sorted by expert, with the number of tokens per expert, and
return outputs in the same order::

    y = experts(x_sorted, counts)      # (M, dim), (num_experts,) int64 -> (M, dim)

That contract is what expert parallelism replaces: dispatch (an all-to-all of the sorted
tokens) -> local experts -> combine, with the router and the balancing code untouched.

[Note: grouped expert compute]
Three ways to run ``E`` SwiGLUs over contiguous groups of rows, none with per-token Python:

* ``grouped_mm``: ``torch.nn.functional.grouped_mm(x, w[E, in, out], offs=cumsum(counts))``,
  one call per projection. Torch 2.13 runs it on CPU for fp32 / bf16 / fp16 when the rows
  of both operands are 16-byte aligned; its backward is exact (bitwise the per-expert
  ``mm`` results in our tests) but needs a contiguous output gradient, which
  :class:`_ContiguousGrad` guarantees.
* ``padded``: scatter the groups into ``(E, max_count, dim)`` zeros, three ``bmm``, gather
  back; wastes ``E * max_count - M`` rows of compute, so it degrades with imbalance.
* ``loop``: one ``mm`` per expert with tokens (a Python loop over experts, not tokens).

Measured by ``bench/moe_experts_bench.py`` (``bench/results/moe_experts.md``): on the CPU
``grouped_mm`` and ``loop`` are within noise of each other at every shape (torch's CPU
kernel is one GEMM per group as well), while ``padded`` loses with imbalance, by an order of
magnitude for many fine-grained experts. ``compute="auto"`` therefore takes ``grouped_mm``
whenever it applies:
one op per projection, no host synchronisation for the split sizes, and on GPUs a true
grouped GEMM; otherwise ``loop``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedExperts", "EXPERT_COMPUTE", "grouped_mm_supported", "expert_ffn"]

EXPERT_COMPUTE = ("auto", "grouped_mm", "padded", "loop")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward
    rejects the expanded gradients that e.g. ``.sum().backward()`` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - autograd ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


def grouped_mm_supported(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` can run these experts on ``x``'s device:
    16-byte aligned rows for both the model and the hidden width, and on CPU fp32 / bf16 /
    fp16, on CUDA bf16 with compute capability >= 8.0 (torch's documented requirement; not
    exercised by our CPU-only tests), on other devices never."""
    if not hasattr(F, "grouped_mm") or x.dtype != w1.dtype:
        return False
    if x.device.type == "cpu":
        if x.dtype not in _GROUPED_DTYPES:
            return False
    elif x.device.type != "cuda" or x.dtype != torch.bfloat16 \
            or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    size = x.element_size()
    return (w1.shape[1] * size) % 16 == 0 and (w1.shape[2] * size) % 16 == 0


def _grouped(x, counts, w1, w2, w3) -> torch.Tensor:
    offs = counts.cumsum(0).to(torch.int32)
    x = x.contiguous()
    h = F.silu(F.grouped_mm(x, w1, offs=offs)) * F.grouped_mm(x, w3, offs=offs)  # (M, F)
    return _ContiguousGrad.apply(F.grouped_mm(h, w2, offs=offs))  # (M, C)


def _padded(x, counts, w1, w2, w3) -> torch.Tensor:
    num_experts, m = counts.numel(), x.shape[0]
    expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts,
                                     output_size=m)  # (M,) expert of each row
    pos = torch.arange(m, device=x.device) - (counts.cumsum(0) - counts)[expert]
    rows = int(counts.max()) if m else 0
    xp = x.new_zeros(num_experts, rows, x.shape[1]).index_put((expert, pos), x)  # (E, R, C)
    yp = torch.bmm(F.silu(torch.bmm(xp, w1)) * torch.bmm(xp, w3), w2)  # (E, R, C)
    return yp[expert, pos]  # (M, C)


def _loop(x, counts, w1, w2, w3) -> torch.Tensor:
    # unbind, not w[e]: the backward of E index ops would add E full-size zero gradients.
    w1s, w2s, w3s = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    outs = [(F.silu(xe @ w1s[e]) * (xe @ w3s[e])) @ w2s[e]
            for e, xe in enumerate(x.split(counts.tolist())) if xe.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[2])


def expert_ffn(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               w3: torch.Tensor, compute: str = "auto") -> torch.Tensor:
    """SwiGLU expert ``e`` applied to its group of rows: ``w2[e](silu(x w1[e]) * x w3[e])``.

    Args:
        x: ``(M, dim)`` rows sorted by expert.
        counts: ``(E,)`` int64 rows per expert, summing to ``M``.
        w1, w3: ``(E, dim, hidden)``; w2: ``(E, hidden, dim)``.
        compute: "auto", "grouped_mm", "padded" or "loop" ([Note: grouped expert compute]).

    Returns:
        ``(M, dim)`` outputs in the rows' order. With no rows at all the result is still
        connected to the weights, so every expert gets a (zero) gradient.

    Raises:
        ValueError: an unknown ``compute``, or "grouped_mm" where it cannot run.
    """
    if compute == "auto":
        compute = "grouped_mm" if grouped_mm_supported(x, w1) else "loop"
    elif compute not in EXPERT_COMPUTE:
        raise ValueError(f"expert compute={compute!r}, expected one of {EXPERT_COMPUTE}")
    elif compute == "grouped_mm" and not grouped_mm_supported(x, w1):
        raise ValueError(f"expert compute='grouped_mm' cannot run dtype {x.dtype} with dim="
                         f"{w1.shape[1]}, hidden={w1.shape[2]} (needs fp32/bf16/fp16 and "
                         f"16-byte aligned rows); use 'auto'")
    if x.shape[0] == 0:  # keep the weights in the graph: zero, not missing, gradients
        return x.new_zeros(0, w2.shape[2]) + 0.0 * (w1.sum() + w2.sum() + w3.sum())
    fn = {"grouped_mm": _grouped, "padded": _padded, "loop": _loop}[compute]
    return fn(x, counts, w1, w2, w3)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three stacked parameters.

    ``w1`` (gate) and ``w3`` (up) are ``(E, dim, hidden)``, ``w2`` (down) is
    ``(E, hidden, dim)``, so expert ``e`` computes ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]``
    and the ZeRO engine's dim-0 sharding keeps whole experts together.

    Args:
        num_experts: experts ``E``.
        dim: model width in features.
        hidden_dim: each expert's hidden width in features.
        init_std: std of the normal init of ``w1`` / ``w3``.
        out_init_std: std of ``w2`` (the block output projection's scaled std).
        compute: expert compute path (default "auto"; see [Note: grouped expert compute]).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, init_std: float,
                 out_init_std: float, compute: str = "auto") -> None:
        super().__init__()
        if compute not in EXPERT_COMPUTE:
            raise ValueError(f"GroupedExperts: compute={compute!r}, expected one of "
                             f"{EXPERT_COMPUTE}")
        self.num_experts, self.compute = num_experts, compute
        self.init_std, self.out_init_std = init_std, out_init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if not self.w1.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init from the global RNG, in registration order (w1, w2, w3)."""
        with torch.no_grad():
            self.w1.normal_(0.0, self.init_std)
            self.w2.normal_(0.0, self.out_init_std)
            self.w3.normal_(0.0, self.init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Apply expert ``e`` to its ``counts[e]`` consecutive rows of ``x``.

        Args:
            x: ``(M, dim)`` rows sorted by expert.
            counts: ``(E,)`` int64, summing to ``M``.

        Returns:
            ``(M, dim)`` in the same order.
        """
        return expert_ffn(x, counts, self.w1, self.w2, self.w3, self.compute)

    def extra_repr(self) -> str:
        e, dim, hidden = self.w1.shape
        return f"num_experts={e}, dim={dim}, hidden_dim={hidden}, compute={self.compute!r}"
