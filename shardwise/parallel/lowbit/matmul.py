"""``a @ b.T`` of two scaled low-bit matrices: the device's kernel where it has one, else the
same codes dequantised and multiplied in fp32.

[Note: real and emulated low-bit matmuls] :func:`scaled_matmul` takes codes that
:func:`~shardwise.parallel.lowbit.scaling.quantize` made, so both paths see the same codes and
scales; they differ only in who multiplies. The real path calls
``torch.nn.functional.scaled_mm`` with the recipe's scaling type (tensorwise and rowwise fp8
run on CPUs and on CUDA from sm89; 1x128 / 128x128 blockwise on sm90; MX and NVFP4 on sm100).
Whether a device takes a recipe is probed once, on a tiny problem, and remembered per
``(device, scaling types, dtypes)``: a device that refuses gets the emulated path, which
dequantises both operands to fp32 (``code / q`` per tile, exact in fp32 for 8- and 4-bit
codes) and multiplies in fp32, the accumulation precision the kernels use. The tests check
that both paths give the same numbers where both run.

[Note: CPU low-bit kernels] CPUs take tensorwise and rowwise fp8 in ``torch._scaled_mm``, but
no fp8 arithmetic stands behind it: rowwise dequantises and multiplies in fp32 (bitwise our
emulation), and e4m3 x e4m3 tensorwise runs a reference loop hundreds of times slower than
the fp32 matmul (bench/results/lowbit_numerics.md) with the same numbers up to fp32
accumulation order. So "auto" emulates on CPUs, and the tests run both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.parallel.lowbit.scaling import ScaledTensor, Scaling, dequantize, quantize

__all__ = ["scaled_matmul", "real_kernel_available", "set_kernel_policy", "KERNEL_POLICIES"]

_PROBED: dict[tuple, bool] = {}
KERNEL_POLICIES = ("auto", "real", "emulated")
_POLICY = "auto"


def set_kernel_policy(policy: str) -> str:
    """Which path low-bit matmuls take; returns the previous policy.

    "auto" (default): the device's kernel on accelerators that take the recipe, the
    emulation on CPUs ([Note: CPU low-bit kernels]); "real": the kernel wherever the device
    takes it, CPUs included; "emulated": always the emulation.
    """
    global _POLICY
    if policy not in KERNEL_POLICIES:
        raise ValueError(f"low-bit kernel policy {policy!r}, expected one of {KERNEL_POLICIES}")
    old, _POLICY = _POLICY, policy
    return old


def _kind(st: ScaledTensor) -> str | None:
    """``scaled_mm``'s scaling type for these codes, or None where no kernel exists."""
    s = st.scaling
    if s.fmt == "e2m1":
        return None  # NVFP4 kernels want swizzled e4m3 scales: not wired (emulated)
    if s.granularity == "tensor":
        return "TensorWise"
    if s.granularity == "row":
        return "RowWise"
    if s.scale == "e8m0":
        return "BlockWise1x32" if s.block == (1, 32) else None
    return {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128"}.get(s.block)


def _kernel_scale(st: ScaledTensor, kind: str) -> torch.Tensor:
    """``st``'s decode scales (``1 / q``, as torchao passes them) in ``kind``'s layout; a
    tensorwise operand of a rowwise call repeats its one scale per row (torchao's
    ``preprocess_addmm``: exact, the kernel sees the same number on every row)."""
    inv = st.q.reciprocal()
    if kind == "TensorWise":
        return inv.reshape(())
    if kind == "RowWise":
        return inv.expand(st.shape[0], 1).contiguous()
    if kind == "BlockWise1x32":
        return inv.to(torch.float8_e8m0fnu)
    return inv.contiguous()


def _call(a: ScaledTensor, b: ScaledTensor, ka: str, kb: str, out_dtype) -> torch.Tensor:
    if {ka, kb} <= {"TensorWise", "RowWise"}:
        if ka != kb:  # scaled_mm takes two tensorwise or two rowwise operands, not one each
            ka = kb = "RowWise"
        return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(),
                                scale_a=_kernel_scale(a, ka), scale_b=_kernel_scale(b, kb).t(),
                                out_dtype=out_dtype)
    st = F.ScalingType
    return F.scaled_mm(a.data.contiguous(), b.data.contiguous().t(), _kernel_scale(a, ka),
                       getattr(st, ka), _kernel_scale(b, kb).t(), getattr(st, kb),
                       output_dtype=out_dtype)


# the tiles and scale kind a probe operand of each kernel scaling type gets
_PROBE_TILES = {"TensorWise": ("tensor", (1, 1), "fp32"), "RowWise": ("row", (1, 1), "pow2"),
                "BlockWise1x128": ("block", (1, 128), "fp32"),
                "BlockWise128x128": ("block", (128, 128), "fp32"),
                "BlockWise1x32": ("block", (1, 32), "e8m0")}
_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _probe(device: torch.device, ka: str, kb: str, da, db, out_dtype) -> bool:
    """Whether the device's kernel takes this combination, tried once on 128 x 128 codes."""
    key = (device.type, device.index, ka, kb, da, db, out_dtype)
    if key not in _PROBED:
        ok = True
        try:
            xs = [quantize(torch.randn(128, 128, device=device),
                           Scaling(_FP8_NAMES[dt], *_PROBE_TILES[kind]))[0]
                  for kind, dt in ((ka, da), (kb, db))]
            _call(xs[0], xs[1], ka, kb, out_dtype)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError,
                KeyError):
            ok = False
        _PROBED[key] = ok
    return _PROBED[key]


def real_kernel_available(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype) -> bool:
    """Whether ``scaled_matmul(a, b)`` runs on the device's low-bit kernel."""
    if _POLICY == "emulated" or _POLICY == "auto" and a.data.device.type == "cpu":
        return False
    ka, kb = _kind(a), _kind(b)
    if ka is None or kb is None:
        return False
    m, k = a.shape
    n = b.shape[0]
    if k % 16 or n % 16 or m % 16 and a.data.device.type == "cuda":
        return False
    key = (a.data.device.type, a.data.device.index, ka, kb, a.data.dtype, b.data.dtype,
           out_dtype)
    if torch.compiler.is_compiling():  # no probing inside a trace: what eager found, if any
        return _PROBED.get(key, False)
    return _probe(a.data.device, ka, kb, a.data.dtype, b.data.dtype, out_dtype)


def scaled_matmul(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` as ``out_dtype``: ``a`` is ``(M, K)``, ``b`` ``(N, K)``,
    both quantised along ``K`` ([Note: real and emulated low-bit matmuls])."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_matmul: contraction dims differ, {tuple(a.shape)} @ "
                         f"{tuple(b.shape)}^T")
    if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0:
        return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype, device=a.data.device)
    if real_kernel_available(a, b, out_dtype):
        return _call(a, b, _kind(a), _kind(b), out_dtype)
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)
