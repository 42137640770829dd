"""How a device prices a low-bit recipe: the converted multiplies at the rate of the recipe's
dtype where the device runs its kernel (else emulated), the casts at the memory bandwidth.

    path = recipe_path(get_hardware("a100"), "fp8_tensorwise")   # emulated, and why
    rs = recipe_seconds(hw, wl, w)       # w: a LayerWork whose ``lowbit`` is set
    rs.fwd, rs.bwd, rs.wgrad             # what the recipe adds to the layer's passes

[Note: pricing a low-bit recipe] The workload's ``matmul_recipe`` converts the blocks'
linears (recipe_work.py, [Note: the linears a recipe converts]); the embedding, head,
norms, routers and attention core keep the compute dtype. Per layer and micro-batch:

* the converted multiplies (forward, input gradient, weight gradient; fp8_rowwise_gw_hp
  keeps the weight gradient's in the compute dtype) run at the peak of the recipe's element
  dtype (``fp8`` for the fp8 recipes and MXFP8, ``fp4`` for NVFP4) on the hardware's
  efficiency curve, where the device lists the recipe's ``scaled_mm`` kernel
  (data/hardware.toml: Hopper's fp8 tensorwise, rowwise and blockwise; Blackwell's MXFP8 and
  NVFP4 besides) and shardwise calls it. Elsewhere the recipe is *emulated*, as
  ``scaled_matmul`` runs it there: the codes are dequantised to fp32 and multiplied at the
  device's fp32 rate ([Note: emulated low-bit multiplies] in recipe_work.py), never faster
  than the compute dtype. The efficiency curve is the family's, fitted on bf16 runs: a large
  multiply reaches ``matmul_max`` of the recipe's peak as of bf16's, and each kernel pays
  the same fixed seconds at either rate (the half-size ``matmul_half``, ``peak x 4 us``,
  scaled by the peaks' ratio), so a small multiply gains less than the peaks' ratio;
* the casts and their amax passes ([Note: low-bit casts]) at the memory bandwidth, forward
  and backward; selective checkpointing replays the forward's with the other
  bandwidth-bound operators, and torchtitan's op policy (``alternate_mm``) replays every
  second multiply at the recipe's rate;
* with fp8_tensorwise and ``comm_weights=fp8`` at ZeRO stage 3, the weights arrive as fp8
  codes, so the layer casts none (dp_cost.py prices the gather: a byte an element of the
  converted weights, the agreed scales' all-reduce once a step);
* fp8_tensorwise's saved codes change the activations (``saved_delta``).

NVFP4 is emulated even where the device has the kernel: shardwise's ``scaled_matmul`` does
not call it yet (``UNWIRED``); the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.lowbit.recipes import get_recipe

__all__ = ["RecipePath", "RecipeSeconds", "UNWIRED", "recipe_path", "recipe_seconds",
           "multiply_seconds"]

UNWIRED = {"BlockWise1x16": "shardwise's scaled_matmul does not call the NVFP4 kernel yet "
                            "(parallel/lowbit/matmul.py)"}
"""Kernels a device may have that shardwise's low-bit matmul does not call (their recipes
run emulated): what is planned is what runs."""


@dataclass(frozen=True)
class RecipePath:
    """How a device runs a recipe's converted multiplies.

    Attributes:
        name: the recipe; native: on the device's scaled-multiply kernel; dtype: the peak
        they run at ("fp8", "fp4"; "fp32" emulated); words: the reason, for the plan.
    """

    name: str
    native: bool
    dtype: str
    words: str


def recipe_path(hw, recipe) -> RecipePath:
    """Native or emulated, at which peak, and why ([Note: pricing a low-bit recipe]).

    Raises:
        ValueError: an unknown recipe.
    """
    r = get_recipe(recipe)
    dtype = "fp8" if r.element_bits == 8 else "fp4"
    if r.kernel not in hw.scaled_mm:
        why = (f"{hw.name} has no {r.kernel} {dtype} kernel" if hw.scaled_mm
               else f"{hw.name} has no low-bit kernels")
    elif r.kernel in UNWIRED:
        why = UNWIRED[r.kernel]
    elif dtype not in hw.peak_flops:
        why = f"{hw.name} lists no {dtype} peak"
    else:
        rate = hw.peak(dtype) / hw.peak("bf16") if "bf16" in hw.peak_flops else 0.0
        return RecipePath(r.name, True, dtype, f"native: {r.kernel} {dtype} kernels at "
                          f"{hw.peak(dtype) / 1e12:,.0f} TFLOP/s dense ({rate:.1f}x bf16)")
    return RecipePath(r.name, False, "fp32", f"emulated ({why}): codes dequantised to fp32 "
                      f"and multiplied at {hw.peak('fp32') / 1e12:,.1f} TFLOP/s fp32")


@dataclass(frozen=True)
class RecipeSeconds:
    """One layer's converted multiplies and casts for one micro-batch (seconds): ``mm`` at
    the recipe's rate and ``hp`` what the same multiplies take in the compute dtype, each
    (forward, input gradient, weight gradient); ``cast_fwd`` / ``cast_bwd`` the casts and
    amax passes (and the emulation's dequantisations)."""

    mm: tuple[float, float, float]
    hp: tuple[float, float, float]
    cast_fwd: float
    cast_bwd: float

    @property
    def fwd(self) -> float:
        """Seconds the recipe adds to the forward (negative: it saves them)."""
        return self.mm[0] - self.hp[0] + self.cast_fwd

    @property
    def bwd(self) -> float:
        """Seconds the recipe adds to the backward (both gradients)."""
        return self.mm[1] - self.hp[1] + self.mm[2] - self.hp[2] + self.cast_bwd

    @property
    def wgrad(self) -> float:
        """Seconds the recipe adds to the weight-gradient multiplies."""
        return self.mm[2] - self.hp[2]


def _rates(hw, wl, path: RecipePath):
    # A kernel's fixed cost (the half-size, peak x 4 us) is seconds, the same at any rate.
    fixed = hw.replace(matmul_half=hw.matmul_half * hw.peak(path.dtype)
                       / hw.peak(wl.compute_dtype))

    def low(f: float) -> float:
        return fixed.matmul_time(f, path.dtype)

    def high(f: float) -> float:
        return hw.matmul_time(f, wl.compute_dtype)
    return low, high


def recipe_seconds(hw, wl, w) -> RecipeSeconds:
    """What ``w.lowbit`` (a ``recipe_work.RecipeWork``) costs on ``hw`` for layer work ``w``
    under workload ``wl`` ([Note: pricing a low-bit recipe])."""
    rw = w.lowbit
    path = recipe_path(hw, rw.recipe)
    low, high = _rates(hw, wl, path)
    assert len(w.gemm_roles) == len(w.gemms), "layer work without multiply roles"
    mm = hp = 0.0
    for (f, n), role in zip(w.gemms, w.gemm_roles, strict=True):
        s = rw.share.get(role, 0.0)
        if s:
            mm += n * s * low(f)
            hp += n * s * high(f)
    gw = hp if rw.recipe.grad_gw is None else mm
    cast_f, cast_b = hw.memory_time(rw.cast_fwd), hw.memory_time(rw.cast_bwd)
    if not path.native:
        cast_f += hw.memory_time(rw.dequant[0])
        cast_b += hw.memory_time(rw.dequant[1] + rw.dequant[2])  # gw_hp's: none
    return RecipeSeconds((mm, mm, gw), (hp, hp, hp), cast_f, cast_b)


def multiply_seconds(hw, wl, w, flops: float) -> float:
    """Seconds of one replayed block-linear multiply of ``flops`` FLOPs in layer ``w``: at
    the recipe's rate for the share of the layer's linears it converts, the compute dtype's
    for the rest (without a recipe, the compute dtype's)."""
    if w.lowbit is None:
        return hw.matmul_time(flops, wl.compute_dtype)
    low, high = _rates(hw, wl, recipe_path(hw, w.lowbit.recipe))
    s = w.lowbit.converted_share
    return s * low(flops) + (1 - s) * high(flops)
