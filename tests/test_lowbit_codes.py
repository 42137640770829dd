"""Low-bit codes and scales (shardwise/parallel/lowbit/codes.py, scaling.py): e2m1 rounding
and packing, MX and NVFP4 scales, zero / huge / non-finite tiles, partial tiles, the storage
a ScaledTensor reports, no host syncs, and the fast emulated path against the first
implementation's functions (bucketize / searchsorted e2m1, repeat_interleave scales), kept
below as the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from shardwise.parallel.lowbit import (RECIPES, ScaledTensor, Scaling, dequantize, quantize,
                                       scaled_matmul, set_kernel_policy)
from shardwise.parallel.lowbit.codes import decode, e2m1_round, pack_e2m1, unpack_e2m1

SCALINGS = sorted({s for r in RECIPES.values()
                   for s in (r.input, r.weight, r.grad_output, r.weight_gi, r.grad_gw)
                   if s is not None}, key=str)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _sid(s: Scaling) -> str:
    tile = f"{s.block[0]}x{s.block[1]}" if s.granularity == "block" else s.granularity
    return f"{s.fmt}-{tile}-{s.scale}"


# -- the first implementation (commit 19b1901), the reference for "no number changed" -------

def _ref_e2m1_round(x):
    a = x.abs().clamp(max=6.0)
    grid = torch.tensor(E2M1)
    mid = (grid[1:] + grid[:-1]) / 2
    idx = torch.bucketize(a.contiguous(), mid)
    tie = (idx < 7) & (a == mid[idx.clamp(max=6)])
    idx = idx + (tie & (idx % 2 == 1)).long()
    return torch.copysign(grid[idx], x)


def _ref_pack_e2m1(v):
    idx = torch.searchsorted(torch.tensor(E2M1), v.abs().contiguous())
    code = (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)
    if code.shape[1] % 2:
        code = F.pad(code, (0, 1))
    return code[:, 0::2] | (code[:, 1::2] << 4)


def _ref_unpack_e2m1(packed, cols):
    code = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)[:, :cols].long()
    val = torch.tensor(E2M1)[code & 7]
    return torch.where(code >= 8, -val, val)


def _ref_expand(q, br, bc, r, c):
    if q.shape == (1, 1):
        return q
    return q.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def _ref_quantize(x, s):
    """The first quantize: values ``(R, C)`` fp32 codes and q (e2m1 unpacked for compare)."""
    xf = x.float()
    r, c = xf.shape
    br, bc = s.tile(r, c)
    pr, pc = -r % br, -c % bc
    amax = F.pad(xf.abs(), (0, pc, 0, pr)).view((r + pr) // br, br, (c + pc) // bc,
                                                 bc).amax(dim=(1, 3))
    if s.scale == "nvfp4":
        g = (2688.0 / amax.amax().double().clamp(min=1e-12)).float().reshape(1, 1)
        t = (amax / 6.0 * g).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        q = torch.where(t > 0, g / t, g)
    elif s.scale == "e8m0":  # the first version's log2, exact away from powers of two
        e = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 8
        q = torch.exp2(-e.clamp(-127, 127))
    else:
        fmax = 448.0 if s.fmt == "e4m3" else 57344.0
        q = (fmax / amax.double().clamp(min=1e-12)).float()
        if s.scale == "pow2":
            q = torch.exp2(torch.floor(torch.log2(q)))
    y = xf * _ref_expand(q, br, bc, r, c)
    if s.fmt == "e2m1":
        codes = _ref_e2m1_round(y.nan_to_num(0.0))
    else:
        fmt = torch.float8_e4m3fn if s.fmt == "e4m3" else torch.float8_e5m2
        codes = y.clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt).float()
    return codes, q, codes * _ref_expand(q.reciprocal(), br, bc, r, c)


# -- e2m1 ---------------------------------------------------------------------------------

def _e2m1_probe_values() -> torch.Tensor:
    """Every tie and grid point with its fp32 neighbours, a dense sweep, random values over
    many scales, subnormals, signed zeros, huge values and infinities."""
    pts = torch.tensor(E2M1 + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30, 3e38))
    near = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randn(200_000, generator=gen) * torch.exp2(torch.randint(-30, 10, (200_000,),
                                                                         generator=gen))
    sub = torch.tensor([1e-45, 1e-40, 1e-39, 2.0 ** -126, 0.0, float("inf")])
    v = torch.cat([near, torch.linspace(0, 8, 2 ** 18 + 1), rnd, sub])
    return torch.cat([v, -v])


def test_e2m1_round_gives_the_first_implementations_values_bit_for_bit():
    v = _e2m1_probe_values()
    got, want = e2m1_round(v), _ref_e2m1_round(v)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    assert e2m1_round(torch.tensor([float("nan")])).isnan().all()  # the first gave +-6


@pytest.mark.parametrize("x, want", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0),
                                     (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (5.0001, 6.0),
                                     (6.0, 6.0), (7.0, 6.0), (1e30, 6.0),
                                     (float("inf"), 6.0), (0.2, 0.0), (1.3, 1.5)])
def test_e2m1_round_ties_to_even_saturation_and_signs(x, want):
    got = e2m1_round(torch.tensor([x, -x]))
    assert got.tolist() == [want, -want]
    assert torch.signbit(got).tolist() == [False, True]  # -0.2 -> -0


def test_e2m1_pack_unpack_round_trip_and_layout():
    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor(E2M1)
    vals = torch.cat([grid, -grid])[torch.randint(0, 16, (33, 37), generator=gen)]
    packed = pack_e2m1(vals)
    assert packed.dtype == torch.uint8 and packed.shape == (33, 19)
    assert torch.equal(packed, _ref_pack_e2m1(vals))  # low nibble first, sign in bit 3
    back = unpack_e2m1(packed, 37)
    assert torch.equal(back, vals) and torch.equal(back.signbit(), vals.signbit())
    assert torch.equal(pack_e2m1(vals.to(torch.float8_e4m3fn)), packed)  # the held form
    raw = torch.randint(0, 256, (9, 20), dtype=torch.uint8, generator=gen)
    assert torch.equal(unpack_e2m1(raw, 39), _ref_unpack_e2m1(raw, 39))
    assert torch.equal(raw.view(torch.float4_e2m1fn_x2).view(torch.uint8), raw)


def test_fp8_decode_table_is_the_cast():
    every = torch.arange(256, dtype=torch.uint8)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = every.view(dt).reshape(16, 16)
        want = codes.float()
        for c, w in ((codes, want), (codes.t(), want.t()), (codes[:, ::3], want[:, ::3])):
            got = decode(c)
            assert torch.equal(got.nan_to_num(), w.nan_to_num()), dt
            assert torch.equal(got.isnan(), w.isnan())
        scale = torch.tensor([[0.37]])
        assert torch.equal(decode(codes, scale).nan_to_num(), (want * scale).nan_to_num())


# -- the fast path changes no number ------------------------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS, ids=_sid)
def test_quantize_and_dequantize_equal_the_first_implementation(scaling):
    gen = torch.Generator().manual_seed(2)
    for shape, transposed in (((256, 512), False), ((512, 256), True), ((200, 300), False),
                              ((130, 257), True), ((1, 16), False)):
        cols = torch.logspace(-3, 3, shape[1])
        x = torch.randn(*shape, generator=gen) * cols
        if transposed:  # the weight-gradient casts read transposed views
            x = (torch.randn(shape[1], shape[0], generator=gen) * cols[:, None]).t()
        st, bad = quantize(x, scaling)
        codes, q, deq = _ref_quantize(x, scaling)
        assert torch.equal(st.q, q) and not bad
        assert torch.equal(st.data.float(), codes)
        assert torch.equal(st.data.float().signbit(), codes.signbit())
        assert torch.equal(dequantize(st), deq)


# -- scales -------------------------------------------------------------------------------

def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    return torch.frexp(a)[1] - 1  # exact: a = m 2^e with m in [0.5, 1)


def test_mx_scales_are_powers_of_two_and_the_amax_element_never_overflows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-40, 40, (64, 1),
                                                                       generator=gen))
    below = torch.nextafter(torch.exp2(torch.arange(-20.0, 20.0)), torch.tensor(0.0))
    x[:40, 0] = below  # amaxes one ulp below a power of two (log2 rounds up there)
    x[40, :32] = 3e38  # near fp32's largest
    st, bad = quantize(x, RECIPES["mxfp8"].input)
    mant, exp = torch.frexp(st.q)
    assert (mant == 0.5).all() and not bad  # powers of two
    assert ((exp - 1) >= -127).all() and ((exp - 1) <= 127).all()  # e8m0's range
    amax = x.abs().view(64, 8, 32).amax(-1)
    assert torch.equal(-(exp - 1), _floor_log2(amax) - 8)  # 2^(floor(log2 amax) - emax)
    codes = st.data.float()
    assert codes.isfinite().all() and codes.abs().max() <= 448.0
    assert dequantize(st).isfinite().all()


def test_nvfp4_tile_scales_are_e4m3_values_under_the_tensor_scale():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 128, generator=gen) * torch.exp2(torch.randint(-12, 4, (32, 8),
                                                                       generator=gen)
                                                         ).repeat_interleave(16, 1)
    st, _ = quantize(x, RECIPES["nvfp4"].input)
    g = (2688.0 / x.abs().amax().double()).float()
    s = (g / st.q).float()  # q = g / s: s is recovered to within an fp32 rounding
    e4m3 = s.to(torch.float8_e4m3fn).float()
    assert ((s - e4m3).abs() <= 2 ** -22 * e4m3).all()
    assert e4m3.max() == 448.0  # the tile holding the tensor's amax takes e4m3's largest
    assert set(st.data.float().abs().unique().tolist()) <= set(E2M1)


# -- zero, huge and non-finite tiles; partial tiles ---------------------------------------

@pytest.mark.parametrize("scaling", SCALINGS, ids=_sid)
def test_zero_tiles_give_zero_codes_and_finite_scales(scaling):
    for x in (torch.zeros(256, 256), torch.cat([torch.zeros(128, 256),
                                                torch.randn(128, 256)])):
        st, bad = quantize(x, scaling)
        assert not bad and st.q.isfinite().all()
        zero = x == 0
        assert (st.data.float()[zero] == 0).all()
        assert torch.equal(dequantize(st)[zero], x[zero])


@pytest.mark.parametrize("scaling", SCALINGS, ids=_sid)
def test_huge_finite_values_saturate_without_inf_or_nan(scaling):
    x = torch.randn(256, 256)
    x[3, 5], x[100, 7], x[200] = torch.finfo(torch.float32).max, -3e38, 1e30
    st, bad = quantize(x, scaling)
    assert not bad and st.q.isfinite().all() and st.data.float().isfinite().all()
    deq = dequantize(st)
    assert deq.isfinite().all()
    assert (deq.abs() <= x.abs().amax() * 1.0001).all()


@pytest.mark.parametrize("scaling", SCALINGS, ids=_sid)
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_inputs_set_the_flag_and_decode_to_nan(scaling, bad_value):
    x = torch.randn(256, 256)
    assert not quantize(x, scaling)[1]
    x[7, 9] = bad_value
    st, bad = quantize(x, scaling)
    assert bad.dim() == 0 and bool(bad)
    assert dequantize(st)[7, 9].isnan()  # never a finite number in its place


@pytest.mark.parametrize("scaling", [s for s in SCALINGS if s.granularity != "tensor"],
                         ids=_sid)
def test_partial_tiles_quantise_as_if_zero_padded(scaling):
    gen = torch.Generator().manual_seed(5)
    for shape in ((130, 200), (5, 37), (257, 129)):
        x = torch.randn(*shape, generator=gen)
        br, bc = scaling.tile(*shape)
        padded = F.pad(x, (0, -shape[1] % bc, 0, -shape[0] % br))
        st, _ = quantize(x, scaling)
        full, _ = quantize(padded, scaling)
        assert st.data.shape == shape and st.shape == shape
        assert torch.equal(st.q, full.q)  # padding zeros leave every amax as it was
        assert torch.equal(st.data.float(), full.data.float()[:shape[0], :shape[1]])
        assert torch.equal(dequantize(st), dequantize(full)[:shape[0], :shape[1]])
        y = x.clone()
        y[-1, -1] = 1e3  # the last, partial tile's scale follows its own elements only
        q2 = quantize(y, scaling)[0].q
        changed = (q2 != st.q).nonzero().tolist()
        if scaling.scale != "nvfp4":  # (NVFP4's tensor scale moves every tile's)
            assert changed == [[st.q.shape[0] - 1, st.q.shape[1] - 1]]


# -- the ScaledTensor ---------------------------------------------------------------------

def test_transposing_row_scaled_codes_is_refused():
    st, _ = quantize(torch.randn(32, 64), RECIPES["fp8_rowwise"].input)
    with pytest.raises(ValueError, match="cannot be transposed without requantising"):
        st.t()
    tw, _ = quantize(torch.randn(32, 64), RECIPES["fp8_tensorwise"].input)
    assert torch.equal(dequantize(tw.t()), dequantize(tw).t())


def test_nbytes_and_packed_report_real_storage():
    x = torch.randn(64, 96)
    nv, _ = quantize(x, RECIPES["nvfp4"].input)
    assert nv.data.dtype == torch.float8_e4m3fn  # held one per byte for the emulation
    packed = nv.packed()
    assert packed.dtype == torch.uint8 and packed.shape == (64, 48)
    assert torch.equal(unpack_e2m1(packed, 96), nv.data.float())
    assert nv.nbytes == 64 * 48 + 64 * 6 + 4  # nibbles, e4m3 tile scales, fp32 tensor scale
    odd, _ = quantize(torch.randn(3, 48), Scaling("e2m1", "block", (1, 16), "nvfp4"))
    assert odd.nbytes == 3 * 24 + 9 + 4
    mx, _ = quantize(x, RECIPES["mxfp8"].input)
    assert mx.nbytes == 64 * 96 + 64 * 3 and mx.packed() is mx.data  # e8m0 scales: 1 byte
    tw, _ = quantize(x, RECIPES["fp8_tensorwise"].input)
    assert tw.nbytes == 64 * 96 + 4
    row, _ = quantize(x, RECIPES["fp8_rowwise"].input)
    assert row.nbytes == 64 * 96 + 64 * 4


def test_quantize_and_the_emulated_matmul_make_no_host_sync():
    """Under FakeTensorMode a value reaching Python (.item(), a branch on a tensor) raises
    DataDependentOutputException; quantize, dequantize and the emulated matmul run."""
    old = set_kernel_policy("emulated")
    try:
        with FakeTensorMode():
            x, w = torch.randn(64, 200), torch.randn(48, 200)
            with pytest.raises(DataDependentOutputException):
                bool(x.sum() > 0)  # the mode does catch a sync
            with pytest.raises(DataDependentOutputException):
                x.amax().item()
            for scaling in SCALINGS:
                a, bad = quantize(x, scaling)
                b, _ = quantize(w, scaling)
                assert isinstance(a, ScaledTensor) and bad.shape == ()
                assert dequantize(a).shape == (64, 200)
                assert scaled_matmul(a, b, torch.float32).shape == (64, 48)
    finally:
        set_kernel_policy(old)
