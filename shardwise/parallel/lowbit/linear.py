"""The low-bit linear layer: three scaled matmuls in one autograd function.

:func:`module_linear` is what every linear forward of shardwise calls (the plain converted
``nn.Linear``, the tensor-parallel styles, the experts): ``F.linear`` for a layer left in
high precision, :class:`_LowBitLinear` for a converted one.

[Note: what the low-bit linear saves] The forward saves the *high-precision* weight (the
parameter itself: ZeRO-3 frees and regathers it as it does for ``F.linear``) and recasts it in
the backward, as torchao does; the input is saved as its codes when the recipe's forward and
weight-gradient casts of it are the same tensorwise cast (``fp8_tensorwise``: half the bytes of
a bf16 activation), else in high precision. Both go through ``save_for_backward``, so
activation checkpointing discards and recomputes them like any other saved tensor.

[Note: offered weights] When ZeRO-3 gathers a weight already in fp8 ([Note: fp8 weight
gathers] in gather.py), the engine *offers* the gathered codes to the layer
(:meth:`LowBitState.offer`); forward and backward then use them as they are, with no
second cast. An offer names the data pointer of the weight it was made for, so a stale one
(the weight re-gathered or changed since) is never used; and since pooled buffers bring data
pointers back, the engine also withdraws every offer when the unit reshards, discards a
gather or gathers again ([Note: scaled gathers in the engine] in shard/scaled_gather.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.lowbit.matmul import scaled_matmul
from shardwise.parallel.lowbit.recipes import Recipe
from shardwise.parallel.lowbit.scaling import ScaledTensor, Scaling, quantize

__all__ = ["LowBitState", "module_linear", "lowbit_linear", "lowbit_state"]


class LowBitState:
    """What a converted layer carries: its recipe, its name, the device flag of a non-finite
    amax seen since the last :meth:`clear_flag`, and the weight codes offered by ZeRO-3."""

    def __init__(self, recipe: Recipe, name: str) -> None:
        self.recipe, self.name = recipe, name
        self.bad: torch.Tensor | None = None
        self._offer: tuple[int, ScaledTensor] | None = None

    def note(self, bad: torch.Tensor) -> None:
        """Or a 0-d bool into the non-finite flag (no host sync)."""
        if torch.compiler.is_compiling():
            return  # a trace cannot mutate Python state; the loss check still sees the nan
        self.bad = bad if self.bad is None else self.bad | bad

    def clear_flag(self) -> None:
        self.bad = None

    def offer(self, weight: torch.Tensor, codes: ScaledTensor | None) -> None:
        """Offer ``codes`` (quantised with this recipe's weight scaling) for ``weight``'s
        current data; None withdraws the offer ([Note: offered weights])."""
        self._offer = None if codes is None else (weight.data_ptr(), codes)

    def offered(self, weight: torch.Tensor) -> ScaledTensor | None:
        """The codes offered for ``weight``'s current data, if any."""
        if self._offer is not None and self._offer[0] == weight.data_ptr() \
                and not torch.compiler.is_compiling():
            return self._offer[1]
        return None

    def weight_codes(self, weight: torch.Tensor, scaling: Scaling) -> ScaledTensor:
        """The weight's codes for ``scaling``: the offered ones when they match, else a cast."""
        codes = self.offered(weight) if scaling == self.recipe.weight else None
        if codes is None:
            codes, bad = quantize(weight, scaling)
            self.note(bad)
        return codes


def _cast(state: LowBitState, x: torch.Tensor, scaling: Scaling) -> ScaledTensor:
    codes, bad = quantize(x, scaling)
    state.note(bad)
    return codes


class _LowBitLinear(torch.autograd.Function):
    """``x (M, K) @ weight (N, K)^T`` with the recipe's three casts ([Note: what the low-bit
    linear saves])."""

    @staticmethod
    def forward(ctx, x, weight, state: LowBitState):  # noqa: ANN001, ANN205 - autograd
        r = state.recipe
        xq = _cast(state, x, r.input)
        out = scaled_matmul(xq, state.weight_codes(weight, r.weight), x.dtype)
        keep_codes = r.input_gw == r.input and r.input.transpose_invariant \
            and r.input.fmt != "e2m1"
        ctx.state, ctx.keep_codes, ctx.x_shape = state, keep_codes, x.shape
        ctx.x_dtype = x.dtype
        if keep_codes and weight.requires_grad:
            ctx.save_for_backward(xq.data, xq.q, weight)
        elif weight.requires_grad:
            ctx.save_for_backward(x, None, weight)
        else:
            ctx.save_for_backward(None, None, weight)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        state: LowBitState = ctx.state
        r = state.recipe
        xd, xqs, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gyq = None
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gyq = _cast(state, grad, r.grad_output)
            wt = state.weight_codes(weight, r.weight)
            if r.weight_gi == r.weight and r.weight.transpose_invariant:
                wt = wt.t()  # the forward's codes, transposed: the same as recasting W^T
            else:
                wt = _cast(state, weight.t(), r.weight_gi)
            gx = scaled_matmul(gyq, wt, grad.dtype)
        if ctx.needs_input_grad[1]:
            if r.grad_gw is None:  # high-precision weight gradient
                gw = (grad.t() @ xd.to(grad.dtype)).to(weight.dtype)
            else:
                if gyq is not None and r.grad_gw == r.grad_output \
                        and r.grad_output.transpose_invariant:
                    gyt = gyq.t()
                else:
                    gyt = _cast(state, grad.t(), r.grad_gw)
                if ctx.keep_codes:
                    xt = ScaledTensor(xd, xqs, r.input, ctx.x_shape).t()
                else:
                    xt = _cast(state, xd.t(), r.input_gw)
                gw = scaled_matmul(gyt, xt, weight.dtype)
        return gx, gw, None


def lowbit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  state: LowBitState) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``state``'s recipe; ``x`` is ``(..., K)``."""
    n, k = weight.shape
    out = _LowBitLinear.apply(x.reshape(-1, k), weight, state)  # (M, N)
    out = out.view(*x.shape[:-1], n)
    return out if bias is None else out + bias


def lowbit_state(module: nn.Module) -> LowBitState | None:
    """The low-bit state of a converted module (None: high precision)."""
    return getattr(module, "_shardwise_lowbit", None)


def module_linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``module``'s linear map of ``x``: low-bit when ``module`` was converted by
    ``apply_low_precision``, else ``F.linear``."""
    state = lowbit_state(module)
    if state is None:
        return F.linear(x, weight, bias)
    return lowbit_linear(x, weight, bias, state)
