"""Quantized all-gather and reduce-scatter built on the counted collectives of ``comm``.

Both move :func:`shardwise.quant.pack`-ed pieces (per-block fp32 scales + int8 / int4
/ fp8 codes in one uint8 buffer), so ``comm_stats`` counts the bytes that really travel:
about 3.9x fewer than fp32 for int8 / fp8 and 7.8x fewer for int4 at block 256.

[Note: quantized reduce-scatter] Each rank quantizes the ``n`` chunks of its rank-major
gradient separately and one ``all_to_all_single`` delivers chunk ``r`` of every rank to rank
``r``, which dequantizes the ``n`` pieces and sums them in fp32 in rank order. Nothing is
re-quantized after a partial sum (as a ring reduce-scatter of quantized data would have to),
so the error of the result is at most the sum of the ``n`` per-piece codec bounds of
[Note: error bounds] in quant.py, however many ranks there are, plus fp32's own rounding of
the n-term sum (at most ``(n - 1) * 2^-24 * sum_r |piece_r|``, which an unquantized fp32
reduction has as well). The all-to-all moves exactly the (n - 1) packed chunks per rank a
ring reduce-scatter would, and is counted under ``comm_stats()["all_to_all"]``.

[Note: quantized comm memory] Per call, with ``P = packed_nbytes(m, kind, block_size)`` for
an ``m``-element piece: the gather holds a ``P``-byte send and an ``n * P``-byte receive
buffer until ``wait()``, the reduce-scatter an ``n * P``-byte send and receive buffer each;
quantizing briefly needs an fp32 copy of its input (plus padding to whole blocks) and the
reduction two ``m``-element fp32 buffers (one when ``output`` is fp32).

[Note: one-rank groups] With ``n == 1`` nothing is communicated or counted, but the data is
still quantized and dequantized locally, so a one-rank group sees the same numerics as each
piece of a multi-rank collective (a world-size-1 reference run reproduces the quantization
error instead of silently being exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardwise.distributed import comm
from shardwise.distributed.pool import POOL
from shardwise.quant import (QuantizedTensor, check_block_size, check_kind, dequantize,
                             packed_nbytes, quantize, unpack)
from shardwise.quant.packed import quantize_packed, work_numel

__all__ = ["all_gather_quantized", "reduce_scatter_quantized", "QuantizedWork"]


class QuantizedWork:
    """Work handle of a quantized collective: ``wait()`` waits, then decodes into the output.

    Holds the send and receive buffers so they outlive the asynchronous collective.
    """

    def __init__(self, work, finish: Callable[[], None], *buffers: torch.Tensor) -> None:
        self.work, self._finish = work, finish
        self._buffers = tuple(b for b in buffers if b is not None)
        self.trailers: torch.Tensor | None = None
        """All-gather with a ``trailer``: every rank's trailer bytes, ``(n, len)``, valid
        after :meth:`wait`."""

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            if self.work is not None:
                self.work.wait()
            self._finish()
            # The buffers stay referenced by the handle: on CUDA the decode just queued on
            # the compute stream still reads them (see [Note: CUDA streams] in the engine).
            self.work, self._finish = None, None
        return True

    def is_completed(self) -> bool:
        """Whether the communication is done (``wait()`` still decodes, if not yet called)."""
        return self.work is None or self.work.is_completed()


def _check(name: str, output: torch.Tensor, out_numel: int, inp: torch.Tensor,
           in_numel: int, quant_kind: str | None, block_size: int,
           unquantised_ok: bool = False) -> None:
    if quant_kind is not None or not unquantised_ok:
        check_kind(quant_kind)
    check_block_size(block_size)
    for what, t, numel in (("output", output, out_numel), ("input", inp, in_numel)):
        if not t.is_floating_point() or not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be a contiguous floating-point tensor, "
                             f"got {t.dtype} (contiguous={t.is_contiguous()})")
        if t.numel() != numel:
            raise ValueError(f"{name}: {what} must have {numel} elements, got {t.numel()} "
                             f"(input {inp.numel()}, output {output.numel()} elements)")


def _finish(handle: QuantizedWork, async_op: bool) -> QuantizedWork | None:
    if async_op:
        return handle
    handle.wait()
    return None


def _check_codes(codes: torch.Tensor | None, codes_out: Sequence[torch.Tensor], n: int) -> int:
    """Bytes of this rank's ``codes``, checked against the ``(n, len_i)`` receivers."""
    if codes is None:
        if codes_out:
            raise ValueError(f"all_gather_quantized: codes_out given ({len(codes_out)} "
                             f"tensors) without codes to send")
        return 0
    if codes.element_size() != 1 or not codes.is_contiguous():
        raise ValueError(f"all_gather_quantized: codes must be contiguous 1-byte elements, got "
                         f"{codes.dtype} (contiguous={codes.is_contiguous()})")
    lens = [c.shape[1] if c.dim() == 2 else -1 for c in codes_out]
    if any(c.element_size() != 1 or c.dim() != 2 or c.shape[0] != n or not c.is_contiguous()
           for c in codes_out) or sum(lens) != codes.numel():
        raise ValueError(f"all_gather_quantized: codes_out must be contiguous 1-byte (n={n}, "
                         f"len) tensors whose lens sum to the {codes.numel()} code bytes, got "
                         f"{[(c.dtype, tuple(c.shape)) for c in codes_out]}")
    return codes.numel()


def all_gather_quantized(output: torch.Tensor, shard: torch.Tensor, group=None,
                         quant_kind: str | None = "int8", block_size: int = 256, *,
                         label: str = "", async_op: bool = False,
                         trailer: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                         codes_out: Sequence[torch.Tensor] = ()) -> QuantizedWork | None:
    """Gather every rank's ``shard`` into ``output`` (rank-major), quantized on the wire.

    Each rank quantizes its shard with ``quant_kind`` and ``block_size``, the packed bytes are
    all-gathered (counted as ``"all_gather"``), and every rank dequantizes all ``n`` pieces
    into ``output``: piece ``r`` equals ``dequantize(quantize(shard of rank r))`` exactly
    (cast to ``output.dtype``). One-rank groups: [Note: one-rank groups].

    [Note: codes on the wire] A caller whose elements are already codes (the ZeRO-3 gather of
    low-bit weights, encoded with a multiplier the group agreed: [Note: fp8 weight gathers]
    in parallel/lowbit/gather.py) passes them as ``codes``: their bytes travel after the
    shard's, unchanged, in the same collective, and ``wait()`` copies every rank's into
    ``codes_out``. ``quant_kind=None`` then sends the shard itself unquantised, as
    ``output.dtype`` (the elements the codes do not cover: the layers the recipe keeps in
    high precision). A row is ``[shard payload | codes | trailer]``, with no padding.

    Args:
        output: contiguous float tensor of ``n * shard.numel()`` elements, any float dtype;
            viewed as ``(n, shard.numel())``.
        shard: this rank's contiguous float shard (same numel on every rank).
        group: process group (default: the world).
        quant_kind: "int8", "fp8", "int4", or None (unquantised, as ``output.dtype``; default
            "int8").
        block_size: elements per quantization block (default 256).
        label: names the collective in ``comm`` records.
        async_op: return a handle whose ``wait()`` finishes the gather and the decoding.
        trailer: uint8 bytes appended, unquantized, to this rank's packed shard; every rank's
            trailer is in the handle's ``trailers`` after ``wait()`` (default None). The
            engine sends its unit identity this way ([Note: gather identity]).
        codes: this rank's pre-encoded 1-byte elements (default None: none).
        codes_out: contiguous 1-byte ``(n, len_i)`` tensors, ``sum(len_i) == codes.numel()``:
            every rank's codes, split in order, rank-major (default: none).

    Returns:
        A :class:`QuantizedWork` when ``async_op`` and ``n > 1``, else None (done).

    Raises:
        ValueError: bad kind, block size, dtypes or sizes (names the values).
    """
    n = comm.group_size(group)
    m = shard.numel()
    _check("all_gather_quantized", output, n * m, shard, m, quant_kind, block_size, True)
    ncodes = _check_codes(codes, codes_out, n)
    if n == 1:
        if quant_kind is None:
            output.copy_(shard.view(-1))
        else:
            dequantize(quantize(shard.view(-1), quant_kind, block_size), out=output)
        if ncodes:
            torch.split_with_sizes_copy(codes.view(1, -1).view(torch.uint8),
                                        [c.shape[1] for c in codes_out], dim=1,
                                        out=[c.view(torch.uint8) for c in codes_out])
        return None
    # [Note: quantized comm memory]: every buffer comes from the pool and goes back to it
    # once the gather has completed and been decoded.
    packed = (m * output.element_size() if quant_kind is None
              else packed_nbytes(m, quant_kind, block_size))
    extra = 0 if trailer is None else trailer.numel()
    row = packed + ncodes + extra
    send = POOL.take(row, torch.uint8, shard.device)
    if quant_kind is None:
        send[:packed].view(output.dtype).copy_(shard.view(-1))
    else:
        work = POOL.take(work_numel(1, m, block_size), torch.float32, shard.device)
        quantize_packed(shard.view(-1), quant_kind, block_size, send[:packed], work)
        POOL.give(work)
    if ncodes:
        send[packed:packed + ncodes].copy_(codes.view(torch.uint8))
    if trailer is not None:
        send[packed + ncodes:].copy_(trailer.view(torch.uint8))
    recv = POOL.take(n * row, torch.uint8, shard.device)
    pending = comm.all_gather_into_tensor(recv, send, group, label=label, async_op=True)
    handle = QuantizedWork(pending, lambda: None, send, recv)

    def decode() -> None:
        rows = recv.view(n, row)
        work32 = (POOL.take(n * m, torch.float32, output.device)
                  if output.dtype != torch.float32 and quant_kind is not None else None)
        if quant_kind is None:  # the bytes of output.dtype elements: a copy decodes them
            output.view(torch.uint8).view(n, packed).copy_(rows[:, :packed])
        else:
            dequantize(unpack(rows[:, :packed], m, quant_kind, block_size), out=output,
                       work=work32)
        if ncodes:
            torch.split_with_sizes_copy(rows[:, packed:packed + ncodes],
                                        [c.shape[1] for c in codes_out], dim=1,
                                        out=[c.view(torch.uint8) for c in codes_out])
        if trailer is not None:
            handle.trailers = rows[:, packed + ncodes:].clone()  # n * len(trailer) bytes
        for buf in (send, recv, work32):
            POOL.give(buf)

    handle._finish = decode
    return _finish(handle, async_op)


def reduce_scatter_quantized(output: torch.Tensor, full: torch.Tensor, group=None,
                             quant_kind: str = "int8", block_size: int = 256, *,
                             label: str = "", async_op: bool = False
                             ) -> QuantizedWork | None:
    """Sum rank-major ``full`` over ranks, keeping this rank's chunk, quantized on the wire.

    See [Note: quantized reduce-scatter]: chunks are quantized once by their owner, swapped
    with one ``all_to_all_single`` of packed bytes (counted as ``"all_to_all"``), dequantized
    and summed in fp32 in rank order; the error stays within the sum of the ``n`` per-chunk
    codec bounds. One-rank groups: [Note: one-rank groups].

    Args:
        output: contiguous float tensor of ``m`` elements (this rank's chunk of the sum); any
            float dtype, written once from the fp32 sum.
        full: contiguous float tensor of ``n * m`` elements, viewed as ``(n, m)``: row ``r``
            is this rank's contribution to rank ``r``'s chunk.
        group: process group (default: the world).
        quant_kind: "int8", "int4" or "fp8" (default "int8").
        block_size: elements per quantization block (default 256); blocks never straddle
            chunks.
        label: names the collective in ``comm`` records.
        async_op: return a handle whose ``wait()`` finishes the exchange and the sum.

    Returns:
        A :class:`QuantizedWork` when ``async_op`` and ``n > 1``, else None (done).

    Raises:
        ValueError: bad kind, block size, dtypes or sizes (names the values).
    """
    n = comm.group_size(group)
    m = output.numel()
    _check("reduce_scatter_quantized", output, m, full, n * m, quant_kind, block_size)
    if n == 1:
        dequantize(quantize(full.view(n, m), quant_kind, block_size), out=output)
        return None
    nbytes = packed_nbytes(m, quant_kind, block_size)
    send = POOL.take(n * nbytes, torch.uint8, full.device)  # (n, nbytes): row r to rank r
    work = POOL.take(work_numel(n, m, block_size), torch.float32, full.device)
    quantize_packed(full.view(n, m), quant_kind, block_size, send, work)
    POOL.give(work)
    recv = POOL.take(n * nbytes, torch.uint8, full.device)
    pending = comm.all_to_all_single(recv, send, group=group, label=label, async_op=True,
                                     kind="reduce_scatter")

    def reduce() -> None:
        _sum_pieces(unpack(recv.view(n, nbytes), m, quant_kind, block_size), output)
        POOL.give(send)
        POOL.give(recv)

    return _finish(QuantizedWork(pending, reduce, send, recv), async_op)


def _sum_pieces(q: QuantizedTensor, output: torch.Tensor) -> None:
    """Dequantize the ``n`` received pieces and add them in fp32, in rank order, to ``output``.

    A loop over ranks (not blocks) so the summation order is explicit and only two ``m``-sized
    fp32 buffers are live instead of an ``(n, m)`` one (pooled).
    """
    n, m = q.shape
    fp32_out = output.dtype == torch.float32
    acc = output.view(m) if fp32_out else POOL.take(m, torch.float32, output.device)
    piece = POOL.take(m, torch.float32, output.device)
    for r in range(n):
        row = QuantizedTensor(q.payload[r], q.scales[r], torch.Size((m,)), q.kind, q.block_size)
        dequantize(row, out=acc if r == 0 else piece)
        if r:
            acc.add_(piece)
    if not fp32_out:
        output.view(m).copy_(acc)
        POOL.give(acc)
    POOL.give(piece)
