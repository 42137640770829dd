"""Element formats of the low-bit codes: e4m3 / e5m2 (fp8) and e2m1 (fp4), their rounding,
4-bit packing and a fast decode to fp32.

Pure elementwise tensor functions, no scales (``scaling.py`` applies those).

[Note: e2m1 codes held as e4m3] e2m1 has the eight magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``,
every one of them an exact e4m3 value. So a :class:`ScaledTensor` of e2m1 codes holds them
one per byte *as e4m3 values*: the emulated matmul decodes them exactly as it decodes fp8
codes, and nothing packs or unpacks nibbles on the compute path. The 4-bit storage is what
``ScaledTensor.nbytes`` counts and what ``ScaledTensor.packed()`` returns (two codes per
byte, low nibble first: ``torch.float4_e2m1fn_x2``'s layout), the form a wire or a 4-bit
kernel takes.

[Note: closed-form e2m1 rounding] On ``[0, 6]`` the e2m1 grid is evenly spaced within each
binade: step 0.5 below 2 (the subnormal 0.5 and the binade ``[1, 2)``), 1 on ``[2, 4)``, 2 on
``[4, 6]``. The step is ``2^(clamp(floor(log2|x|), 0, 2) - 1)``, read exactly from the fp32
exponent bits (a ``log2`` rounds up just below a power of two), and ``round(x / step) *
step`` is exact (a power-of-two step) and rounds half to even, which on this grid is the
even code (the code's last bit is the mantissa bit). Values above 6 saturate to 6; the sign
survives, ``-0`` included.

[Note: fp8 decode by table] ATen converts fp8 to fp32 one element at a time on CPUs (about
6x a table lookup here), and the emulated matmul decodes every operand, so :func:`decode`
reads the 256-entry table of a format's values instead: the same fp32 numbers, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Format", "FORMATS", "e2m1_round", "pack_e2m1", "unpack_e2m1", "decode"]


@dataclass(frozen=True)
class Format:
    """An element format.

    Attributes:
        name: "e4m3", "e5m2" or "e2m1".
        dtype: the dtype of the codes a ``ScaledTensor`` holds (e2m1: e4m3 values, [Note:
            e2m1 codes held as e4m3]).
        max: the largest finite value.
        emax: exponent of the largest power of two the format holds (MX shared-scale rule).
        bits: bits of storage per element.
    """

    name: str
    dtype: torch.dtype
    max: float
    emax: int
    bits: int


FORMATS = {
    "e4m3": Format("e4m3", torch.float8_e4m3fn, 448.0, 8, 8),
    "e5m2": Format("e5m2", torch.float8_e5m2, 57344.0, 15, 8),
    "e2m1": Format("e2m1", torch.float8_e4m3fn, 6.0, 2, 4),
}

_EXP_BITS = 0x7F800000  # fp32 exponent field


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to the nearest e2m1 value, ties to the even code, saturating at 6
    ([Note: closed-form e2m1 rounding]).

    Args:
        x: fp32 values; nan stays nan (``quantize`` replaces nan before rounding).

    Returns:
        fp32 e2m1 values, the signs (and ``-0``) of ``x``.
    """
    xc = x.float().clamp(-6.0, 6.0)
    # 2^clamp(floor(log2|x|), 0, 2) from the exponent bits, halved: the step of x's binade
    step = (xc.view(torch.int32) & _EXP_BITS).clamp_(127 << 23, 129 << 23).view(torch.float32)
    step.mul_(0.5)
    return torch.round(xc / step).mul_(step)


def _e2m1_code_table(device: torch.device) -> torch.Tensor:
    """e4m3 byte -> e2m1 nibble (sign << 3 | magnitude index), for the 16 e2m1 values."""
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    table = torch.zeros(256, dtype=torch.uint8)
    idx = torch.arange(8, dtype=torch.uint8)
    table[grid.to(torch.float8_e4m3fn).view(torch.uint8).long()] = idx
    table[(-grid).to(torch.float8_e4m3fn).view(torch.uint8).long()] = idx | 8
    return table.to(device)


def pack_e2m1(v: torch.Tensor) -> torch.Tensor:
    """e2m1 values ``(R, C)`` (any float dtype holding them exactly) -> codes packed two per
    byte, ``(R, ceil(C / 2))`` uint8, low nibble first (``torch.float4_e2m1fn_x2``'s layout)."""
    byte = v.to(torch.float8_e4m3fn).view(torch.uint8)
    code = _e2m1_code_table(v.device)[byte.long()]
    if code.shape[1] % 2:
        code = F.pad(code, (0, 1))
    return code[:, 0::2] | (code[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Codes packed two per byte -> fp32 e2m1 values ``(R, cols)``."""
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=packed.device)
    values = torch.cat((grid, -grid))
    code = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)[:, :cols]
    return values[code.long()]


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def decode(codes: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 codes -> fp32 values (times ``scale``, a 0-d or one-element tensor, when given),
    bit for bit ``codes.float() * scale`` ([Note: fp8 decode by table]).

    Args:
        codes: a float8 tensor of any shape and layout.
        scale: multiplies every value; folded into the table (256 products, the same
            rounding as multiplying each element).
    """
    table = _table(codes.dtype, codes.device)
    if scale is not None:
        table = table * scale.reshape(())
    if codes.dim() == 2 and not codes.is_contiguous() and codes.t().is_contiguous():
        return decode(codes.t(), scale).t()  # a transposed view: decode in memory order
    byte = codes.contiguous().view(torch.uint8)
    return table.index_select(0, byte.reshape(-1).int()).view(codes.shape)
