"""shardwise's low-bit recipes against torchao 0.18 on the same inputs (torchao is in the
``test`` extra; bench/lowbit_torchao.py holds the runners and [Note: accumulation bound]).

fp8_rowwise and fp8_rowwise_gw_hp equal torchao's emulated recipes bit for bit; mxfp8
equals torchao's MX linear bit for bit; fp8_tensorwise equals torchao's real path bit for
bit under our "real" policy and is within the fp32 accumulation bound otherwise (torchao's
emulation decodes by ``code / q``, ours and the kernel by ``code * (1 / q)``); torchao's
real rowwise path rounds an fp32 model's results to bf16, within one bf16 rounding.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchao.float8.float8_utils import amax_to_scale

from bench import lowbit_torchao as tao
from bench.lowbit_numerics import draw
from shardwise.parallel.lowbit import RECIPES, quantize

M, K, N = 128, 256, 384


@pytest.fixture(scope="module")
def operands():
    return draw("block", M, K, N, seed=11)


def _within(got, want, operands_q, bf16: bool = False) -> float:
    """Largest |got - want| as a fraction of the bound; asserts it is at most 1."""
    bound = tao.accumulation_bound(*operands_q, got if bf16 else None)
    frac = ((got.double() - want.double()).abs() / bound).max().item()
    assert frac <= 1.0, frac
    return frac


@pytest.mark.parametrize("policy", ["emulated", "real"])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_rowwise_recipes_equal_torchao_emulated_bit_for_bit(recipe, policy, operands):
    got = tao.ours(recipe, *operands, policy)
    want = tao.torchao_fp8(recipe, *operands, emulate=True)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("policy", ["emulated", "real"])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_rowwise_recipes_within_one_bf16_rounding_of_torchao_real(recipe, policy, operands):
    got = tao.ours(recipe, *operands, policy)
    want = tao.torchao_fp8(recipe, *operands, emulate=False)
    ops = tao.decoded_operands(recipe, *operands)
    for q, g, w in zip(("output", "grad_input", "grad_weight"), got, want):
        if q == "grad_weight" and recipe == "fp8_rowwise_gw_hp":
            assert torch.equal(g, w)  # high precision: torch.mm on both sides
        else:
            assert not torch.equal(g, w)  # torchao rounds to bf16 ...
            _within(g, w, ops[q], bf16=True)  # ... once


def test_tensorwise_equals_torchao_real_bit_for_bit_under_the_real_policy(operands):
    got = tao.ours("fp8_tensorwise", *operands, "real")
    want = tao.torchao_fp8("fp8_tensorwise", *operands, emulate=False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("emulate, policy", [(True, "emulated"), (True, "real"),
                                             (False, "emulated")])
def test_tensorwise_within_the_accumulation_bound_of_torchao(emulate, policy, operands):
    got = tao.ours("fp8_tensorwise", *operands, policy)
    want = tao.torchao_fp8("fp8_tensorwise", *operands, emulate=emulate)
    ops = tao.decoded_operands("fp8_tensorwise", *operands)
    for q, g, w in zip(("output", "grad_input", "grad_weight"), got, want):
        _within(g, w, ops[q])


def test_mxfp8_equals_torchao_mx_linear_bit_for_bit(operands):
    x, w, dy = (t.clone() for t in operands)
    below = torch.nextafter(torch.exp2(torch.arange(-8.0, 8.0)), torch.tensor(0.0))
    x[:16, 0] = below  # amaxes just below powers of two: the exponent-bits rule
    got = tao.ours("mxfp8", x, w, dy, "emulated")
    want = tao.torchao_mx(x, w, dy)
    for g, h in zip(got, want):
        assert torch.equal(g, h)


@pytest.mark.parametrize("recipe, role", [("fp8_tensorwise", "input"),
                                          ("fp8_tensorwise", "grad_output"),
                                          ("fp8_rowwise", "input")])
def test_tensor_and_row_multipliers_equal_torchao_amax_to_scale(recipe, role):
    scaling = getattr(RECIPES[recipe], role)
    gen = torch.Generator().manual_seed(12)
    amax = torch.exp2(torch.empty(300).uniform_(-60, 60, generator=gen))
    amax[:3] = torch.tensor([0.0, 1e-30, 2.0 ** 126])
    x = torch.empty(300, 64).uniform_(-1, 1, generator=gen) * amax[:, None]
    x[:, 0] = amax  # row r's amax is amax[r]
    dtype = torch.float8_e4m3fn if scaling.fmt == "e4m3" else torch.float8_e5m2
    pow2 = scaling.scale == "pow2"
    if scaling.granularity == "row":
        want = amax_to_scale(amax[:, None], dtype, pow2)
        assert torch.equal(quantize(x, scaling)[0].q, want)
    else:
        for r in (0, 1, 2, 50, 299):
            want = amax_to_scale(amax[r], dtype, pow2)
            assert torch.equal(quantize(x[r:r + 1], scaling)[0].q.reshape(()), want)


def test_nvfp4_codes_equal_torchao_quantiser_except_in_its_floored_tiles(operands):
    for t in operands:
        r = tao.nvfp4_comparison(t)
        assert r["floored_elements"] == 0 and r["codes_differ"] == 0
    gen = torch.Generator().manual_seed(13)
    wide = operands[0] * torch.exp2(-20 * torch.rand(M, 1, generator=gen))
    r = tao.nvfp4_comparison(wide)
    assert r["floored_elements"] > 0 and r["codes_differ"] > 0
    assert r["all_differences_in_floored_tiles"]


def test_torchao_blockwise_fp8_training_cannot_run_here():
    """Why fp8_blockwise has no torchao comparison (tao.BLOCKWISE_WHY): this fails, and asks
    for the comparison, once the prototype imports here."""
    with pytest.raises(ImportError, match="triton"):
        import torchao.prototype.blockwise_fp8_training.linear  # noqa: F401


def test_shardwise_never_imports_torchao():
    code = ("import sys, shardwise, shardwise.parallel.lowbit, shardwise.train; "
            "assert 'torchao' not in sys.modules, 'torchao imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
