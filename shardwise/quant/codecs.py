"""Blockwise int8 / int4 / fp8 codecs for communication (ZeRO++-style quantized collectives).

Pure tensor functions, no communication. :func:`quantize` / :func:`dequantize` turn a float
tensor into per-block codes plus fp32 scales and back; :func:`pack` / :func:`unpack` lay both
out in one flat uint8 buffer whose size :func:`packed_nbytes` computes from the element count
alone, so one collective moves a whole quantized piece. :class:`CommQuant` is the engine's
policy (what to quantize, ``shardwise.shard.comm_quant``); the collectives live in
``shardwise.distributed.comm.quantized``.

A tensor is quantized row by row along its last dim (a 1-D tensor is one row; a 0-d tensor a
row of one): each row is cut into blocks of ``block_size`` elements, the last one partial when
``block_size`` does not divide the row, and every block gets one fp32 scale. Rows never share
a block, so the ``n`` chunks of a rank-major ``(n, m)`` buffer are quantized independently.

[Note: codecs] Let ``a`` be a block's absmax and ``qmax`` 127 (int8), 7 (int4) or 448 (the
largest finite e4m3 value). The block's scale is ``s = max(RZ16(a / qmax), floor)`` (``s = 0``
when ``a == 0``), where RZ16 rounds toward zero to 16 significant bits and ``floor`` is 2^-126
(int8, int4) or 2^-117 (fp8). Codes round to nearest, ties to even:

* int8: ``q = clamp(round(x / s), -127, 127)`` stored as int8 (symmetric: -128 is unused);
* int4: ``q = clamp(round(x / s), -7, 7)`` stored as ``q + 8`` in a nibble, two per byte,
  the even element in the low nibble;
* fp8: ``q = e4m3(clamp(x / s, -448, 448))`` (torch.float8_e4m3fn), stored as its uint8 bits.

An element decodes as ``q * s``. A block's absmax maps to ``qmax`` (448 for fp8) up to the
relative 2^-15 the truncation of ``s`` costs, so a constant block decodes to within 2^-15 of
its value (exactly when ``a / qmax`` has at most 16 significant bits).

[Note: exact codec arithmetic] The bounds below hold for the fp32 results themselves, with no
"up to rounding" slack, for two reasons. (1) ``x / s`` is divided in fp32, yet rounding it to
a code gives the code of the real quotient: ``tie * s`` (a tie being a half-integer or an e4m3
midpoint) lies on a coarser grid than ``x``, so ``x - tie * s`` is 0 or at least ``ulp(x)``,
which puts a real quotient that is not a tie more than half an fp32 ulp away from it; the
correctly rounded division can neither reach nor cross the tie. (2) ``q * s`` is exact in fp32:
``q`` has at most 7 significant bits (4 for fp8), ``s`` at most 16, and the floor keeps every
nonzero product at or above 2^-126, out of fp32's subnormal range. Dequantizing into fp32
therefore returns exactly ``q * s``; into bf16 / fp16 it adds that dtype's rounding of it.

[Note: error bounds] For an element ``x`` (its fp32 value: bf16 / fp16 are exact in fp32,
float64 is rounded to fp32 first) of a finite block with absmax ``a``, and
``d = dequantize(quantize(x))`` in fp32:

* int8: ``|x - d| <= max(a / 254, 2^-127)``  (half a step of a / 127)
* int4: ``|x - d| <= max(a / 14, 2^-127)``   (half a step of a / 7)
* fp8:  ``|x - d| <= max(2^-4 * |x|, 2^-10 * max(a / 448, 2^-117))``

Derivation, int: when ``|x / s| <= qmax + 1/2`` the code is the nearest integer, so the error
is at most ``s / 2 <= max(a / qmax, floor) / 2``. Otherwise ``x`` was clamped, which needs
``s < a / qmax``, i.e. ``s`` is the truncated quotient, ``s >= (1 - 2^-15) a / qmax``, and the
error ``|x| - qmax * s <= 2^-15 * a`` is below ``a / (2 qmax)``. fp8: with ``y = x / s``, in
e4m3's normal range (``|y| >= 2^-6``) a value in ``[2^e, 2^(e+1))`` lies on a grid of step
2^(e-3), so ``|y - e4m3(y)| <= 2^(e-4) <= 2^-4 |y|``; in the subnormal range the step is 2^-9
and the error at most 2^-10; clamping ``448 < |y| <= 448 (1 + 2^-15)`` errs by less than
``2^-4 |y|``. Multiplying by ``s <= max(a / 448, 2^-117)`` gives the bound: relative 2^-4 for
values whose scaled magnitude is normal, an absolute floor of ``2^-10 * a / 448`` (about
``2.2e-6 * a``) below that. The absolute ``2^-127`` terms only bind for tiny blocks
(``a < 127 * 2^-126``, about 1.5e-36, for int8; ``a < 448 * 2^-117``, about 2.7e-33, for fp8).

[Note: non-finite input] A block holding a nan or an inf gets a nan scale, so it decodes to all
nan whatever its codes hold (its infs become nan too: an inf cannot be scaled); the other
blocks are unaffected. Nothing non-finite is turned into a finite number, and a nan in one
rank's gradient chunk shows up as nan in the reduced block, where loss scaling can see it.

[Note: wire format] :func:`pack` writes each row as ``[scales | payload | zero padding]``: the
fp32 scales (4 bytes per block) first, so they stay 4-byte aligned for a zero-copy
:func:`unpack`, then the payload (1 byte per element for int8 / fp8, half a byte for int4),
padded to a multiple of 4 bytes so rows of a gathered ``(n, nbytes)`` buffer stay aligned too.
At block 256 this is ``m + 4 * ceil(m / 256)`` bytes (int8, fp8; ~3.94x fewer than fp32) and
``ceil(m / 2) + 4 * ceil(m / 256)`` (int4; ~7.76x fewer), up to the 3 bytes of padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["KINDS", "WEIGHT_KINDS", "GRAD_KINDS", "QuantizedTensor", "quantize", "dequantize",
           "pack", "unpack", "packed_nbytes", "error_bound", "check_kind", "check_block_size"]

KINDS = ("int8", "int4", "fp8")
WEIGHT_KINDS = ("int8", "fp8")
GRAD_KINDS = ("int8", "int4")
_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
_FLOOR = {"int8": 2.0**-126, "int4": 2.0**-126, "fp8": 2.0**-117}  # [Note: exact codec arithmetic]
_SCALE_BITS = 16


def check_kind(kind: object, choices: tuple[str | None, ...] = KINDS,
               what: str = "quantization kind") -> str:
    """Return ``kind`` if it is one of ``choices``; raise ``ValueError`` naming it otherwise."""
    if not isinstance(kind, str) or kind not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {kind!r}")
    return kind


def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is a positive int; raise ``ValueError`` naming it otherwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes and per-block scales of a tensor quantized along its last dim.

    ``payload`` is ``(*shape[:-1], payload_bytes)``: int8 codes (int8), or uint8 bytes (int4
    nibble pairs, fp8 e4m3 bits). ``scales`` is fp32 ``(*shape[:-1], num_blocks)``.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    kind: str
    block_size: int

    @property
    def row_numel(self) -> int:
        """Elements per row (the last dim; 1 for a 0-d tensor)."""
        return self.shape[-1] if len(self.shape) else 1


def _num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _payload_nbytes(numel: int, kind: str) -> int:
    return -(-numel // 2) if kind == "int4" else numel


def packed_nbytes(numel: int, kind: str, block_size: int) -> int:
    """Bytes :func:`pack` uses for one row of ``numel`` elements ([Note: wire format]).

    Raises:
        ValueError: a bad ``kind`` or ``block_size``, or a negative ``numel``.
    """
    check_kind(kind)
    check_block_size(block_size)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    payload = _payload_nbytes(numel, kind)
    return 4 * _num_blocks(numel, block_size) + 4 * -(-payload // 4)


def _scales(absmax: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-block fp32 scales from fp32 absmaxes ([Note: codecs]); nan where not finite."""
    t = absmax.double() / _QMAX[kind]  # exact enough: RZ16 of it equals RZ16 of the real
    mant, exp = torch.frexp(t)
    s = torch.ldexp(torch.floor(mant * 2.0**_SCALE_BITS), exp - _SCALE_BITS)
    s = torch.where(t > 0, s.clamp_min(_FLOOR[kind]), s)
    return torch.where(torch.isfinite(t), s, torch.nan).float()


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def quantize(x: torch.Tensor, kind: str, block_size: int = 256) -> QuantizedTensor:
    """Quantize ``x`` blockwise along its last dim (see [Note: codecs]).

    Args:
        x: a floating-point tensor (float64 is rounded to fp32 first).
        kind: "int8", "int4" or "fp8" (e4m3).
        block_size: elements per block (default 256); the last block of a row may be partial.

    Returns:
        A :class:`QuantizedTensor`; decode with :func:`dequantize`. The round-trip error is
        bounded as in [Note: error bounds]; non-finite blocks as in [Note: non-finite input].

    Raises:
        ValueError: a bad ``kind`` or ``block_size``, or a non-floating ``x``.
    """
    check_kind(kind)
    check_block_size(block_size)
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a floating-point tensor, got dtype {x.dtype}")
    rows = _rows(x.detach()).float()  # (R, m)
    m = rows.shape[1]
    nb = _num_blocks(m, block_size)
    blocks = F.pad(rows, (0, nb * block_size - m)) if nb * block_size != m else rows
    blocks = blocks.view(rows.shape[0], nb, block_size)  # (R, nb, B)
    lo, hi = torch.aminmax(blocks, dim=-1)
    scales = _scales(torch.maximum(hi, -lo), kind)  # maximum propagates nan
    # Zero and non-finite blocks divide by 1 (their scale, 0 or nan, decides the decoding);
    # nan_to_num keeps a nan from reaching an integer cast, whose result is undefined.
    y = blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
    qmax = _QMAX[kind]
    if kind == "fp8":
        codes = y.clamp_(-qmax, qmax).nan_to_num_(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
        payload = codes.flatten(1)[:, :m]
    else:
        y.round_().clamp_(-qmax, qmax).nan_to_num_(0.0)
        if kind == "int8":
            payload = y.to(torch.int8).flatten(1)[:, :m]
        else:
            payload = _pack_nibbles(y.flatten(1).add_(8.0).to(torch.uint8), m)
    lead = tuple(x.shape[:-1])
    return QuantizedTensor(payload.contiguous().view(*lead, payload.shape[1]),
                           scales.view(*lead, nb), x.shape, kind, block_size)


def _pack_nibbles(codes: torch.Tensor, m: int) -> torch.Tensor:
    """(R, L) uint8 codes in [0, 15] -> (R, ceil(m / 2)) bytes, even element in the low nibble."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1), value=8)
    pairs = codes.view(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4))[:, :_payload_nbytes(m, "int4")]


def _unpack_nibbles_into(payload: torch.Tensor, dst: torch.Tensor) -> None:
    """(R, ceil(m / 2)) bytes -> int4 values in [-7, 7] written into ``dst`` (R, m), any float
    dtype: bytes copied to the even slots, the high nibble split off into the odd slots
    (``floor(b / 16)``), the low one kept (``b mod 16``); exact for bytes in every float
    dtype (integers up to 256)."""
    low, high = dst[:, 0::2], dst[:, 1::2]              # ceil(m / 2), floor(m / 2) slots
    low.copy_(payload[:, :low.shape[1]])
    high.copy_(low[:, :high.shape[1]]).div_(16.0).floor_()
    low.remainder_(16.0)
    dst.sub_(8.0)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32,
               work: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``q`` into a tensor of its original shape (``q * s`` per element).

    Args:
        q: from :func:`quantize` or :func:`unpack`.
        out: where to write (any floating dtype, ``q.shape.numel()`` elements, contiguous);
            a new tensor when None.
        dtype: the new tensor's dtype when ``out`` is None (default fp32, which is exact:
            [Note: exact codec arithmetic]).
        work: for an ``out`` that is not fp32, an fp32 buffer of at least as many elements
            to decode in before one cast into ``out`` (default None: torch allocates the
            cast's temporaries). The result is the same either way.

    Returns:
        ``out``, or the new tensor.

    Raises:
        ValueError: ``out`` or ``work`` of the wrong size, dtype or layout.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.payload.device)
    elif out.numel() != q.shape.numel() or not out.is_floating_point() or not out.is_contiguous():
        raise ValueError(f"dequantize out must be a contiguous float tensor of "
                         f"{q.shape.numel()} elements, got {out.dtype} {tuple(out.shape)}")
    if work is not None and out.dtype != torch.float32:
        if work.dtype != torch.float32 or work.numel() < out.numel():
            raise ValueError(f"dequantize work must be fp32 with >= {out.numel()} elements, "
                             f"got {work.dtype} {work.numel()}")
        out.copy_(dequantize(q, out=work[:out.numel()]).view_as(out))
        return out
    m, bs = q.row_numel, q.block_size
    num_rows = q.shape[:-1].numel()
    payload = q.payload.reshape(num_rows, q.payload.shape[-1])
    scales = q.scales.reshape(num_rows, q.scales.shape[-1])
    dst = out.view(payload.shape[0], m)
    # Codes are small integers (and e4m3 values), exact in every float dtype, so they are
    # first written into ``dst`` itself and then scaled in place: no (R, m) temporary when
    # ``dst`` is fp32. The product is computed in fp32 (type promotion with the fp32 scales)
    # and rounded once to ``dst``'s dtype.
    if q.kind == "int8":
        dst.copy_(payload[:, :m])
    elif q.kind == "int4":
        _unpack_nibbles_into(payload, dst)
    else:
        dst.copy_(payload.view(torch.float8_e4m3fn)[:, :m])
    full = (m // bs) * bs  # whole blocks scale as (R, nb, B) x (R, nb, 1); the tail apart
    if full:
        dst[:, :full].unflatten(1, (full // bs, bs)).mul_(scales[:, :full // bs].unsqueeze(-1))
    if full < m:
        dst[:, full:].mul_(scales[:, -1:])
    return out


def pack(q: QuantizedTensor) -> torch.Tensor:
    """Scales and payload of ``q`` in one contiguous uint8 buffer, row by row.

    Args:
        q: from :func:`quantize` (or :func:`unpack`).

    Returns:
        uint8 ``(*q.shape[:-1], nbytes)``, ``nbytes`` = :func:`packed_nbytes` of the row
        length ([Note: wire format]); :func:`unpack` inverts it.
    """
    m = q.row_numel
    nbytes = packed_nbytes(m, q.kind, q.block_size)
    lead = tuple(q.shape[:-1])
    num_rows = q.shape[:-1].numel()
    payload = q.payload.reshape(num_rows, _payload_nbytes(m, q.kind)).view(torch.uint8)
    scales = q.scales.reshape(num_rows, q.scales.shape[-1]).contiguous().view(torch.uint8)
    buf = torch.empty(payload.shape[0], nbytes, dtype=torch.uint8, device=payload.device)
    ns, npay = scales.shape[1], payload.shape[1]
    buf[:, :ns] = scales
    buf[:, ns:ns + npay] = payload
    buf[:, ns + npay:] = 0  # deterministic padding bytes
    return buf.view(*lead, nbytes)


def unpack(buf: torch.Tensor, numel: int, kind: str, block_size: int = 256) -> QuantizedTensor:
    """View a :func:`pack`-ed buffer ``(..., nbytes)`` as a :class:`QuantizedTensor` (no copy).

    Args:
        buf: uint8, last dim :func:`packed_nbytes` ``(numel, kind, block_size)`` bytes, rows
            starting at 4-byte aligned offsets (true of a contiguous buffer of packed rows).
        numel: elements per row.
        kind, block_size: as given to :func:`quantize`.

    Returns:
        A :class:`QuantizedTensor` of shape ``(*buf.shape[:-1], numel)`` viewing ``buf``.

    Raises:
        ValueError: bad ``kind`` / ``block_size`` / ``numel``, or ``buf`` not uint8 of the
            computed size.
    """
    nbytes = packed_nbytes(numel, kind, block_size)
    if buf.dtype != torch.uint8 or buf.dim() == 0 or buf.shape[-1] != nbytes:
        raise ValueError(f"unpack needs a uint8 buffer whose last dim is {nbytes} bytes "
                         f"({kind}, {numel} elements, block {block_size}), got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    nb = _num_blocks(numel, block_size)
    payload = buf[..., 4 * nb:4 * nb + _payload_nbytes(numel, kind)]
    if kind == "int8":
        payload = payload.view(torch.int8)
    shape = torch.Size((*buf.shape[:-1], numel))
    if nb == 0:  # an empty row: no scales (and a 0-byte buffer whose strides cannot be viewed)
        scales = torch.empty((*buf.shape[:-1], 0), dtype=torch.float32, device=buf.device)
    else:
        scales = buf[..., :4 * nb].view(torch.float32)
    return QuantizedTensor(payload, scales, shape, kind, block_size)


def error_bound(x: torch.Tensor, kind: str, block_size: int = 256) -> torch.Tensor:
    """Elementwise float64 bound on ``|x - dequantize(quantize(x))|`` ([Note: error bounds]).

    Non-finite blocks get nan bounds. Useful for tests and for tolerances built on codecs.

    Raises:
        ValueError: a bad ``kind`` or ``block_size``.
    """
    check_kind(kind)
    check_block_size(block_size)
    rows = _rows(x.detach()).float().double()
    m = rows.shape[1]
    nb = _num_blocks(m, block_size)
    absmax = F.pad(rows.abs(), (0, nb * block_size - m)).view(rows.shape[0], nb, block_size)
    absmax = absmax.amax(-1, keepdim=True).expand(-1, -1, block_size).flatten(1)[:, :m]
    if kind == "fp8":
        floor = torch.clamp_min(absmax / 448.0, _FLOOR["fp8"]) * 2.0**-10
        bound = torch.maximum(rows.abs() * 2.0**-4, floor)
    else:
        bound = torch.clamp_min(absmax / (2.0 * _QMAX[kind]), 2.0**-127)
    return torch.where(torch.isfinite(absmax), bound, torch.nan).view(x.shape)

