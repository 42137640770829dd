"""Quantize straight into the wire format, with caller-provided buffers.

:func:`quantize_packed` writes exactly ``pack(quantize(x, kind, block_size))`` (see
[Note: wire format] in codecs.py) into a given uint8 buffer, using a given fp32 work buffer
for the blocks, so a collective that quantizes every step allocates nothing of the data's
size (only per-block scale temporaries, 1/64 of the fp32 bytes at block 256). The
collectives stage both buffers through the engine's pool ([Note: buffer pool]).
"""

from __future__ import annotations

import torch

from shardwise.quant.codecs import (_QMAX, _num_blocks, _payload_nbytes, _rows, _scales,
                                    check_block_size, check_kind, packed_nbytes)

__all__ = ["quantize_packed", "work_numel"]


def work_numel(rows: int, numel: int, block_size: int) -> int:
    """fp32 elements of the work buffer :func:`quantize_packed` needs for ``rows`` rows of
    ``numel`` elements (whole blocks, plus one for an odd int4 row)."""
    return rows * (_num_blocks(numel, block_size) * block_size + 1)


def quantize_packed(x: torch.Tensor, kind: str, block_size: int, out: torch.Tensor,
                    work: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` row by row along its last dim and pack it into ``out``.

    Args:
        x: a floating-point tensor (float64 is rounded to fp32 first).
        kind: "int8", "int4" or "fp8".
        block_size: elements per block.
        out: contiguous uint8 ``(rows, packed_nbytes(m, kind, block_size))`` (or any shape
            with that many bytes), ``rows`` = elements of ``x`` / ``m``.
        work: fp32 scratch of at least :func:`work_numel` elements (allocated when None).

    Returns:
        ``out``, holding the bytes :func:`~shardwise.quant.pack` of
        :func:`~shardwise.quant.quantize` would return.

    Raises:
        ValueError: a bad ``kind``, ``block_size``, ``out`` or ``work``.
    """
    check_kind(kind)
    check_block_size(block_size)
    rows = _rows(x.detach())                                         # (R, m)
    r, m = rows.shape
    nb, nbytes = _num_blocks(m, block_size), packed_nbytes(m, kind, block_size)
    if out.dtype != torch.uint8 or out.numel() != r * nbytes or not out.is_contiguous():
        raise ValueError(f"quantize_packed: out must be contiguous uint8 of {r * nbytes} bytes "
                         f"({r} rows of {nbytes}), got {out.dtype} {tuple(out.shape)}")
    need = work_numel(r, m, block_size)
    if work is None:
        work = torch.empty(need, dtype=torch.float32, device=x.device)
    elif work.dtype != torch.float32 or work.numel() < need:
        raise ValueError(f"quantize_packed: work must be fp32 with >= {need} elements, got "
                         f"{work.dtype} {work.numel()}")
    width = nb * block_size + 1
    flat = work[:r * width].view(r, width)
    flat[:, :m].copy_(rows)
    flat[:, m:].zero_()
    blocks = flat[:, :nb * block_size].view(r, nb, block_size)       # (R, nb, B)
    lo, hi = torch.aminmax(blocks, dim=-1)
    scales = _scales(torch.maximum(hi, -lo), kind)
    dst = out.view(r, nbytes)
    out.view(-1).view(torch.float32).view(r, nbytes // 4)[:, :nb].copy_(scales)
    blocks.div_(torch.where(scales > 0, scales, 1.0).unsqueeze(-1))
    qmax = _QMAX[kind]
    npay = _payload_nbytes(m, kind)
    payload = dst[:, 4 * nb:4 * nb + npay]
    if kind == "fp8":
        blocks.clamp_(-qmax, qmax).nan_to_num_(0.0)
        payload.view(torch.float8_e4m3fn).copy_(flat[:, :m])
    else:
        blocks.round_().clamp_(-qmax, qmax).nan_to_num_(0.0)
        if kind == "int8":
            payload.view(torch.int8).copy_(flat[:, :m])
        else:  # codes + 8 in nibbles; the slot after an odd row's end is a padding 8
            flat[:, m:].fill_(0.0)
            pairs = flat[:, :2 * npay].add_(8.0).view(r, npay, 2)
            payload.copy_(pairs[..., 1].mul_(16.0).add_(pairs[..., 0]))
    dst[:, 4 * nb + npay:].zero_()
    return out
