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

[Note: non-finite flags under recompute] Each cast ors its 0-d non-finite flag into the
layer's flag with exactly one op, whatever the flag held before (``logical_or(bad, prev)``,
``prev`` the new flag itself after a clear). Selective activation checkpointing replays a
block's forward in backward and matches its ops one for one with the forward's
(``torch.utils.checkpoint``'s selective mode raises on a mismatch), so a first cast without
an op (the flag was None) and a recompute with one would fail the backward. Forward casts
(and their recompute) and backward casts keep separate flags: the first layer, in module
order, whose *forward* cast saw a non-finite amax is where a nan or inf entered; a gradient
that turned non-finite shows in the backward flags only.
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
    """What a converted layer carries: its recipe, its name, the device flags of a non-finite
    amax seen since the last :meth:`clear_flag` (``bad``: forward casts, ``bad_backward``:
    backward casts), and the weight codes offered by ZeRO-3."""

    def __init__(self, recipe: Recipe, name: str) -> None:
        self.recipe, self.name = recipe, name
        self.bad: torch.Tensor | None = None
        self.bad_backward: torch.Tensor | None = None
        self._offer: tuple[int, ScaledTensor] | None = None

    def note(self, bad: torch.Tensor, backward: bool = False) -> None:
        """Or a 0-d bool into the forward (or ``backward``) non-finite flag (no host sync;
        one op: [Note: non-finite flags under recompute])."""
        if torch.compiler.is_compiling():
            return  # a trace cannot mutate Python state; the loss check still sees the nan
        if backward:
            prev = self.bad_backward
            self.bad_backward = torch.logical_or(bad, bad if prev is None else prev)
        else:
            self.bad = torch.logical_or(bad, bad if self.bad is None else self.bad)

    def clear_flag(self) -> None:
        """Forget the non-finite flags (no host sync)."""
        self.bad = self.bad_backward = None

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

    def weight_codes(self, weight: torch.Tensor, scaling: Scaling,
                     backward: bool = False) -> ScaledTensor:
        """The weight's codes for ``scaling``: the offered ones when they match, else a cast."""
        codes = self.offered(weight) if scaling == self.recipe.weight else None
        if codes is None:
            codes, bad = quantize(weight, scaling)
            self.note(bad, backward)
        return codes


def _cast(state: LowBitState, x: torch.Tensor, scaling: Scaling,
          backward: bool = False) -> ScaledTensor:
    codes, bad = quantize(x, scaling)
    state.note(bad, backward)
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
            gyq = _cast(state, grad, r.grad_output, True)
            if r.weight_gi == r.weight and r.weight.transpose_invariant:
                # the forward's codes, transposed: the same as recasting W^T
                wt = state.weight_codes(weight, r.weight, True).t()
            else:
                wt = _cast(state, weight.t(), r.weight_gi, True)
            gx = scaled_matmul(gyq, wt, grad.dtype)
        if ctx.needs_input_grad[1]:
            if r.grad_gw is None:  # high-precision weight gradient
                gw = (grad.t() @ xd.to(grad.dtype)).to(weight.dtype)
            else:
                if gyq is not None and r.grad_gw == r.grad_output \
                        and r.grad_output.transpose_invariant:
                    gyt = gyq.t()
                else:
                    gyt = _cast(state, grad.t(), r.grad_gw, True)
                if ctx.keep_codes:
                    xt = ScaledTensor(xd, xqs, r.input, ctx.x_shape).t()
                else:
                    xt = _cast(state, xd.t(), r.input_gw, True)
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
