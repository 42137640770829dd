"""``shardwise.apply_low_precision``: which layers it converts, what it skips and lists, what
it refuses, and that a converted layer computes exactly the recipe's casts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.models import build_model, get_model_config
from shardwise.parallel import lowbit
from shardwise.parallel.lowbit import (RECIPE_NAMES, dequantize, get_recipe,
                                       low_precision_report, lowbit_modules, quantize)

BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _debug(name: str = "debug", **over) -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_model_config(name, **over))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_dense_model_converts_exactly_the_block_linears(recipe):
    model = shardwise.apply_low_precision(_debug(), recipe)
    report = low_precision_report(model)
    want = [f"layers.{i}.{n}" for i in range(4) for n in BLOCK_LINEARS]
    assert sorted(report.converted) == sorted(want) and report.skipped == {}
    assert report.recipe == recipe
    names = {n for n, _, _ in lowbit_modules(model)}
    assert names == set(want)
    for keep in ("tok_embeddings", "output", "norm", "layers.0.attention_norm"):
        assert lowbit.lowbit_state(model.get_submodule(keep)) is None
    # still the user's module: same names, same fp32 parameters, Linear subclasses
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert isinstance(model.layers[0].attention.wq, nn.Linear)
    assert list(dict(model.named_parameters())) == list(dict(_debug().named_parameters()))


def test_moe_converts_experts_and_keeps_the_router_gate():
    model = shardwise.apply_low_precision(_debug("debug-moe"), "fp8_rowwise")
    report = low_precision_report(model)
    assert "layers.0.feed_forward.experts" in report.converted
    assert not any("router" in n or "gate" in n for n in report.converted)
    assert lowbit.lowbit_state(model.layers[0].feed_forward.router.gate) is None
    assert type(model.layers[0].feed_forward.experts).__name__ == "LowBitGroupedExperts"


def test_skip_patterns_keep_layers_high_and_are_listed():
    model = shardwise.apply_low_precision(_debug(), "fp8_tensorwise",
                                          skip=["layers.0.*", "*.w2"])
    report = low_precision_report(model)
    assert "layers.0.attention.wq" in report.skipped
    assert report.skipped["layers.0.attention.wq"] == "matches skip pattern 'layers.0.*'"
    assert report.skipped["layers.2.feed_forward.w2"] == "matches skip pattern '*.w2'"
    assert len(report.converted) == 3 * 6
    assert "7 kept in high precision" not in report.summary()
    assert f"{len(report.skipped)} kept in high precision" in report.summary()
    # a skipped layer runs F.linear: bitwise the unconverted model's layer
    x = torch.randn(2, 5, 256)
    ref = _debug()
    assert torch.equal(model.layers[0].attention.wq(x), ref.layers[0].attention.wq(x))


def test_shapes_a_recipe_cannot_take_are_skipped_and_listed_not_a_crash():
    # dim 96 with 6 heads of 16: fp8 (multiples of 16) converts everything, fp8_blockwise
    # (multiples of 128) nothing but the 256-wide FFN inputs it cannot take either
    over = dict(dim=96, n_heads=6, n_kv_heads=3, multiple_of=64)
    fp8 = low_precision_report(shardwise.apply_low_precision(_debug(**over), "fp8_rowwise"))
    assert fp8.skipped == {} and len(fp8.converted) == 28
    blk = shardwise.apply_low_precision(_debug(**over), "fp8_blockwise")
    report = low_precision_report(blk)
    assert report.converted == []
    why = report.skipped["layers.0.attention.wq"]
    assert "fp8_blockwise needs features divisible by 128" in why and "in_features 96" in why
    out = blk(torch.randint(0, 256, (1, 8)))  # runs, in high precision
    assert torch.isfinite(out).all()


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp9' is not one of"):
        shardwise.apply_low_precision(_debug(), "fp9")
    with pytest.raises(ValueError, match="iterable of name patterns"):
        shardwise.apply_low_precision(_debug(), "fp8_rowwise", skip="layers.0.*")
    model = shardwise.apply_low_precision(_debug(), "fp8_rowwise")
    with pytest.raises(ValueError, match="already converted to fp8_rowwise"):
        shardwise.apply_low_precision(model, "mxfp8")


def test_refused_after_shard():
    from shardwise.testing import run_ranks
    assert run_ranks(_apply_after_shard, 1) == ["refused"]


def _apply_after_shard():
    from shardwise.models import TransformerBlock
    model = shardwise.shard(_debug(), stage=3, wrap={TransformerBlock})
    try:
        shardwise.apply_low_precision(model, "fp8_rowwise")
    except ValueError as e:
        assert "before shard" in str(e)
        return "refused"
    return "accepted"


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_converted_layer_computes_the_recipes_casts(recipe):
    """The forward equals dequant(cast(x)) @ dequant(cast(W)).T computed here from the
    codec alone, and the input gradient dequant(cast(dy)) @ dequant(cast(W^T)).T."""
    rec = get_recipe(recipe)
    torch.manual_seed(1)
    lin = nn.Linear(256, 128, bias=False)
    shardwise.apply_low_precision(nn.ModuleList([nn.Sequential(lin)]), recipe)
    x = torch.randn(3, 7, 256, requires_grad=True)
    y = lin(x)
    x2 = x.detach().reshape(-1, 256)
    want = dequantize(quantize(x2, rec.input)[0]) @ dequantize(quantize(lin.weight.detach(),
                                                                        rec.weight)[0]).t()
    torch.testing.assert_close(y.detach().reshape(-1, 128), want, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    dy2 = dy.reshape(-1, 128)
    want_dx = dequantize(quantize(dy2, rec.grad_output)[0]) @ dequantize(
        quantize(lin.weight.detach().t(), rec.weight_gi)[0]).t()
    torch.testing.assert_close(x.grad.reshape(-1, 256), want_dx, rtol=1e-6, atol=1e-6)
    if rec.grad_gw is None:
        want_dw = dy2.t() @ x2
    else:
        want_dw = dequantize(quantize(dy2.t(), rec.grad_gw)[0]) @ dequantize(
            quantize(x2.t(), rec.input_gw)[0]).t()
    torch.testing.assert_close(lin.weight.grad, want_dw, rtol=1e-6, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_input_gradient_still_flows():
    lin = nn.Linear(64, 32, bias=True)
    lin.weight.requires_grad_(False)
    shardwise.apply_low_precision(nn.ModuleList([nn.Sequential(lin)]), "fp8_rowwise")
    x = torch.randn(4, 64, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is None and x.grad is not None and lin.bias.grad is not None


def test_hugging_face_llama_from_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    shardwise.apply_low_precision(model, "fp8_rowwise")
    report = low_precision_report(model)
    assert len(report.converted) == 2 * 7 and report.skipped == {}
    assert all(n.startswith("model.layers.") for n in report.converted)
    assert lowbit.lowbit_state(model.lm_head) is None
    out = model(torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16)))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.model.layers[0].self_attn.q_proj.weight.grad \
        is not None
