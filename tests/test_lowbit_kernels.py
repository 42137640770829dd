"""Real low-bit kernels against the emulation, through the low-bit linear's autograd
function ([Note: real and emulated low-bit matmuls], [Note: CPU low-bit kernels]).

On this CPU ``torch._scaled_mm`` takes tensorwise and rowwise fp8 (and a tensorwise operand
beside a rowwise one, its scale repeated per row): the rowwise recipes give the emulation's
numbers bit for bit; fp8_tensorwise within the fp32 accumulation bound ([Note: accumulation
bound] in bench/lowbit_torchao.py: the e4m3 x e4m3 kernel sums in its own order; its
gradients, e5m2 x e4m3, come out bitwise). Blockwise,
MX and NVFP4 are refused here, so "real" falls back to the emulation for them, and the tests
say so rather than pass by accident.
"""

from __future__ import annotations

import pytest
import torch

from bench import lowbit_torchao as tao
from bench.lowbit_numerics import draw
from shardwise.parallel.lowbit import (RECIPES, get_recipe, quantize, real_kernel_available,
                                       set_kernel_policy)

CPU_TAKES = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")
SHAPES = [(64, 128, 96), (40, 256, 48)]  # (tokens, in, out); 40 tokens: not a multiple of 16


def _matmul_operands(recipe: str, x, w, dy) -> list:
    """The quantised operands of the three matmuls (None: that matmul is high precision)."""
    r = get_recipe(recipe)
    q = lambda t, s: quantize(t, s)[0]  # noqa: E731
    pairs = [(q(x, r.input), q(w, r.weight)), (q(dy, r.grad_output), q(w.t(), r.weight_gi))]
    pairs.append(None if r.grad_gw is None else (q(dy.t(), r.grad_gw), q(x.t(), r.input_gw)))
    return pairs


@pytest.fixture
def real_policy():
    old = set_kernel_policy("real")
    yield
    set_kernel_policy(old)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_cpu_takes_exactly_the_tensorwise_and_rowwise_recipes(recipe, real_policy):
    x, w, dy = draw("block", 64, 128, 96, seed=20)
    for pair in _matmul_operands(recipe, x, w, dy):
        if pair is not None:
            assert real_kernel_available(*pair, torch.float32) == (recipe in CPU_TAKES)
    set_kernel_policy("auto")  # auto emulates on CPUs
    assert not any(real_kernel_available(*p, torch.float32)
                   for p in _matmul_operands(recipe, x, w, dy) if p is not None)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_rowwise_real_kernel_equals_the_emulation_bit_for_bit(recipe, shape):
    x, w, dy = draw("gated", *shape, seed=21)
    real = tao.ours(recipe, x, w, dy, "real")
    emulated = tao.ours(recipe, x, w, dy, "emulated")
    for a, b in zip(real, emulated):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensorwise_real_kernel_within_the_accumulation_bound(shape, monkeypatch):
    x, w, dy = draw("block", *shape, seed=22)
    calls = []
    kernel = torch._scaled_mm

    def spy(*args, **kwargs):  # the real kernel runs; the spy only counts it
        calls.append(args[0].dtype)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    real = tao.ours("fp8_tensorwise", x, w, dy, "real")
    assert torch.float8_e4m3fn in calls, calls  # the e4m3 x e4m3 forward ran in the kernel
    monkeypatch.setattr(torch, "_scaled_mm", kernel)
    emulated = tao.ours("fp8_tensorwise", x, w, dy, "emulated")
    ops = tao.decoded_operands("fp8_tensorwise", x, w, dy)
    for q, a, b in zip(("output", "grad_input", "grad_weight"), real, emulated):
        bound = tao.accumulation_bound(*ops[q])
        assert ((a.double() - b.double()).abs() <= bound).all(), q
    # Whether the kernel's e4m3 sums land on the emulation's bits depends on the CPU's kernel
    # (they differed on AMD EPYC and match on an Intel Xeon with AVX512-FP16), so only the
    # bound and a relative 1e-5 are asserted, not the bits.
    for a, b in zip(real, emulated):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in CPU_TAKES])
def test_refused_recipes_run_the_emulation_under_the_real_policy(recipe):
    x, w, dy = draw("block", 64, 128, 128, seed=23)
    for a, b in zip(tao.ours(recipe, x, w, dy, "real"), tao.ours(recipe, x, w, dy, "emulated")):
        assert torch.equal(a, b)


def test_kernel_policy_refuses_unknown_names():
    with pytest.raises(ValueError, match="low-bit kernel policy 'fast', expected one of"):
        set_kernel_policy("fast")
