"""The planner prices low-bit matmul recipes: the converted linears (those
``apply_low_precision`` converts), the casts (the bytes ``quantize`` moves), the saved codes
(what the low-bit linear saves), the multiplies at the dtype's rate where the device runs
the kernel, the fp8 gathers; the direction of each against bf16; the plan's words; and the
committed comparison with torchtitan's published speed-ups."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.models import build_model, get_model_config
from shardwise.parallel.lowbit import RECIPE_NAMES, RECIPES, dequantize, quantize
from shardwise.planner import Layout, Workload, get_hardware, get_model_spec
from shardwise.planner import recipe_cost
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.cost_model import CostModel
from shardwise.planner.dp_cost import gather_bytes, scale_sync_seconds, shard_numel
from shardwise.planner import comm_model
from shardwise.planner.recipe_cost import recipe_path, recipe_seconds
from shardwise.planner.recipe_work import (block_linears, cast_bytes, dequant_bytes,
                                           recipe_work, unit_split)
from shardwise.planner.stage_cost import StageCoster
from shardwise.planner.devices.registry import device_model
from shardwise.planner.work import layer_work
from shardwise.train.cli import main
from tests.planner_helpers import train_config

H100, A100, B200 = get_hardware("h100"), get_hardware("a100"), get_hardware("b200")
LLAMA8 = get_model_spec("llama3-8b")
ROOT = Path(__file__).resolve().parents[1]


def _low(hw, flops: float, dtype: str) -> float:
    """A multiply at ``dtype``'s peak paying bf16's fixed seconds a kernel (closed form)."""
    return flops / (hw.peak(dtype) * hw.matmul_max) + hw.matmul_half / (hw.peak("bf16")
                                                                        * hw.matmul_max)


def _step(spec, hw, recipe: str, fused: bool = True, seq: int = 8192, **layout) -> float:
    wl = Workload(seq_len=seq, global_batch=layout.get("dp_shard", 1)
                  * layout.get("microbatch", 1) * layout.get("pp_microbatches", 1),
                  matmul_recipe=recipe, fused_kernels=fused)
    return CostModel(spec, hw, wl).estimate(Layout(**layout), exact=True).step_time


# ------------------------------------------------------------------ the catalogue and paths
def test_catalogue_rates_are_the_datasheets():
    """H100 / H200 / H800: fp8 dense twice bf16; B200: fp8 twice and fp4 four times; A100: no
    fp8 and no low-bit kernels."""
    for name in ("h100", "h200", "h800"):
        hw = get_hardware(name)
        assert hw.peak("fp8") / hw.peak("bf16") == pytest.approx(2.0, rel=1e-3)
        assert set(hw.scaled_mm) == {"TensorWise", "RowWise", "BlockWise1x128"}
    assert B200.peak("fp8") == 2 * B200.peak("bf16") == 4.5e15
    assert B200.peak("fp4") == 4 * B200.peak("bf16")
    assert {"BlockWise1x32", "BlockWise1x16"} <= set(B200.scaled_mm)
    assert "fp8" not in A100.peak_flops and A100.scaled_mm == ()


def test_a_catalogue_kernel_must_be_a_scaled_mm_kind(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('[my-gpu]\nbase = "h100-sxm"\nscaled_mm = ["RowWize"]\n')
    with pytest.raises(ValueError, match="'RowWize' .*did you mean 'RowWise'"):
        get_hardware("my-gpu", catalogue=mine)


@pytest.mark.parametrize("hw,recipe,native,dtype", [
    (H100, "fp8_tensorwise", True, "fp8"), (H100, "fp8_rowwise", True, "fp8"),
    (H100, "fp8_rowwise_gw_hp", True, "fp8"), (H100, "fp8_blockwise", True, "fp8"),
    (H100, "mxfp8", False, "fp32"), (H100, "nvfp4", False, "fp32"),
    (B200, "mxfp8", True, "fp8"), (B200, "nvfp4", False, "fp32"),
    (A100, "fp8_tensorwise", False, "fp32"), (A100, "mxfp8", False, "fp32")])
def test_native_where_the_device_has_the_kernel_and_shardwise_calls_it(hw, recipe, native,
                                                                       dtype):
    path = recipe_path(hw, recipe)
    assert (path.native, path.dtype) == (native, dtype)
    assert path.words.startswith("native" if native else "emulated")
    if recipe == "nvfp4" and hw is B200:
        assert "does not call the NVFP4 kernel" in path.words


def test_nvfp4_on_b200_once_wired_runs_at_four_times_bf16(monkeypatch):
    monkeypatch.setattr(recipe_cost, "UNWIRED", {})
    path = recipe_path(B200, "nvfp4")
    assert path.native and path.dtype == "fp4" and "4.0x bf16" in path.words
    wl = Workload(seq_len=8192, global_batch=1, matmul_recipe="nvfp4", fused_kernels=True)
    w = _lowbit_layer(LLAMA8, wl)
    rs = recipe_seconds(B200, wl, w)
    assert rs.mm[0] == pytest.approx(sum(n * _low(B200, f, "fp4") for f, n in w.gemms))
    assert rs.hp[0] / 4 < rs.mm[0] < rs.hp[0] / 3.5  # each kernel's fixed cost stays


# ------------------------------------------------------------------ which linears
@pytest.mark.parametrize("name,tp,ep", [
    ("llama3-8b", 1, 1), ("llama3-8b", 2, 1), ("llama3-70b", 8, 1), ("gpt3-175b", 1, 1),
    ("gpt3-175b", 4, 1), ("deepseek-v3", 1, 1), ("deepseek-v3", 2, 4)])
def test_block_linears_are_the_layers_multiplies(name, tp, ep):
    """Per role, the converted-linear list multiplies the FLOPs work.py lists; their shapes
    are the spec's weights; the router is never one of them."""
    spec = get_model_spec(name)
    for moe in {False, spec.is_moe}:
        index = spec.n_layers - 1 if moe else 0
        lins = block_linears(spec, moe, 512, tp, ep)
        w = layer_work(spec, moe, 512, 512, tp, ep)
        roles = {}
        for (f, n), role in zip(w.gemms, w.gemm_roles, strict=True):
            roles[role] = roles.get(role, 0.0) + f * n
        mine = {}
        for x in lins:
            mine[x.role] = mine.get(x.role, 0.0) + x.flops
        assert mine == pytest.approx({r: v for r, v in roles.items() if r != "router"})
        assert ("router" in roles) == moe
        dense = sorted(x.shape for x in lins if x.role != "experts")
        want = [s for s in spec.attention_shapes(tp) + spec.ffn_shapes(index, tp, ep, False)
                if len(s) == 2]
        if moe:
            want.remove((spec.n_experts, spec.dim))
        assert dense == sorted(want)


MIXED = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=64, max_seq_len=64,
             ffn_dim=320, num_experts=4, top_k=2, num_shared_experts=1, moe_ffn_dim=128,
             moe_first_dense=1)
"""A model whose linears some recipes take and some not (wk and wv 64 wide, the MLP 320)."""


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_converted_and_skipped_as_apply_low_precision_does(recipe):
    cfg = get_model_config("debug", **MIXED)
    model = shardwise.apply_low_precision(build_model(cfg, seed=0), recipe)
    report = shardwise.low_precision_report(model)
    spec = from_llama_config(cfg, "mixed")
    for i in range(cfg.n_layers):
        rw = recipe_work(spec, spec.is_moe_layer(i), 64, 1, 1, recipe, 2, True)
        prefix = f"layers.{i}."
        want = {n[len(prefix):] for n in report.converted if n.startswith(prefix)}
        want_skipped = {n[len(prefix):]: why for n, why in report.skipped.items()
                        if n.startswith(prefix)}
        short = {_module(x.name) for x in rw.converted}
        assert short == want
        assert {_module(n): why for n, why in rw.skipped} == want_skipped


def _module(name: str) -> str:
    """A priced linear's module name in its block (the routed experts are one module)."""
    if name.startswith("experts."):
        return "feed_forward.experts"
    return ("attention." if name.startswith("w") and name[1] in "qkvo" else
            "feed_forward.") + name


# ------------------------------------------------------------------ casts
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fused_casts_read_once_and_write_codes_and_scales(recipe):
    """Read the high-precision tensor (twice with a tensor-wide scale, the amax pass), write
    the codes and one scale per tile."""
    r, (m, k) = RECIPES[recipe], (256, 1024)
    s = r.input
    codes = {8: 1.0, 4: 0.5}[r.element_bits]
    tiles = {"tensor": 1, "row": m}.get(s.granularity) or (m // s.block[0]) * (k // s.block[1])
    scale = {"fp32": 4, "pow2": 4, "e8m0": 1, "nvfp4": 1}[s.scale]
    amax = 2 if s.granularity == "tensor" or s.scale == "nvfp4" else 0
    want = m * k * (2 + codes + amax) + tiles * scale + (4 if s.scale == "nvfp4" else 0)
    assert cast_bytes(s, m, k, 2, fused=True) == want


class _Bytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes each operator reads and writes (distinct elements: a broadcast input counts
    once; an in-place operator reads and writes its tensor), views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if func.is_view or (any(a.alias_info for a in schema.returns) and not schema.is_mutable):
            return out
        flat = torch.utils._pytree.tree_flatten((args, kwargs, out))[0]
        self.n += sum(math.prod(s for s, st in zip(t.shape, t.stride()) if st) * t.element_size()
                      for t in flat if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_eager_casts_are_what_quantize_moves(recipe, dtype):
    """The eager counts ([Note: low-bit casts], [Note: emulated low-bit multiplies]) against
    the bytes ``quantize`` and ``dequantize`` move, operator by operator."""
    r = RECIPES[recipe]
    x = torch.randn(256, 1024).to(dtype)
    for s in {r.input, r.weight, r.grad_output}:
        with _Bytes() as cast:
            st, _ = quantize(x, s)
        with _Bytes() as deq:
            dequantize(st)
        a = torch.finfo(dtype).bits // 8
        assert cast_bytes(s, 256, 1024, a, fused=False) == pytest.approx(cast.n, rel=0.01)
        assert dequant_bytes(s, 256, 1024, fused=False) == pytest.approx(deq.n, rel=0.01)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_each_linear_casts_what_its_recipe_says(recipe):
    """Forward x and W; backward dy, the weight again (tensorwise, blockwise: the forward
    saved it in high precision) or W^T, and for the weight gradient dy^T and x^T, unless
    tensorwise reuses both or gw_hp multiplies it in high precision."""
    r = RECIPES[recipe]
    rw = recipe_work(LLAMA8, False, 64, 1, 1, recipe, 2, True)

    def cast(s, rows, cols):
        return cast_bytes(s, rows, cols, 2, True)

    fwd = bwd = 0.0
    for x in rw.converted:
        m, k, n = x.rows, x.k, x.n
        fwd += cast(r.input, m, k) + cast(r.weight, n, k)
        bwd += cast(r.grad_output, m, n)
        bwd += cast(r.weight, n, k) if recipe in ("fp8_tensorwise", "fp8_blockwise") \
            else cast(r.weight_gi, k, n)
        if recipe not in ("fp8_tensorwise", "fp8_rowwise_gw_hp"):
            bwd += cast(r.grad_gw, n, m) + cast(r.input_gw, k, m)
    assert len(rw.converted) == 7
    assert (rw.cast_fwd, rw.cast_bwd) == pytest.approx((fwd, bwd))


def test_weights_offered_by_fp8_gathers_are_not_cast_in_the_layer():
    spec = LLAMA8
    plain = recipe_work(spec, False, 8192, 1, 1, "fp8_tensorwise", 2, True)
    offered = recipe_work(spec, False, 8192, 1, 1, "fp8_tensorwise", 2, True, offered=True)
    weights = sum(cast_bytes(RECIPES["fp8_tensorwise"].weight, x.n, x.k, 2, True)
                  for x in plain.converted)
    assert plain.cast_fwd - offered.cast_fwd == pytest.approx(weights)
    assert plain.cast_bwd - offered.cast_bwd == pytest.approx(weights)
    with pytest.raises(ValueError, match="fp8_tensorwise"):
        recipe_work(spec, False, 8192, 1, 1, "fp8_rowwise", 2, True, offered=True)


# ------------------------------------------------------------------ saved activations
def _saved_bytes(cfg, recipe: str | None, tokens: int) -> int:
    """Bytes a bf16 block saves for backward (parameters and its input left out)."""
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    if recipe:
        shardwise.apply_low_precision(model, recipe)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    x = torch.randn(1, tokens, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own and ptr != x.untyped_storage().data_ptr():
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    cos, sin = model.rope(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin)
    return sum(kept.values())


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_saved_codes_are_what_the_low_bit_linear_saves(recipe):
    """[Note: what a recipe saves] against a bf16 block run with and without the recipe."""
    cfg = get_model_config("debug", dim=128, n_layers=1, n_heads=4, n_kv_heads=2,
                           vocab_size=64, max_seq_len=128, multiple_of=64)
    spec = from_llama_config(cfg, "block")
    measured = _saved_bytes(cfg, recipe, 128) - _saved_bytes(cfg, None, 128)
    rw = recipe_work(spec, False, 128, 1, 1, recipe, 2, False, attn_keeps_output=True)
    assert rw.saved_delta == measured
    assert (measured < 0) == (recipe == "fp8_tensorwise")


def test_saved_codes_enter_the_memory_only_without_checkpointing():
    """A Llama block keeps 2 dim - ffn_dim bytes a token fewer (tensorwise, ac none)."""
    d, f, t = LLAMA8.dim, LLAMA8.ffn_dim, 8192
    rows = {}
    for recipe in ("none", "fp8_tensorwise", "fp8_rowwise"):
        wl = Workload(seq_len=t, global_batch=1, matmul_recipe=recipe, fused_kernels=True)
        sc = StageCoster(LLAMA8, device_model(H100), wl)
        rows[recipe] = {ac: sc.layer(False, 1, 1, False, 1, 1, ac).saved
                        for ac in ("none", "selective", "full")}
    codes = 7 * 4  # a 4-byte scale per linear
    assert rows["fp8_tensorwise"]["none"] - rows["none"]["none"] == (2 * d - f) * t + codes
    for ac in ("selective", "full"):
        assert rows["fp8_tensorwise"][ac] == rows["none"][ac]
    assert rows["fp8_rowwise"] == rows["none"]


# ------------------------------------------------------------------ multiplies
def _lowbit_layer(spec, wl, moe: bool = False):
    sc = StageCoster(spec, device_model(H100), wl)
    return sc.work(moe, 1, 1, False, 1, 1)[0]


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_multiplies_move_to_the_fp8_rate_only_for_converted_linears(recipe):
    """The layer's linears at fp8 (the weight gradient's in bf16 for gw_hp), the head and
    embedding unchanged: a whole rank's forward moves by the layers' deltas alone."""
    wl = Workload(seq_len=8192, global_batch=1, matmul_recipe=recipe, fused_kernels=True)
    w = _lowbit_layer(LLAMA8, wl)
    rs = recipe_seconds(H100, wl, w)
    fp8 = sum(n * _low(H100, f, "fp8") for f, n in w.gemms)
    bf16 = sum(n * H100.matmul_time(f, "bf16") for f, n in w.gemms)
    assert rs.mm[:2] == pytest.approx((fp8, fp8)) and rs.hp == pytest.approx((bf16,) * 3)
    assert rs.mm[2] == pytest.approx(bf16 if recipe == "fp8_rowwise_gw_hp" else fp8)
    assert rs.wgrad == pytest.approx(0.0 if recipe == "fp8_rowwise_gw_hp" else fp8 - bf16)
    none = dataclasses.replace(wl, matmul_recipe="none")
    layers = list(range(LLAMA8.n_layers))
    with_r = StageCoster(LLAMA8, device_model(H100), wl).rank(Layout(), layers, True, True)
    without = StageCoster(LLAMA8, device_model(H100), none).rank(Layout(), layers, True, True)
    assert with_r.fwd - without.fwd == pytest.approx(LLAMA8.n_layers * rs.fwd)
    assert with_r.bwd - without.bwd == pytest.approx(LLAMA8.n_layers * rs.bwd)
    assert with_r.model_flops == without.model_flops  # FLOPs are FLOPs


def test_a_routers_multiply_stays_in_high_precision():
    spec = get_model_spec("deepseek-v3")
    wl = Workload(seq_len=4096, global_batch=1, matmul_recipe="fp8_tensorwise")
    w = _lowbit_layer(spec, wl, moe=True)
    assert "router" in w.gemm_roles and "router" not in w.lowbit.share
    rs = recipe_seconds(H100, wl, w)
    linears = [(f, n) for (f, n), role in zip(w.gemms, w.gemm_roles) if role != "router"]
    assert rs.mm[0] == pytest.approx(sum(n * _low(H100, f, "fp8") for f, n in linears))


# ------------------------------------------------------------------ fp8 gathers
@pytest.mark.parametrize("world", [8, 7])
def test_fp8_gathers_halve_the_converted_bytes_exactly(world):
    """fp8_tensorwise with comm_weights=fp8 at stage 3: converted weights a byte an element,
    half of bf16 to the byte (padding included), the rest as the fp8 codec moves it; the
    scales agreed in one all-reduce of 4 bytes a converted weight a step."""
    wl = Workload(seq_len=8192, global_batch=world, matmul_recipe="fp8_tensorwise")
    cm = CostModel(LLAMA8, H100, wl)
    L = Layout(dp_shard=world, zero=3, comm_weights="fp8")
    split = unit_split(LLAMA8, [0], 1, 1, "fp8_tensorwise")
    unit = tuple(LLAMA8.block_shapes(0))
    conv, rest = split[unit]
    assert len(conv) == 7 and sorted(rest) == [(LLAMA8.dim,)] * 2  # the two norms
    fp8 = gather_bytes(cm, L, unit, world, split)
    # the norms travel unquantised in the compute dtype, as the engine sends them
    assert fp8 == shard_numel(conv, world) + 2 * shard_numel(rest, world)
    bf16 = gather_bytes(cm, L.replace(comm_weights="fp"), unit, world, {})
    assert 2 * shard_numel(conv, world) == bf16 - 2 * shard_numel(rest, world)
    layers = list(range(LLAMA8.n_layers))
    grp = comm_model.place(world, 1, H100.gpus_per_node)
    numel = LLAMA8.n_layers * shard_numel(conv, world)
    assert scale_sync_seconds(cm, L, layers, True, True) == pytest.approx(
        H100.memory_time(4 * numel)
        + comm_model.all_reduce_time(4 * 7 * LLAMA8.n_layers, grp, H100))
    for other in (L.replace(zero=2), L.replace(comm_weights="int8")):
        assert scale_sync_seconds(cm, other, layers, True, True) == 0.0
    rowwise = CostModel(LLAMA8, H100, dataclasses.replace(wl, matmul_recipe="fp8_rowwise"))
    assert scale_sync_seconds(rowwise, L, layers, True, True) == 0.0


def test_fp8_gathers_shorten_the_step():
    on = _step(LLAMA8, H100, "fp8_tensorwise", dp_shard=8, zero=3, microbatch=1,
               ac="selective", comm_weights="fp8")
    off = _step(LLAMA8, H100, "fp8_tensorwise", dp_shard=8, zero=3, microbatch=1,
                ac="selective")
    assert on < off


# ------------------------------------------------------------------ directions
def test_fp8_beats_bf16_on_h100_for_a_compute_bound_8b_layout():
    kw = dict(dp_shard=8, zero=3, microbatch=2, ac="selective")
    bf16 = _step(LLAMA8, H100, "none", **kw)
    for recipe in ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"):
        assert _step(LLAMA8, H100, recipe, **kw) < 0.9 * bf16, recipe
    assert _step(LLAMA8, H100, "fp8_tensorwise", comm_weights="fp8", **kw) < 0.8 * bf16


@pytest.mark.parametrize("fused", [True, False])
def test_casts_dominate_small_multiplies(fused):
    """A 256-wide model on 128-token micro-batches: the casts cost more than fp8 saves."""
    spec = dataclasses.replace(get_model_spec("debug"), dim=256, ffn_dim=768, n_heads=4,
                               n_kv_heads=4)
    bf16 = _step(spec, H100, "none", fused, seq=128, microbatch=1)
    for recipe in RECIPE_NAMES:
        assert _step(spec, H100, recipe, fused, seq=128, microbatch=1) >= bf16, recipe


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout", [dict(dp_shard=8, zero=3, microbatch=1, ac="none"),
                                    dict(dp_shard=4, tp=2, sp=True, zero=1, microbatch=2,
                                         ac="full")])
def test_emulated_on_a100_is_never_faster(fused, layout):
    bf16 = _step(LLAMA8, A100, "none", fused, seq=4096, **layout)
    for recipe in RECIPE_NAMES:
        assert _step(LLAMA8, A100, recipe, fused, seq=4096, **layout) > bf16, recipe


# ------------------------------------------------------------------ the plan
JOB = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch",
       "16", "--fused-kernels", "--layout", "zero=3,dp_shard=8,comm_weights=fp8", "--top", "2"]


def test_plan_prints_the_recipe_and_its_priced_parts(capsys):
    assert main(JOB + ["--hardware", "h100", "--matmul-recipe", "fp8_tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "matmul recipe fp8_tensorwise on h100-sxm: native: TensorWise fp8 kernels" in out
    assert "converts wq, wk, wv, wo, w1, w3, w2 in every block" in out
    assert "converted multiplies" in out and "casts and amax passes" in out
    assert "the converted weights as fp8 codes" in out and "896-byte all-reduce" in out
    assert main(JOB + ["--hardware", "a100", "--matmul-recipe", "fp8_rowwise"]) == 0
    out = capsys.readouterr().out
    assert "emulated (a100-80gb has no low-bit kernels)" in out and "dequantisations" in out


def test_plan_json_carries_the_recipe(capsys):
    assert main(JOB + ["--hardware", "h100", "--matmul-recipe", "fp8_tensorwise",
                       "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    for rec in records:
        s = rec["matmul_recipe"]
        assert s["native"] and s["dtype"] == "fp8"
        assert s["multiplies_hp_s"] / 2 < s["multiplies_s"] < s["multiplies_hp_s"] / 1.9
        # converted weights at a byte, the embedding and head (1.05B of 8.03B parameters)
        # unquantised: (6.98 + 2 * 1.05) / (2 * 8.03) = 0.565 of the bf16 bytes
        assert 0.55 < s["gather_round_bytes"] / s["gather_round_hp_bytes"] < 0.58
        assert s["step_s"] == pytest.approx(rec["step_time_s"])
        assert s["step_s"] < s["step_without_s"]
    assert main(JOB + ["--hardware", "h100", "--json"]) == 0
    assert all("matmul_recipe" not in r for r in json.loads(capsys.readouterr().out))


def test_plan_refuses_an_unknown_recipe_naming_it(capsys):
    assert main(JOB + ["--hardware", "h100", "--matmul-recipe", "fp8_tensorwse"]) == 2
    assert "'fp8_tensorwse' (did you mean 'fp8_tensorwise'?)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="compute_dtype='fp8'"):
        Workload(seq_len=8, global_batch=1, compute_dtype="fp8", matmul_recipe="mxfp8")


def test_search_tries_fp8_gathers_under_tensorwise():
    from shardwise.planner.search import search
    wl = Workload(seq_len=8192, global_batch=16, matmul_recipe="fp8_tensorwise",
                  fused_kernels=True)
    ranked = search(LLAMA8, H100, wl, 8, {"zero": 3, "dp_shard": 8}).ranked
    assert any(e.layout.comm_weights == "fp8" for e in ranked)
    none = search(LLAMA8, H100, dataclasses.replace(wl, matmul_recipe="fp8_rowwise"), 8,
                  {"zero": 3, "dp_shard": 8}).ranked
    assert all(e.layout.comm_weights != "fp8" for e in none)


@pytest.mark.parametrize("matmul,want", [("bf16", "none"), ("fp8_rowwise", "fp8_rowwise")])
def test_the_trainers_plan_prices_the_runs_recipe(matmul, want):
    from shardwise.train import plan_layout
    cfg = train_config(2, **{"model.name": "debug", "precision.matmul": matmul})
    _, _, wl = plan_layout.planner_inputs(cfg, get_model_config("debug"), H100)
    assert wl.matmul_recipe == want


def test_committed_comparison_is_the_bench_output():
    from bench.planner_lowbit import report
    text = report()
    assert (ROOT / "bench" / "results" / "planner_lowbit.md").read_text() == text
    assert "| fp8_tensorwise, fp8 all-gathers | 7,186 | 1.248 |" in text


def test_cpu_ranks_run_every_recipe_emulated():
    """On CPU ranks (fp32 compute) the emulated multiplies take what fp32 ones take; the
    casts and dequantisations are what the recipe adds."""
    from tests.planner_helpers import local_cpu
    hw, spec = local_cpu(cores=2), get_model_spec("debug")
    base = Workload(seq_len=128, global_batch=8, compute_dtype="fp32")
    plain = CostModel(spec, hw, base).estimate(Layout(dp_shard=2, microbatch=4), exact=True)
    for recipe in RECIPE_NAMES:
        wl = dataclasses.replace(base, matmul_recipe=recipe)
        assert not recipe_path(hw, recipe).native
        sc = StageCoster(spec, device_model(hw), wl)
        w = sc.work(False, 1, 1, False, 1, 4)[0]
        rs = recipe_seconds(hw, wl, w)
        assert rs.mm == pytest.approx(rs.hp) and rs.cast_fwd > 0 and rs.cast_bwd > 0
        est = CostModel(spec, hw, wl).estimate(Layout(dp_shard=2, microbatch=4), exact=True)
        assert est.step_time > plain.step_time, recipe
