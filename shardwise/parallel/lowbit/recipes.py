"""The low-bit training recipes: how each operand of a linear layer's three matmuls is cast.

A linear layer ``y = x W^T`` (``x`` ``(M, K)``, ``W`` ``(N, K)``) runs three matmuls, each
with its own contraction dim, and a recipe gives each operand a :class:`Scaling` along it:

===============  ======================  ======================  =====================
matmul           left operand            right operand           contraction
===============  ======================  ======================  =====================
forward          ``x``        (input)    ``W``       (weight)    K (in features)
grad input       ``dy``  (grad_output)   ``W^T``  (weight_gi)    N (out features)
grad weight      ``dy^T``   (grad_gw)    ``x^T``   (input_gw)    M (tokens)
===============  ======================  ======================  =====================

Recipes (the sources they follow):

* ``fp8_tensorwise``: one scale per tensor, e4m3 activations and weights, e5m2 gradients
  (torchao's default ``Float8LinearConfig``; torchtitan's fp8 runs). The only recipe whose
  weight codes are the same for the forward and the backward, hence the one ZeRO-3 gathers
  in fp8 ([Note: fp8 weight gathers] in ``gather.py``).
* ``fp8_rowwise``: e4m3 everywhere, one power-of-two scale per row along each contraction
  dim (torchao's "rowwise" recipe).
* ``fp8_rowwise_gw_hp``: torchao's "rowwise_with_gw_hp": as rowwise, but the weight in the
  input-gradient matmul takes one power-of-two scale for the whole tensor (as torchao's does;
  the kernel repeats it per row), and the weight-gradient matmul runs in high precision: the
  most precise fp8 recipe.
* ``fp8_blockwise``: DeepSeek-V3's: e4m3, ``1 x 128`` tiles for activations and gradients,
  ``128 x 128`` blocks for weights, fp32 scales, fp32 accumulation.
* ``mxfp8``: OCP MX: e4m3 elements, one e8m0 (power-of-two) scale per 32 elements along the
  contraction dim, in all three matmuls.
* ``nvfp4``: NVIDIA's NVFP4: e2m1 elements, an e4m3 scale per 16 elements and an fp32 scale
  per tensor, in all three matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.lowbit.scaling import Scaling

__all__ = ["Recipe", "RECIPES", "RECIPE_NAMES", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    """One recipe: a :class:`Scaling` per operand role, and the shapes it accepts.

    Attributes:
        name: the recipe's name (a key of :data:`RECIPES`).
        input, weight: the forward's operands.
        grad_output, weight_gi: the input-gradient matmul's operands.
        grad_gw, input_gw: the weight-gradient matmul's operands; None: that matmul runs in
            high precision.
        multiple: in and out features must be multiples of this (the kernels' tile), else
            the layer is skipped and listed.
        element_bits: bits per element of the codes (8 or 4).
        kernel: the ``torch.nn.functional.scaled_mm`` scaling the real kernel uses.
    """

    name: str
    input: Scaling
    weight: Scaling
    grad_output: Scaling
    weight_gi: Scaling
    grad_gw: Scaling | None
    input_gw: Scaling | None
    multiple: int
    element_bits: int
    kernel: str

    @property
    def gathers_weight_codes(self) -> bool:
        """Whether one 8-bit tensorwise cast of the weight serves the forward and the input
        gradient, so ZeRO gathers can carry those codes ([Note: fp8 weight gathers] in
        gather.py): ``fp8_tensorwise``."""
        w = self.weight
        return w.granularity == "tensor" and self.weight_gi == w and w.fmt in ("e4m3", "e5m2")

    def shape_problem(self, in_features: int, out_features: int) -> str | None:
        """Why a ``(out_features, in_features)`` weight cannot take this recipe (None: it
        can)."""
        m = self.multiple
        bad = [f"{what} {v}" for what, v in (("in_features", in_features),
                                             ("out_features", out_features)) if v % m]
        if bad:
            return f"{self.name} needs features divisible by {m}: " + ", ".join(bad)
        return None


def _s(fmt: str, gran: str, block: tuple[int, int] = (1, 1), scale: str = "fp32") -> Scaling:
    return Scaling(fmt, gran, block, scale)


_TW, _TW_GRAD = _s("e4m3", "tensor"), _s("e5m2", "tensor")
_ROW = _s("e4m3", "row", scale="pow2")
_TW_POW2 = _s("e4m3", "tensor", scale="pow2")
_TILE, _BLOCK = _s("e4m3", "block", (1, 128)), _s("e4m3", "block", (128, 128))
_MX = _s("e4m3", "block", (1, 32), "e8m0")
_NV = _s("e2m1", "block", (1, 16), "nvfp4")

RECIPES: dict[str, Recipe] = {
    "fp8_tensorwise": Recipe("fp8_tensorwise", _TW, _TW, _TW_GRAD, _TW, _TW_GRAD, _TW,
                             16, 8, "TensorWise"),
    "fp8_rowwise": Recipe("fp8_rowwise", _ROW, _ROW, _ROW, _ROW, _ROW, _ROW, 16, 8,
                          "RowWise"),
    "fp8_rowwise_gw_hp": Recipe("fp8_rowwise_gw_hp", _ROW, _ROW, _ROW, _TW_POW2, None, None,
                                16, 8, "RowWise"),
    "fp8_blockwise": Recipe("fp8_blockwise", _TILE, _BLOCK, _TILE, _BLOCK, _TILE, _TILE, 128,
                            8, "BlockWise1x128"),
    "mxfp8": Recipe("mxfp8", _MX, _MX, _MX, _MX, _MX, _MX, 32, 8, "BlockWise1x32"),
    "nvfp4": Recipe("nvfp4", _NV, _NV, _NV, _NV, _NV, _NV, 16, 4, "BlockWise1x16"),
}
RECIPE_NAMES = tuple(RECIPES)


def get_recipe(name: object) -> Recipe:
    """The recipe called ``name``; ``ValueError`` naming the choices otherwise."""
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"low-precision recipe {name!r} is not one of {RECIPE_NAMES}")
    return RECIPES[name]
