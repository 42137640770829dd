"""Blockwise codecs: the documented error bounds, exact arithmetic and wire format, as properties.

Bounds asserted here are the ones stated in [Note: error bounds] of shardwise/quant/codecs.py,
with no extra tolerance: the test computes them independently in float64 and compares with
``<=``.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.shard.comm_quant import CommQuant
from shardwise.quant import (KINDS, QuantizedTensor, dequantize, error_bound,
                                   pack, packed_nbytes, quantize, unpack)

QMAX = {"int8": 127, "int4": 7, "fp8": 448}
PATTERNS = ("normal", "zeros", "constant", "huge", "tiny", "subnormal", "mixed", "outlier",
            "grid", "extreme")
FAST = settings(max_examples=40, deadline=None)
lengths = st.one_of(st.integers(1, 700), st.sampled_from([255, 256, 257, 512, 513, 1024]))
block_sizes = st.sampled_from([1, 2, 3, 7, 16, 64, 256])


def _values(pattern: str, n: int, block: int, seed: int) -> torch.Tensor:
    """fp32 test data of a named pattern (see PATTERNS)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if pattern == "zeros":
        return torch.zeros(n)
    if pattern == "constant":
        return torch.full((n,), float(torch.randn(1, generator=g)) * 3)
    if pattern in ("huge", "tiny", "subnormal"):
        return x * {"huge": 1e30, "tiny": 1e-30, "subnormal": 1e-41}[pattern]
    if pattern == "mixed":  # every element its own magnitude, 1e-38 .. 1e38, both signs
        return x.sign() * 10.0 ** (torch.rand(n, generator=g) * 76 - 38)
    if pattern == "outlier":  # one element per block 1e4 times the rest
        x[::block] *= 1e4
        return x
    if pattern == "grid":  # integers: many exact ties of x / s
        return torch.randint(-300, 301, (n,), generator=g).float() / 2
    if pattern == "extreme":  # near fp32's largest finite value
        return x.clamp(-1, 1) * 3.4e38
    return x


def _ref_bound(x: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """[Note: error bounds] in float64, from the formulas (independent of quant.py's code)."""
    x64 = x.double()
    n = x.numel()
    a = F.pad(x64.abs(), (0, -n % block)).view(-1, block).amax(1)
    a = a.repeat_interleave(block)[:n]  # each element's block absmax
    if kind == "fp8":
        return torch.maximum(x64.abs() * 2.0**-4, torch.clamp_min(a / 448, 2.0**-117) * 2.0**-10)
    return torch.clamp_min(a / (2 * QMAX[kind]), 2.0**-127)


def _codes(q: QuantizedTensor) -> torch.Tensor:
    """The code values as float64 (int8 / int4 integers, fp8 e4m3 values), one per element."""
    m = q.row_numel
    if q.kind == "int8":
        return q.payload.double()
    if q.kind == "int4":
        both = torch.stack((q.payload & 15, q.payload >> 4), -1).flatten(-2)[..., :m]
        return both.double() - 8
    return q.payload.view(torch.float8_e4m3fn).double()


def _per_element(scales: torch.Tensor, block: int, m: int) -> torch.Tensor:
    return scales.double().repeat_interleave(block)[:m]


def _e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """Round float64 ``y`` (|y| <= 448) to e4m3, nearest, ties to even: the reference."""
    _, e = torch.frexp(y)  # |y| in [2^(e-1), 2^e)
    step = torch.ldexp(torch.ones_like(y), torch.clamp_min(e - 1, -6) - 3)
    return torch.round(y / step) * step


@FAST
@given(kind=st.sampled_from(KINDS), pattern=st.sampled_from(PATTERNS), n=lengths,
       block=block_sizes, seed=st.integers(0, 2**31 - 1))
def test_round_trip_within_documented_bound(kind, pattern, n, block, seed):
    x = _values(pattern, n, block, seed)
    q = quantize(x, kind, block)
    d = dequantize(q)
    assert d.dtype == torch.float32 and d.shape == x.shape and torch.isfinite(d).all()
    err = (x.double() - d.double()).abs()  # exact: both operands are fp32
    bound = _ref_bound(x, kind, block)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    assert torch.equal(error_bound(x, kind, block), bound)
    if pattern == "zeros":
        assert torch.equal(d, torch.zeros(n))


@FAST
@given(kind=st.sampled_from(KINDS), pattern=st.sampled_from(PATTERNS), n=lengths,
       block=block_sizes, seed=st.integers(0, 2**31 - 1))
def test_codes_are_nearest_and_decode_exactly(kind, pattern, n, block, seed):
    """[Note: exact codec arithmetic]: codes round the real x / s; d == q * s exactly."""
    x = _values(pattern, n, block, seed)
    q = quantize(x, kind, block)
    s = _per_element(q.scales, block, n)
    codes = _codes(q)
    assert torch.equal(dequantize(q).double(), codes * s)
    y = torch.where(s > 0, x.double() / torch.where(s > 0, s, 1.0), 0.0)  # float64: exact enough
    if kind == "fp8":
        expect = _e4m3_round(y.clamp(-448, 448))
    else:
        expect = y.round().clamp(-QMAX[kind], QMAX[kind])
    assert torch.equal(codes, expect)
    # The block's absmax maps to qmax unless the scale floor (tiny blocks) or a zero block.
    a = F.pad(x.abs(), (0, -n % block)).view(-1, block).amax(1)
    top = F.pad(codes.abs(), (0, -n % block)).view(-1, block).amax(1)
    regular = a >= QMAX[kind] * (2.0**-117 if kind == "fp8" else 2.0**-126)
    assert torch.equal(top[regular], torch.full_like(top[regular], QMAX[kind]))


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(KINDS), block=st.sampled_from([1, 4, 16, 64]),
       vals=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1,
                     max_size=70))
def test_any_finite_fp32_values(kind, block, vals):
    x = torch.tensor(vals, dtype=torch.float32)
    d = dequantize(quantize(x, kind, block))
    assert ((x.double() - d.double()).abs() <= _ref_bound(x, kind, block)).all()


def test_ties_round_to_even_and_scale_truncates():
    x = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, 1.5, -0.5, 0.0])  # absmax 127: s = 1 exactly
    q = quantize(x, "int8", 8)
    assert q.scales.item() == 1.0
    assert q.payload.tolist() == [127, 2, 4, -2, 0, 2, 0, 0]
    q = quantize(torch.tensor([1.0, -0.3]), "int8", 2)  # 1 / 127 truncated to 16 bits
    s = q.scales.item()
    assert s <= 1 / 127 and (1 / 127 - s) < 2.0**-15 / 127 and q.payload.tolist()[0] == 127


def test_nonfinite_blocks_decode_to_nan_and_leave_others():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([1.0, nan, 2.0, 3.0, 0.5, -1.0, 2.0, 0.0, 4.0, -inf, 1.0, 1.0, 7.0])
    for kind in KINDS:
        q = quantize(x, kind, 4)
        d = dequantize(q)
        assert torch.isnan(d[:4]).all() and torch.isnan(d[8:12]).all(), kind
        assert torch.isnan(q.scales[[0, 2]]).all() and not torch.isnan(q.scales[[1, 3]]).any()
        ok = torch.cat([torch.arange(4, 8), torch.tensor([12])])
        assert ((x[ok].double() - d[ok].double()).abs() <= _ref_bound(x[ok], kind, 4)).all()
        assert torch.isnan(error_bound(x, kind, 4)[:4]).all()


@FAST
@given(kind=st.sampled_from(KINDS), n=st.integers(0, 600), rows=st.integers(1, 3),
       block=block_sizes, seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_and_size(kind, n, rows, block, seed):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    q = quantize(x, kind, block)
    buf = pack(q)
    nb, payload = -(-n // block), (-(-n // 2) if kind == "int4" else n)
    assert buf.dtype == torch.uint8 and buf.shape == (rows, packed_nbytes(n, kind, block))
    assert buf.shape[1] == 4 * nb + 4 * -(-payload // 4) and buf.shape[1] % 4 == 0
    u = unpack(buf, n, kind, block)
    assert u.shape == x.shape and torch.equal(u.scales, q.scales)
    assert torch.equal(u.payload, q.payload) and torch.equal(dequantize(u), dequantize(q))
    for r in range(rows):  # rows are independent: the same as quantizing each alone
        assert torch.equal(pack(quantize(x[r], kind, block)), buf[r])
    one = unpack(buf.flatten(), n, kind, block) if rows == 1 else None
    if one is not None:
        assert torch.equal(dequantize(one), dequantize(q).flatten())


def test_packed_sizes_at_block_256():
    assert packed_nbytes(0, "int8", 256) == 0
    assert packed_nbytes(256, "int8", 256) == 260
    assert packed_nbytes(257, "fp8", 256) == 8 + 260
    assert packed_nbytes(257, "int4", 256) == 8 + 132
    m = 1 << 20
    assert 4 * m / packed_nbytes(m, "int8", 256) > 3.9
    assert 4 * m / packed_nbytes(m, "int4", 256) > 7.7


def test_other_dtypes_and_shapes():
    x = torch.randn(3, 5, 37)
    q = quantize(x, "int4", 16)
    assert q.scales.shape == (3, 5, 3) and dequantize(q).shape == x.shape
    assert torch.equal(dequantize(q)[1, 2], dequantize(quantize(x[1, 2], "int4", 16)))
    for dt in (torch.bfloat16, torch.float16):  # exact in fp32, so the same bound holds
        xh = x.to(dt)
        d = dequantize(quantize(xh, "int8", 16))
        assert ((xh.double() - d.double()).abs() <= error_bound(xh, "int8", 16)).all()
    out = torch.empty(3, 5, 37, dtype=torch.bfloat16)  # one rounding, from the exact fp32
    assert torch.equal(dequantize(q, out=out), dequantize(q).to(torch.bfloat16))
    for kind in KINDS:  # a constant block loses at most the scale's truncation, 2^-15
        c = torch.full((300,), -3.0)
        assert ((dequantize(quantize(c, kind)) - c).abs() <= 3 * 2.0**-15).all()
        assert dequantize(quantize(torch.tensor(127.0 * QMAX[kind]), kind)).item() == \
            127.0 * QMAX[kind]  # exact when a / qmax has <= 16 significant bits


def test_bad_arguments_name_the_value():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="'int2'"):
        quantize(x, "int2")
    for bad in (0, -3, 2.5, True, "256"):
        with pytest.raises(ValueError, match="block_size"):
            quantize(x, "int8", bad)
    with pytest.raises(ValueError, match="int64"):
        quantize(torch.arange(4), "int8")
    with pytest.raises(ValueError, match="'fp16'"):
        packed_nbytes(4, "fp16", 256)
    with pytest.raises(ValueError, match="-1"):
        packed_nbytes(-1, "int8", 256)
    with pytest.raises(ValueError, match="16 bytes"):
        unpack(torch.zeros(12, dtype=torch.uint8), 10, "int8", 256)
    with pytest.raises(ValueError, match="10 elements"):
        dequantize(quantize(x, "int8"), out=torch.empty(9))


def test_comm_quant_policy():
    c = CommQuant(weights="int8", grads="int4", block_size=128, hierarchy=8)
    assert c.enabled and c.block_size == 128 and not CommQuant().enabled
    assert CommQuant(weights="fp8").grads is None and CommQuant().block_size == 256
    bad = [(dict(weights="int4"), r"'int8', 'fp8'.*'int4'"),
           (dict(grads="fp8"), r"'int8', 'int4'.*'fp8'"),
           (dict(block_size=0), "got 0"), (dict(hierarchy=0), "got 0"),
           (dict(hierarchy=2.0), "got 2.0"), (dict(rest_unquantised=1), "a bool, got 1"),
           (dict(weights="fp8", rest_unquantised=True, hierarchy=2),
            "rest_unquantised with hierarchy=2")]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            CommQuant(**kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_four_million_elements_well_under_a_second(kind):
    x = torch.randn(4 * 1024 * 1024)
    best = float("inf")
    for _ in range(2):  # best of 2: the machine is shared
        t = time.perf_counter()
        dequantize(quantize(x, kind))
        best = min(best, time.perf_counter() - t)
    assert best < 1.0, f"{kind}: {best:.2f} s for 4M elements"
