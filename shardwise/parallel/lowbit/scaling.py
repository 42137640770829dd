"""Scaled low-bit tensors: how a high-precision matrix becomes low-bit codes plus scales.

Pure tensor functions, no communication and no modules. Every matrix is quantised with its
*contraction dim last*: a ``(R, C)`` operand of ``a @ b.T`` is cut along ``C``, so one set of
scales serves one matmul. A :class:`Scaling` says how the scales are laid out:

* ``tensor``: one scale for the whole matrix;
* ``row``: one scale per row (torchao's "axiswise" along the contraction dim);
* ``block`` ``(br, bc)``: one scale per ``br x bc`` tile, the last tiles partial when the
  shape does not divide (DeepSeek-V3: ``1 x 128`` tiles for activations and gradients,
  ``128 x 128`` blocks for weights; MX: ``1 x 32``; NVFP4: ``1 x 16``).

[Note: low-bit scale arithmetic] The codes are ``sat(x * q)`` where ``q`` is the *quantisation
multiplier* of ``x``'s tile and ``sat`` clamps to the format's largest finite value before the
cast (so nothing finite overflows to inf or nan). For fp8 tiles, ``q = fmax / clamp(amax,
1e-12, 2^127)`` computed in float64 and rounded to fp32, optionally rounded down to a power
of two: torchao's ``amax_to_scale``, so our codes equal torchao's bit for bit wherever amax
is below 2^127. The clamp at 1e-12 keeps an all-zero tile from giving an infinite
multiplier (``0 * inf`` would be nan); the clamp at 2^127 keeps every decoded code finite:
without it a tile near fp32's largest value (3.4e38) rounds its amax element's code up and
decodes it as 2^128 = inf (torchao's arithmetic does), with it values above 2^127 saturate to 2^127
(times at most 1.75 for a power-of-two multiplier, still finite).
MX tiles (OCP MX v1.0): ``q = 2^-(floor(log2(amax)) - emax)`` with ``emax`` the element
format's largest exponent (8 for e4m3), an e8m0 scale; values above ``fmax * 2^e`` saturate.
These are torchao's MX codes (FLOOR mode) bit for bit, except in tiles torchao treats
inconsistently: a tile whose amax is below 2^-118 torchao encodes with 2^-126 but labels
2^-127 (its decode halves such a tile; ours encodes and decodes with 2^-127), and a tile
holding inf torchao saturates to 448 under a 2^120 scale (ours: [Note: non-finite amax]).
NVFP4 tiles are two-level (NVIDIA's recipe): one fp32 tensor multiplier ``g = 448 * 6 /
amax(x)`` and per 16-element tile an e4m3 scale ``s = e4m3(amax_tile / 6 * g)``; elements
are ``e2m1(x * g / s)`` and decode as ``code * s / g``. These equal the codes of torchao's
``nvfp4_quantize`` (with its per-tensor scale) except in tiles whose scale falls below
e4m3's smallest normal, 2^-6: torchao floors such a scale there, ours keeps the subnormal
e4m3 scale and with it finer codes (tests/test_lowbit_torchao.py). Decoding is always
``code * (1 / q)`` with ``1 / q`` rounded to fp32: the decode scale torchao passes to
``torch._scaled_mm``, and what the CPU kernel multiplies by (torchao's emulation divides by
``q`` instead, which can differ by an ulp where ``q`` is not a power of two:
bench/results/lowbit_numerics.md).

[Note: non-finite amax] A tile holding inf or nan has a non-finite amax: its multiplier is
nan and its codes decode to nan, never to a finite number (NVFP4: every tile of the tensor,
through the tensor multiplier). :func:`quantize` returns that fact as a 0-d bool tensor (no
host sync) so the caller can name the layer later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise.parallel.lowbit.codes import (FORMATS, Format, decode, e2m1_round, pack_e2m1,
                                             unpack_e2m1)

__all__ = ["Format", "FORMATS", "Scaling", "ScaledTensor", "quantize", "dequantize",
           "tile_amax", "multipliers", "encode", "e2m1_round", "pack_e2m1", "unpack_e2m1"]

EPS = 1e-12
AMAX_CAP = 2.0 ** 127  # [Note: low-bit scale arithmetic]

SCALE_KINDS = ("fp32", "pow2", "e8m0", "nvfp4")
_SCALE_BYTES = {"fp32": 4, "pow2": 4, "e8m0": 1, "nvfp4": 1}  # per tile, as stored


@dataclass(frozen=True)
class Scaling:
    """How one operand is scaled.

    Attributes:
        fmt: element format name ("e4m3", "e5m2", "e2m1").
        granularity: "tensor", "row" or "block".
        block: ``(rows, cols)`` of a tile, for "block".
        scale: "fp32" (torchao's multiplier), "pow2" (rounded down to a power of two),
            "e8m0" (MX) or "nvfp4" (e4m3 tile scales under an fp32 tensor scale).
    """

    fmt: str
    granularity: str
    block: tuple[int, int] = (1, 1)
    scale: str = "fp32"

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"Scaling.fmt={self.fmt!r}, expected one of {tuple(FORMATS)}")
        if self.granularity not in ("tensor", "row", "block"):
            raise ValueError(f"Scaling.granularity={self.granularity!r}, expected 'tensor', "
                             "'row' or 'block'")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"Scaling.scale={self.scale!r}, expected one of {SCALE_KINDS}")

    def tile(self, rows: int, cols: int) -> tuple[int, int]:
        """The tile shape this scaling uses on a ``(rows, cols)`` matrix."""
        if self.granularity == "tensor":
            return max(rows, 1), max(cols, 1)
        if self.granularity == "row":
            return 1, max(cols, 1)
        return self.block

    @property
    def transpose_invariant(self) -> bool:
        """Whether the codes of ``x.T`` are the transpose of the codes of ``x``."""
        return self.granularity == "tensor" or (self.granularity == "block"
                                                and self.block[0] == self.block[1])


@dataclass
class ScaledTensor:
    """Codes of a ``(R, C)`` matrix and their tile multipliers.

    ``data`` is ``(R, C)`` in the format's dtype (e2m1: the e4m3 values of the codes, one per
    byte, [Note: e2m1 codes held as e4m3]); ``q`` holds fp32 multipliers, ``(ceil(R / br),
    ceil(C / bc))`` (a ``(1, 1)`` tensor for tensorwise); for NVFP4 ``q`` is the tile
    multiplier including the tensor one.
    """

    data: torch.Tensor
    q: torch.Tensor
    scaling: Scaling
    shape: torch.Size

    def t(self) -> ScaledTensor:
        """The transpose, for a transpose-invariant scaling (no requantisation)."""
        if not self.scaling.transpose_invariant:
            raise ValueError(f"{self.scaling} codes cannot be transposed without requantising")
        return ScaledTensor(self.data.t(), self.q.t(), self.scaling,
                            torch.Size([self.shape[1], self.shape[0]]))

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales as stored: e2m1 two codes per byte (a row's last
        byte half used when its length is odd), fp32 scales 4 bytes, e8m0 and NVFP4's e4m3
        tile scales 1 byte (NVFP4: plus its fp32 tensor scale)."""
        r, c = self.shape
        bits = FORMATS[self.scaling.fmt].bits
        codes = r * ((c * bits + 7) // 8)
        scales = self.q.numel() * _SCALE_BYTES[self.scaling.scale]
        return codes + scales + (4 if self.scaling.scale == "nvfp4" else 0)

    def packed(self) -> torch.Tensor:
        """The codes as stored: fp8 codes as they are; e2m1 two per byte, ``(R, ceil(C /
        2))`` uint8, low nibble first ([Note: e2m1 codes held as e4m3])."""
        if self.scaling.fmt == "e2m1":
            return pack_e2m1(self.data)
        return self.data


def _tiles(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``(R, C)`` -> ``(R', br, C', bc)`` view of whole tiles (zero-padded when the shape
    does not divide: a copy)."""
    r, c = x.shape
    pr, pc = -r % br, -c % bc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.view((r + pr) // br, br, (c + pc) // bc, bc)


def _untile(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """Inverse of :func:`_tiles`: the ``(r, c)`` matrix, padding cut off."""
    m = t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return m if m.shape == (r, c) else m[:r, :c].contiguous()


def _tile_amax(tiles: torch.Tensor) -> torch.Tensor:
    """Per-tile absmax of ``(R', br, C', bc)`` tiles -> ``(R', C')``; nan and inf propagate.

    A tile's columns are folded in halves with ``maximum`` first: a reduction along a strided
    dim (the rows of a transposed operand, as the weight-gradient matmul casts them) runs
    about 10x slower than these folds, which read any layout at memory speed.
    """
    a = tiles.abs()
    if a.shape[0] == a.shape[2] == 1:
        return a.amax().reshape(1, 1)
    while a.shape[3] > 1 and a.shape[3] % 2 == 0:
        h = a.shape[3] // 2
        a = torch.maximum(a[..., :h], a[..., h:])
    return a.amax(dim=(1, 3))


def _fp8_multiplier(amax: torch.Tensor, fmax: float, pow2: bool) -> torch.Tensor:
    q = (fmax / amax.double().clamp(EPS, AMAX_CAP)).float()  # [Note: low-bit scale arithmetic]
    if pow2:
        q = torch.exp2(torch.floor(torch.log2(q)))
    return torch.where(torch.isfinite(amax), q, torch.nan)


def _mx_multiplier(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """OCP MX shared scale ``2^(floor(log2 amax) - emax)``, clamped to e8m0's range.

    ``floor(log2 amax)`` is read from amax's fp32 exponent bits, as torchao's FLOOR mode
    does: ``torch.log2`` rounds up to the next integer just below a power of two (2^20 less
    an ulp gave 20), which made the scale twice too large there. A subnormal or zero amax
    reads -127 (the multiplier then saturates at 2^127).
    """
    e = ((amax.contiguous().view(torch.int32) >> 23) & 0xFF) - 127 - fmt.emax
    q = torch.exp2(-e.clamp(-127, 127).float())
    return torch.where(torch.isfinite(amax), q, torch.nan)


def _nvfp4_multiplier(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Per tile ``g / s``: the fp32 tensor multiplier ``g`` lands the tile scales in e4m3's
    range, ``s`` is the tile's e4m3 scale ([Note: low-bit scale arithmetic])."""
    g = _fp8_multiplier(amax.amax().reshape(1, 1), 448.0 * fmt.max, False)
    s = (amax / fmt.max * g).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return torch.where(s > 0, g / s, g)  # per tile: x * q lands in [-6, 6]


def _multiplier(amax: torch.Tensor, scaling: Scaling, fmt: Format) -> torch.Tensor:
    if scaling.scale == "nvfp4":
        return _nvfp4_multiplier(amax, fmt)
    if scaling.scale == "e8m0":
        return _mx_multiplier(amax, fmt)
    return _fp8_multiplier(amax, fmt.max, scaling.scale == "pow2")


def tile_amax(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """Per-tile absmax of a 2-D ``x`` as fp32 ``(R', C')`` (``(1, 1)`` for tensorwise); nan
    and inf propagate."""
    r, c = x.shape
    return _tile_amax(_tiles(x.float(), *scaling.tile(r, c)))


def multipliers(amax: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """The quantisation multipliers ``q`` of tiles with absmax ``amax`` ([Note: low-bit scale
    arithmetic]); nan where ``amax`` is not finite."""
    return _multiplier(amax, scaling, FORMATS[scaling.fmt])


def _encode_tiles(tiles: torch.Tensor, q: torch.Tensor, fmt: Format) -> torch.Tensor:
    y = tiles * q[:, None, :, None]
    if fmt.name == "e2m1":
        # nan (a bad tile: q is nan) -> code 0; the tile still decodes to nan through 1 / q
        return e2m1_round(y.nan_to_num_(0.0)).to(fmt.dtype)
    return y.clamp_(-fmt.max, fmt.max).to(fmt.dtype)  # saturating: finite stays finite


def encode(x: torch.Tensor, q: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """The codes of a 2-D ``x`` under tile multipliers ``q``: ``sat(x * q)`` in the format's
    dtype (e2m1: their e4m3 values, [Note: e2m1 codes held as e4m3]). ``q`` may come from a
    larger matrix ``x`` is a block of rows of (a tensorwise multiplier agreed over ranks):
    the codes are elementwise."""
    r, c = x.shape
    codes = _encode_tiles(_tiles(x.float(), *scaling.tile(r, c)), q, FORMATS[scaling.fmt])
    return _untile(codes, r, c)


def quantize(x: torch.Tensor, scaling: Scaling) -> tuple[ScaledTensor, torch.Tensor]:
    """Quantise a 2-D ``x`` (contraction dim last) as ``scaling`` says: :func:`tile_amax`,
    :func:`multipliers` and :func:`encode`, the tiles cut once.

    Runs without a host sync: no value of ``x`` reaches Python, so a step stays asynchronous
    on an accelerator and traces whole under ``torch.compile``.

    Args:
        x: a ``(R, C)`` floating tensor, any layout (a transposed view is read in place).
        scaling: the tiles, element format and scale kind.

    Returns:
        ``(scaled, bad)``: the codes and multipliers, and a 0-d bool tensor that is true
        when a tile's amax was not finite ([Note: non-finite amax]).

    Raises:
        ValueError: ``x`` is not 2-D.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize needs a 2-D matrix, got shape {tuple(x.shape)}")
    fmt = FORMATS[scaling.fmt]
    r, c = x.shape
    tiles = _tiles(x.float(), *scaling.tile(r, c))  # (R', br, C', bc)
    amax = _tile_amax(tiles)  # (R', C')
    q = _multiplier(amax, scaling, fmt)
    codes = _untile(_encode_tiles(tiles, q, fmt), r, c)
    return ScaledTensor(codes, q, scaling, torch.Size((r, c))), ~torch.isfinite(amax).all()


def dequantize(st: ScaledTensor) -> torch.Tensor:
    """Codes -> fp32 ``(R, C)``: ``code * (1 / q)`` per tile (exactly what the matmul sees)."""
    r, c = st.shape
    inv = st.q.reciprocal()
    if inv.numel() == 1 and st.scaling.granularity == "tensor":
        return decode(st.data, inv)  # the scale folded into the decode table
    br, bc = st.scaling.tile(r, c)
    tiles = _tiles(decode(st.data), br, bc).mul_(inv[:, None, :, None])
    return _untile(tiles, r, c)
