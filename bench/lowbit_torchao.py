"""shardwise's low-bit recipes beside torchao's on the same inputs (torchao 0.18, the
``lowbit`` extra; shardwise itself never imports it).

    python -m bench.lowbit_numerics            # the table's torchao section comes from here

What is compared, and how (tests/test_lowbit_torchao.py asserts the same):

* ``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp`` against
  ``convert_to_float8_training`` of an ``nn.Linear`` with ``Float8LinearConfig()`` /
  ``from_recipe_name("rowwise")`` / ``("rowwise_with_gw_hp")``, torchao emulated
  (``emulate=True``: ``torch.mm`` of ``code / scale``) and real (``torch._scaled_mm``, which
  runs on this CPU), each against our kernel policy "emulated" and "real": output, input
  gradient and weight gradient, bitwise or as a multiple of the bound below.
  torchao's real rowwise path on an fp32 model rounds each matmul's result to bf16 (its
  workaround for ``torch._scaled_mm``'s rowwise fp32 output, in ``addmm_float8_unwrapped``),
  so there the bound adds ``2^-8 |out|`` (one bf16 rounding, unit roundoff 2^-8).
* ``mxfp8`` against torchao's MX training autograd function (``moe_training.mxfp8_linear.
  mx_mm``: e4m3, 32-element blocks, FLOOR scales, emulated kernel, torch casts).
* ``nvfp4``: torchao's NVFP4 *training* (``moe_training.nvfp4_training``) is another recipe
  (random Hadamard transforms, stochastic rounding, 16 x 16 weight blocks) and needs
  Triton; its quantiser ``nvfp4_quantize`` runs here, and its codes are compared with ours.
* ``fp8_blockwise``: not comparable here (:data:`BLOCKWISE_WHY`).

[Note: accumulation bound] Two fp32 matmuls of the same decoded operands ``A`` (M, K) and
``B`` (N, K) summed in different orders differ by at most ``2 gamma_K (|A| @ |B|^T)``
(``gamma_K = K u / (1 - K u)``, ``u = 2^-24``; each is within ``gamma_K`` of the exact sum);
a kernel that scales the fp32 sum of code products afterwards adds ``2u`` per product of
scales, and torchao's emulation decoding by ``code / q`` where ours multiplies by ``fl(1 /
q)`` moves each operand by at most ``3u`` relative. So every fp32-accumulated comparison
here is held to ``(2 K + 8) u (|A| @ |B|^T)``, with ``A``, ``B`` our decoded operands; the
measured differences are reported as a fraction of it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shardwise.parallel.lowbit import (LowBitState, dequantize, get_recipe, lowbit_linear,
                                       quantize, set_kernel_policy)

__all__ = ["TORCHAO_FP8", "BLOCKWISE_WHY", "ours", "torchao_fp8", "torchao_mx",
           "torchao_nvfp4_codes", "accumulation_bound", "decoded_operands", "compare",
           "fp8_comparison", "mx_comparison", "nvfp4_comparison"]

U = 2.0 ** -24
TORCHAO_FP8 = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise",
               "fp8_rowwise_gw_hp": "rowwise_with_gw_hp"}
BLOCKWISE_WHY = (
    "torchao 0.18's blockwise fp8 training (prototype.blockwise_fp8_training) cannot run on "
    "this machine: its kernels module imports Triton at import time (not installed; Triton "
    "has no CPU backend), Float8BlockwiseLinear asserts an sm90 GPU in its constructor and "
    "takes only bf16, and its non-Triton path calls F.scaled_mm with BlockWise1x128 / "
    "BlockWise128x128 scales, which the CPU refuses. Its tiles are ours (1 x 128 activations "
    "and gradients, 128 x 128 weights, the weight gradient's operands tiled along the "
    "tokens), so the comparison is one GPU run away.")


def ours(recipe: str, x, w, dy, policy: str) -> tuple[torch.Tensor, ...]:
    """Output, input gradient, weight gradient of ``lowbit_linear`` under ``policy``."""
    old = set_kernel_policy(policy)
    try:
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = lowbit_linear(xx, ww, None, LowBitState(get_recipe(recipe), "cmp"))
        y.backward(dy)
    finally:
        set_kernel_policy(old)
    return y.detach(), xx.grad, ww.grad


def torchao_fp8(recipe: str, x, w, dy, emulate: bool) -> tuple[torch.Tensor, ...]:
    """The same through torchao's ``Float8Linear`` (``TORCHAO_FP8[recipe]``)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    name = TORCHAO_FP8[recipe]
    cfg = (Float8LinearConfig() if name == "tensorwise"
           else Float8LinearConfig.from_recipe_name(name))
    cfg = dataclasses.replace(cfg, emulate=emulate)
    net = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        net[0].weight.copy_(w)
    convert_to_float8_training(net, config=cfg)
    xx = x.clone().requires_grad_()
    y = net(xx)
    y.backward(dy)
    return y.detach(), xx.grad, net[0].weight.grad


def torchao_mx(x, w, dy) -> tuple[torch.Tensor, ...]:
    """torchao's MXFP8 linear (emulated kernel, torch casts, FLOOR scales)."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice,
                                                     MXFP8Dim1CastKernelChoice,
                                                     ScaleCalculationMode)
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    e4m3 = torch.float8_e4m3fn
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mx_mm.apply(xx, ww, e4m3, e4m3, e4m3, 32, KernelPreference.EMULATED,
                    MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                    ScaleCalculationMode.FLOOR, False)
    y.backward(dy)
    return y.detach(), xx.grad, ww.grad


def torchao_nvfp4_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's two-level NVFP4 codes of ``x`` as fp32 e2m1 values, and a per-element mask
    of the tiles whose e4m3 scale torchao floored at e4m3's smallest normal (2^-6)."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import (nvfp4_quantize,
                                                           per_tensor_amax_to_scale)

    pts = per_tensor_amax_to_scale(x.abs().amax())
    _, packed = nvfp4_quantize(x.contiguous(), 16, pts)
    codes = f4_unpacked_to_f32(unpack_uint4(packed)).view(x.shape)
    tile = x.abs().view(x.shape[0], -1, 16).amax(-1) / 6.0 / pts
    floored = (tile < torch.finfo(torch.float8_e4m3fn).tiny).repeat_interleave(16, 1)
    return codes, floored


def decoded_operands(recipe: str, x, w, dy) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our decoded ``(A, B)`` of each of the three matmuls (``A @ B^T``)."""
    r = get_recipe(recipe)

    def dq(t, s):
        return dequantize(quantize(t, s)[0])

    ops = {"output": (dq(x, r.input), dq(w, r.weight)),
           "grad_input": (dq(dy, r.grad_output), dq(w.t(), r.weight_gi))}
    ops["grad_weight"] = ((dy.t(), x.t()) if r.grad_gw is None
                          else (dq(dy.t(), r.grad_gw), dq(x.t(), r.input_gw)))
    return ops


def accumulation_bound(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """``(2 K + 8) u (|A| @ |B|^T)`` ([Note: accumulation bound]); with ``out`` (ours), the
    bound for a result rounded to bf16 once: ``2^-8 |out| + (1 + 2^-7)`` times that."""
    acc = (2 * a.shape[1] + 8) * U * (a.double().abs() @ b.double().abs().t())
    if out is None:
        return acc
    return 2.0 ** -8 * out.double().abs() + (1 + 2.0 ** -7) * acc


def compare(got, want, operands, bf16_output: bool = False) -> dict[str, str | float]:
    """Per quantity: "bitwise", or the largest ``|got - want|`` as a fraction of the
    accumulation bound (key ``<q>_of_bound``; ``bf16_output``: the bound of a ``want``
    rounded to bf16, as torchao's real rowwise path rounds an fp32 model's results) and
    relative to ``max |want|``."""
    out = {}
    for q, g, h in zip(("output", "grad_input", "grad_weight"), got, want):
        if torch.equal(g, h):
            out[q] = "bitwise"
            continue
        diff = (g.double() - h.double()).abs()
        bound = accumulation_bound(*operands[q], g if bf16_output else None)
        out[q] = f"{(diff.max() / h.abs().max()).item():.1e} rel"
        out[f"{q}_of_bound"] = (diff / bound).max().item()
        out["bound"] = "bf16 rounding" if bf16_output else "fp32 accumulation"
    return out


def fp8_comparison(x, w, dy) -> dict:
    """``{recipe: {"torchao emulated|real vs ours emulated|real": compare(...)}}``."""
    res = {}
    for recipe in TORCHAO_FP8:
        ops = decoded_operands(recipe, x, w, dy)
        res[recipe] = {}
        for emulate in (True, False):
            theirs = torchao_fp8(recipe, x, w, dy, emulate)
            for policy in ("emulated", "real"):
                key = f"torchao {'emulated' if emulate else 'real'} vs ours {policy}"
                bf16 = not emulate and recipe != "fp8_tensorwise"
                res[recipe][key] = compare(ours(recipe, x, w, dy, policy), theirs, ops, bf16)
    return res


def mx_comparison(x, w, dy) -> dict:
    """mxfp8 (ours, emulated) against torchao's MX linear."""
    return compare(ours("mxfp8", x, w, dy, "emulated"), torchao_mx(x, w, dy),
                   decoded_operands("mxfp8", x, w, dy))


def nvfp4_comparison(x) -> dict:
    """Codes of ``x``: how many differ from torchao's, and whether all of those lie in tiles
    whose scale torchao floored at 2^-6."""
    theirs, floored = torchao_nvfp4_codes(x)
    mine = quantize(x, get_recipe("nvfp4").input)[0].data.float()
    differ = mine != theirs
    return {"elements": x.numel(), "codes_differ": int(differ.sum()),
            "floored_elements": int(floored.sum()),
            "all_differences_in_floored_tiles": bool((differ & ~floored).sum() == 0)}
