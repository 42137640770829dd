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
cast (so nothing finite overflows to inf or nan). For fp8 tiles, ``q = fmax / max(amax,
1e-12)`` computed in float64 and rounded to fp32, optionally rounded down to a power of two:
exactly torchao's ``amax_to_scale``, so our codes equal torchao's bit for bit. The clamp at
1e-12 keeps an all-zero tile from giving an infinite multiplier (``0 * inf`` would be nan).
MX tiles (OCP MX v1.0): ``q = 2^-(floor(log2(amax)) - emax)`` with ``emax`` the element
format's largest exponent (8 for e4m3), an e8m0 scale; values above ``fmax * 2^e`` saturate.
NVFP4 tiles are two-level (NVIDIA's recipe): one fp32 tensor multiplier ``g = 448 * 6 /
amax(x)`` and per 16-element tile an e4m3 scale ``s = e4m3(amax_tile / 6 * g)``; elements
are ``e2m1(x * g / s)`` and decode as ``code * s / g``. Decoding is always ``code / q``
(``q.reciprocal()`` as torchao passes it to ``torch._scaled_mm``).

[Note: non-finite amax] A tile holding inf or nan has a non-finite amax: its multiplier is 0
or nan and its codes decode to nan, never to a finite number. :func:`quantize` returns that
fact as a 0-d bool tensor (no host sync) so the caller can name the layer later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Format", "FORMATS", "Scaling", "ScaledTensor", "quantize", "dequantize",
           "tile_amax", "multipliers", "encode", "e2m1_round", "pack_e2m1", "unpack_e2m1"]

EPS = 1e-12


@dataclass(frozen=True)
class Format:
    """An element format: its name, storage dtype and largest finite value."""

    name: str
    dtype: torch.dtype
    max: float
    emax: int
    """Exponent of the largest power of two the format holds (MX shared-scale rule)."""
    bits: int


FORMATS = {
    "e4m3": Format("e4m3", torch.float8_e4m3fn, 448.0, 8, 8),
    "e5m2": Format("e5m2", torch.float8_e5m2, 57344.0, 15, 8),
    # e2m1 codes are stored two per byte (torch.float4_e2m1fn_x2's layout, low nibble first).
    "e2m1": Format("e2m1", torch.uint8, 6.0, 2, 4),
}

SCALE_KINDS = ("fp32", "pow2", "e8m0", "nvfp4")


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

    ``data`` is ``(R, C)`` in the format's dtype (e2m1: ``(R, ceil(C / 2))`` packed bytes);
    ``q`` holds fp32 multipliers, ``(ceil(R / br), ceil(C / bc))`` (a ``(1, 1)`` tensor for
    tensorwise); for NVFP4 ``q`` is the tile multiplier including the tensor one.
    """

    data: torch.Tensor
    q: torch.Tensor
    scaling: Scaling
    shape: torch.Size

    def t(self) -> ScaledTensor:
        """The transpose, for a transpose-invariant scaling (no requantisation)."""
        if not self.scaling.transpose_invariant or self.scaling.fmt == "e2m1":
            raise ValueError(f"{self.scaling} codes cannot be transposed without requantising")
        return ScaledTensor(self.data.t(), self.q.t(), self.scaling,
                            torch.Size([self.shape[1], self.shape[0]]))

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return self.data.numel() * self.data.element_size() + self.q.numel() * 4


def _tiles(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``(R, C)`` -> zero-padded ``(R // br, br, C // bc, bc)`` view of whole tiles."""
    r, c = x.shape
    pr, pc = -r % br, -c % bc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.view((r + pr) // br, br, (c + pc) // bc, bc)


def _expand(q: torch.Tensor, br: int, bc: int, r: int, c: int) -> torch.Tensor:
    """Tile multipliers ``(R', C')`` -> per-element ``(r, c)``."""
    if q.shape == (1, 1):
        return q
    return q.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def _amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Per-tile absmax of fp32 ``x``, ``(R', C')``; nan / inf propagate."""
    r, c = x.shape
    if (br, bc) == (r, c):
        return x.abs().amax().reshape(1, 1) if x.numel() else x.new_zeros(1, 1)
    if br == 1 and bc == c:
        return x.abs().amax(dim=1, keepdim=True)
    return _tiles(x.abs(), br, bc).amax(dim=(1, 3))


def _fp8_multiplier(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    q = (fmt.max / amax.double().clamp(min=EPS)).float()  # [Note: low-bit scale arithmetic]
    if pow2:
        q = torch.exp2(torch.floor(torch.log2(q)))
    return torch.where(torch.isfinite(amax), q, torch.nan)


def _mx_multiplier(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """OCP MX shared scale: 2^(floor(log2 amax) - emax), clamped to e8m0's range."""
    e = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - fmt.emax
    q = torch.exp2(-e.clamp(-127, 127))
    return torch.where(torch.isfinite(amax), q, torch.nan)


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to the nearest e2m1 value (ties to even code), saturating at 6."""
    a = x.abs().clamp(max=6.0)
    grid = torch.tensor(_E2M1_GRID, device=x.device)
    mid = (grid[1:] + grid[:-1]) / 2  # (7,)
    idx = torch.bucketize(a, mid)  # a tie lands on the lower code ...
    tie = (idx < 7) & (a == mid[idx.clamp(max=6)])
    idx = idx + (tie & (idx % 2 == 1)).long()  # ... and moves up when that code is odd
    return torch.copysign(grid[idx], x)


def pack_e2m1(v: torch.Tensor) -> torch.Tensor:
    """e2m1 values ``(R, C)`` -> codes packed two per byte ``(R, ceil(C / 2))``."""
    grid = torch.tensor(_E2M1_GRID, device=v.device)
    idx = torch.searchsorted(grid, v.abs().contiguous())
    code = (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)
    if code.shape[1] % 2:
        code = F.pad(code, (0, 1))
    return code[:, 0::2] | (code[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Codes packed two per byte -> fp32 e2m1 values ``(R, cols)``."""
    grid = torch.tensor(_E2M1_GRID, device=packed.device)
    code = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)[:, :cols].long()
    val = grid[code & 7]
    return torch.where(code >= 8, -val, val)


def tile_amax(x: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """Per-tile absmax of a 2-D ``x`` as fp32 ``(R', C')`` (``(1, 1)`` for tensorwise); nan
    and inf propagate."""
    r, c = x.shape
    return _amax(x.float(), *scaling.tile(r, c))


def multipliers(amax: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """The quantisation multipliers ``q`` of tiles with absmax ``amax`` ([Note: low-bit scale
    arithmetic]); nan where ``amax`` is not finite."""
    fmt = FORMATS[scaling.fmt]
    if scaling.scale == "nvfp4":
        g = _fp8_multiplier(amax.amax().reshape(1, 1), Format("", fmt.dtype, 448.0 * 6.0, 0, 0),
                            False)  # tensor multiplier: tile scales land in e4m3's range
        s = _e4m3_round(amax / fmt.max * g)  # e4m3 tile scales, (R', C')
        return torch.where(s > 0, g / s, g)  # per tile: x * q lands in [-6, 6]
    if scaling.scale == "e8m0":
        return _mx_multiplier(amax, fmt)
    return _fp8_multiplier(amax, fmt, scaling.scale == "pow2")


def encode(x: torch.Tensor, q: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """The codes of a 2-D ``x`` under tile multipliers ``q``: ``sat(x * q)`` in the format's
    dtype (e2m1: packed two per byte). ``q`` may come from a larger matrix ``x`` is a block of
    rows of (a tensorwise multiplier agreed over ranks): the codes are elementwise."""
    fmt = FORMATS[scaling.fmt]
    r, c = x.shape
    y = x.float() * _expand(q, *scaling.tile(r, c), r, c)
    if fmt.name == "e2m1":
        return pack_e2m1(e2m1_round(y.nan_to_num(0.0)))
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)  # saturating: finite stays finite


def quantize(x: torch.Tensor, scaling: Scaling) -> tuple[ScaledTensor, torch.Tensor]:
    """Quantise a 2-D ``x`` (contraction dim last) as ``scaling`` says.

    Returns:
        ``(scaled, bad)``: the codes and multipliers, and a 0-d bool tensor that is true
        when a tile's amax was not finite ([Note: non-finite amax]).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize needs a 2-D matrix, got shape {tuple(x.shape)}")
    amax = tile_amax(x, scaling)
    q = multipliers(amax, scaling)
    data = encode(x, q, scaling)
    return ScaledTensor(data, q, scaling, torch.Size(x.shape)), ~torch.isfinite(amax).all()


def dequantize(st: ScaledTensor) -> torch.Tensor:
    """Codes -> fp32 ``(R, C)``: ``code / q`` per tile (exactly what the matmul sees)."""
    r, c = st.shape
    br, bc = st.scaling.tile(r, c)
    if st.scaling.fmt == "e2m1":
        codes = unpack_e2m1(st.data, c)
    else:
        codes = st.data.float()
    return codes * _expand(st.q.reciprocal(), br, bc, r, c)
