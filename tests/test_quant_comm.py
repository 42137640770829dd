"""Quantized all-gather and reduce-scatter on real Gloo ranks: exact decoding, the summed error
bound of [Note: quantized reduce-scatter], and the bytes ``comm_stats`` counts versus fp32."""

from __future__ import annotations

import pytest
import torch

from shardwise.distributed import comm
from shardwise.distributed.comm.quantized import all_gather_quantized, reduce_scatter_quantized
from shardwise.quant import KINDS, dequantize, error_bound, quantize
from shardwise.testing import run_ranks

M = 10_000  # not a multiple of the block: a partial last block per piece
BLOCK = 256


def _data(rank: int, shape, seed: int) -> torch.Tensor:
    """Per-rank data every rank can recompute: normal values, a zero block, an outlier."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + rank))
    flat = x.view(-1)
    flat[:BLOCK] = 0.0
    flat[3 * BLOCK + rank] = 1e4 * (rank + 1)
    return x


def _check_gather(rank: int, n: int, kind: str) -> float:
    shard = _data(rank, (M,), 1)
    expect = torch.cat([dequantize(quantize(_data(r, (M,), 1), kind, BLOCK)) for r in range(n)])
    out = torch.empty(n * M)
    comm.reset_comm_stats()
    all_gather_quantized(out, shard, None, kind, BLOCK, label="t.all_gather")
    assert torch.equal(out, expect), kind
    quant_bytes = comm.comm_stats()["all_gather"].bytes_sent
    assert comm.recent_ops()[-1][2] == "t.all_gather"
    bf16 = torch.empty(n, M, dtype=torch.bfloat16)  # e.g. a bf16 compute dtype
    handle = all_gather_quantized(bf16, shard, None, kind, BLOCK, async_op=True)
    handle.wait()
    assert torch.equal(bf16.view(-1), expect.to(torch.bfloat16)) and handle.is_completed()
    comm.reset_comm_stats()
    comm.all_gather_into_tensor(torch.empty(n * M), shard)
    return comm.comm_stats()["all_gather"].bytes_sent / quant_bytes


def _check_reduce(rank: int, n: int, kind: str) -> float:
    full = _data(rank, (n, M), 2)
    pieces = [_data(r, (n, M), 2)[rank] for r in range(n)]  # what each rank sends to me
    deq = [dequantize(quantize(p, kind, BLOCK)) for p in pieces]
    expect = deq[0].clone()
    for d in deq[1:]:  # fp32, rank order
        expect += d
    out = torch.empty(M)
    comm.reset_comm_stats()
    handle = reduce_scatter_quantized(out, full, None, kind, BLOCK, label="t.rs", async_op=True)
    handle.wait()
    assert torch.equal(out, expect), kind
    quant_bytes = comm.comm_stats()["reduce_scatter"].bytes_sent
    exact = torch.stack(pieces).double().sum(0)
    bound = sum(error_bound(p, kind, BLOCK) for p in pieces)
    bound += (n - 1) * 2.0**-24 * sum(d.double().abs() for d in deq)  # fp32's own summation
    assert ((out.double() - exact).abs() <= bound).all(), kind
    bf16 = torch.empty(M, dtype=torch.bfloat16)
    reduce_scatter_quantized(bf16, full, None, kind, BLOCK)
    assert torch.equal(bf16, expect.to(torch.bfloat16))
    comm.reset_comm_stats()
    comm.reduce_scatter_tensor(torch.empty(M), full.view(-1))
    return comm.comm_stats()["reduce_scatter"].bytes_sent / quant_bytes


def _check_codes_gather(rank: int, n: int) -> None:
    """[Note: codes on the wire]: an unquantised shard in the output dtype, pre-encoded code
    bytes split into rank-major receivers, the trailer: one row, no padding, exact."""
    shard = _data(rank, (M,), 3)
    codes = (torch.arange(13) * (rank + 3)).to(torch.uint8)  # two pieces: 8 and 5 bytes
    outs = [torch.empty(n, 8, dtype=torch.uint8), torch.empty(n, 5, dtype=torch.uint8)]
    out = torch.empty(n * M, dtype=torch.bfloat16)
    trailer = torch.full((16,), 200 + rank, dtype=torch.uint8)
    comm.reset_comm_stats()
    handle = all_gather_quantized(out, shard, None, None, label="t.all_gather", async_op=True,
                                  trailer=trailer, codes=codes.view(torch.float8_e4m3fn),
                                  codes_out=outs)
    handle.wait()
    every = [(torch.arange(13) * (r + 3)).to(torch.uint8) for r in range(n)]
    assert torch.equal(out, torch.cat([_data(r, (M,), 3) for r in range(n)]).bfloat16())
    assert torch.equal(outs[0], torch.stack([c[:8] for c in every]))
    assert torch.equal(outs[1], torch.stack([c[8:] for c in every]))
    assert handle.trailers[:, 0].tolist() == [200 + r for r in range(n)]
    assert comm.comm_stats()["all_gather"].bytes_sent == (n - 1) * (2 * M + 13 + 16)


def _collectives(n: int) -> dict[str, float]:
    rank = torch.distributed.get_rank()
    _check_codes_gather(rank, n)
    ratios = {}
    for kind in KINDS:
        ratios[f"gather.{kind}"] = _check_gather(rank, n, kind)
        ratios[f"reduce.{kind}"] = _check_reduce(rank, n, kind)
    return ratios


@pytest.mark.parametrize("world", [2, 3, 4])
def test_quantized_collectives_on_ranks(world):
    results = run_ranks(_collectives, world, args=(world,), timeout_s=120)
    assert all(r == results[0] for r in results)
    for op in ("gather", "reduce"):  # measured ~3.94x and ~7.75x at block 256
        assert results[0][f"{op}.int8"] >= 3.5 and results[0][f"{op}.fp8"] >= 3.5
        assert results[0][f"{op}.int4"] >= 6.0


def test_one_rank_round_trips_locally_without_communication():
    x = torch.randn(3 * M // 2)
    comm.reset_comm_stats()
    out = torch.empty_like(x)
    assert all_gather_quantized(out, x, None, "int4", BLOCK) is None
    assert torch.equal(out, dequantize(quantize(x, "int4", BLOCK)))
    assert reduce_scatter_quantized(out, x, None, "fp8", BLOCK, async_op=True) is None
    assert torch.equal(out, dequantize(quantize(x, "fp8", BLOCK)))
    assert comm.comm_stats().calls == 0


def test_bad_arguments_name_the_value():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="'int3'"):
        all_gather_quantized(torch.empty(10), x, None, "int3")
    with pytest.raises(ValueError, match="block_size.*0"):
        reduce_scatter_quantized(torch.empty(10), x, None, "int8", 0)
    with pytest.raises(ValueError, match="output must have 10 elements, got 9"):
        all_gather_quantized(torch.empty(9), x)
    with pytest.raises(ValueError, match="torch.int64"):
        reduce_scatter_quantized(torch.empty(10), torch.arange(10))
    with pytest.raises(ValueError, match="None"):  # unquantised: gathers only
        reduce_scatter_quantized(torch.empty(10), x, None, None)
    with pytest.raises(ValueError, match="lens sum to the 4 code bytes"):
        all_gather_quantized(torch.empty(10), x, None, None,
                             codes=torch.zeros(4, dtype=torch.uint8),
                             codes_out=[torch.empty(1, 3, dtype=torch.uint8)])
