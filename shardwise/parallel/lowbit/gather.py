"""ZeRO-3 weights gathered in fp8 straight into the low-bit matmul: what a converted layer
lends the engine ([Note: scaled gathers in the engine] in shard/scaled_gather.py).

[Note: fp8 weight gathers] With ``fp8_tensorwise`` the weight's codes are one tensor's: one
e4m3 multiplier ``q = 448 / amax(W)`` serves the forward (``W``) and, transposed, the input
gradient (``W^T``), so codes made once can serve both matmuls (rowwise, blockwise and MX
recipes cut ``W`` along different dims for the two, and torchao / torchtitan gather in fp8
only for tensorwise too). With ``--comm.weights fp8`` the engine then gathers these codes
instead of the compute-dtype weight: the ranks agree on ``amax(W)`` with one all-reduce(MAX)
per step for every unit, each rank encodes its rows with that ``q`` (this module: the
arithmetic of :mod:`scaling`, unchanged), one byte per element travels instead of two
(bf16), and the gathered codes are *offered* to the layer ([Note: offered weights] in
linear.py), which uses them as they are in its forward and its backward regather: no second
cast. The codes are elementwise those of the layer's own cast of the gathered compute-dtype
weight, so the run is bitwise the compute-dtype gather's (the drift of torchao#4300 came
from scales that were not the matmul's own). The engine also decodes the codes into the
weight's buffer; recasting that decoded weight (what a reader without the offer does, e.g.
a ``torch.compile`` trace) gives the same codes and multiplier when the compute dtype is
bf16 (300 of 300 random weights), but in fp32 a multiplier one ulp off in one case of five:
there the offer is what keeps the numbers exact, and in bf16 it saves an amax pass and a
cast per use.

Not lent: stacked experts (one scale per expert, one offer per layer) travel with their
unit's other parameters, unquantised in the compute dtype when the call's linears lend codes,
and are cast per expert by the layer. Every other recipe's weights, with ``--comm.weights
fp8``, keep the blockwise-256 fp8 codec of the gather and are cast again by the recipe:
quantised twice, the recipe's codes made from a weight within 2^-4 relative of the master
([Note: error bounds] in quant/codecs.py), not from the weight itself. Kept rather than
refused: it is the flag's behaviour before low-bit compute existed, it still halves a bf16
gather, and the recipes it serves are those whose codes cannot be gathered (their forward and
backward casts differ); ``--comm.weights fp`` gives them the single cast.
"""

from __future__ import annotations

import torch

from shardwise.parallel.lowbit.linear import LowBitState
from shardwise.parallel.lowbit.scaling import (FORMATS, ScaledTensor, dequantize, encode,
                                               multipliers, tile_amax)

__all__ = ["TensorwiseCodes"]


class TensorwiseCodes:
    """A converted linear's weight as the engine's gather codes ([Note: fp8 weight
    gathers]); the engine's ``GatherCodes`` protocol.

    Args:
        state: the layer's low-bit state (its recipe's weight scaling; where offers go).
    """

    attr = "weight"
    kind = "fp8"

    def __init__(self, state: LowBitState) -> None:
        self.state, self.scaling = state, state.recipe.weight
        self.dtype = FORMATS[self.scaling.fmt].dtype

    def amax(self, rows: torch.Tensor) -> torch.Tensor:
        return tile_amax(rows, self.scaling)

    def multiplier(self, amax: torch.Tensor) -> torch.Tensor:
        return multipliers(amax, self.scaling)

    def encode(self, rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return encode(rows, q, self.scaling)

    def _scaled(self, codes: torch.Tensor, q: torch.Tensor) -> ScaledTensor:
        return ScaledTensor(codes.view(self.dtype), q, self.scaling, codes.shape)

    def decode(self, codes: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(dequantize(self._scaled(codes, q)))

    def offer(self, weight: torch.Tensor, codes: torch.Tensor, q: torch.Tensor,
              bad: torch.Tensor) -> None:
        self.state.offer(weight, self._scaled(codes, q))
        self.state.note(bad)  # as the cast the offer replaces would ([Note: non-finite amax])

    def withdraw(self) -> None:
        self.state.offer(None, None)
