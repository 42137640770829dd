"""shardwise.models: shapes, causality, GQA, tied weights, counts, FLOPs, init contract, errors."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import shardwise.models as models
from shardwise.models import (
    LlamaConfig,
    Transformer,
    TransformerBlock,
    build_model,
    get_model_config,
    init_module_weights,
    list_model_configs,
)
from shardwise.models.llama import apply_rotary, rope_tables


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny(**overrides) -> LlamaConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                max_seq_len=16)
    return LlamaConfig(**{**base, **overrides})


def tokens(cfg: LlamaConfig, batch: int = 2, seq_len: int | None = None, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len or cfg.max_seq_len), generator=gen)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


# --- shapes, causality, attention ------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_forward_shape_and_structure(tie, n_kv_heads):
    cfg = tiny(tie_embeddings=tie, n_kv_heads=n_kv_heads)
    model = build_model(cfg)
    logits = model(tokens(cfg, batch=3, seq_len=5))
    assert logits.shape == (3, 5, cfg.vocab_size) and logits.dtype == torch.float32
    assert isinstance(model.layers, nn.ModuleList)
    assert all(isinstance(layer, TransformerBlock) for layer in model.layers)
    expected = {"tok_embeddings.weight", "norm.weight"} | (set() if tie else {"output.weight"})
    for i in range(cfg.n_layers):
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
    assert set(dict(model.named_parameters())) == expected
    assert set(model.state_dict()) == expected  # RoPE tables are not persistent


def test_causal_future_tokens_do_not_change_past_logits():
    cfg = tiny()
    model = build_model(cfg)
    x = tokens(cfg)
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 1) % cfg.vocab_size
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_naive_repeated_kv_attention(n_kv_heads):
    cfg = tiny(n_kv_heads=n_kv_heads)
    attn = build_model(cfg).layers[0].attention
    x = torch.randn(2, 7, cfg.dim)
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    cos, sin = cos[:7], sin[:7]
    hd, rep = cfg.head_dim, cfg.n_heads // n_kv_heads
    q = apply_rotary((x @ attn.wq.weight.T).view(2, 7, cfg.n_heads, hd), cos, sin).transpose(1, 2)
    k = apply_rotary((x @ attn.wk.weight.T).view(2, 7, n_kv_heads, hd), cos, sin).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(2, 7, n_kv_heads, hd).transpose(1, 2)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # head h -> kv h//rep
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    naive = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, cfg.dim) @ attn.wo.weight.T
    torch.testing.assert_close(attn(x, cos, sin), naive, rtol=1e-5, atol=1e-6)


def test_rope_rotates_pairs_and_preserves_norm():
    cos, sin = rope_tables(8, 16, 10000.0)
    assert cos.dtype == torch.float32 and cos.shape == (16, 4)
    torch.testing.assert_close(cos[3, 0], torch.tensor(math.cos(3.0)))  # pair 0: 1 rad/token
    x = torch.randn(1, 16, 2, 8)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[:, 0], x[:, 0])  # position 0 is not rotated
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


# --- tied embeddings -------------------------------------------------------------------------


def test_tied_embeddings_share_one_parameter_and_sum_gradients():
    cfg = tiny(tie_embeddings=True)
    tied = build_model(cfg)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert sum(p.numel() for p in tied.parameters()) == cfg.num_params()
    assert cfg.num_params() == tiny().num_params() - cfg.vocab_size * cfg.dim
    # Untied twin with the same values: the tied gradient is the sum of the two uses.
    untied = build_model(dataclasses.replace(cfg, tie_embeddings=False))
    untied.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        untied.output.weight.copy_(tied.tok_embeddings.weight)
    x = tokens(cfg)
    torch.testing.assert_close(tied(x), untied(x), rtol=0, atol=0)
    tied(x).square().mean().backward()
    untied(x).square().mean().backward()
    expected = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, expected, rtol=1e-5, atol=1e-8)


def test_tie_survives_dtype_and_device_moves():
    model = build_model(tiny(tie_embeddings=True)).to(torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.dtype == torch.bfloat16


# --- counts and FLOPs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_model_configs())
def test_registered_config_param_count_matches_meta_model(name):
    cfg = get_model_config(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("name, billions, ffn", [
    ("llama3-8b", 8.03, 14336), ("llama3-70b", 70.55, 28672), ("llama3-405b", 405.85, 53248),
])
def test_llama3_shapes_match_published_sizes(name, billions, ffn):
    cfg = get_model_config(name)
    assert cfg.ffn_hidden_dim == ffn
    assert (cfg.vocab_size, cfg.rope_theta, cfg.n_kv_heads) == (128256, 500000.0, 8)
    assert round(cfg.num_params() / 1e9, 2) == billions


def test_debug_and_small_sizes():
    assert 1e6 < get_model_config("debug").num_params() < 10e6
    assert 25e6 < get_model_config("small").num_params() < 50e6


@pytest.mark.parametrize("overrides", [
    {}, {"tie_embeddings": True}, {"ffn_dim": 40}, {"ffn_dim_multiplier": 1.3},
    {"n_kv_heads": 4}, {"n_kv_heads": 1, "n_layers": 3, "vocab_size": 50},
])
def test_num_params_is_exact(overrides):
    cfg = tiny(**overrides)
    model = build_model(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_equals_counted_flops(tie):
    # The math backend decomposes attention into matmuls the flop counter sees.
    cfg = tiny(tie_embeddings=tie)
    model = build_model(cfg)
    batch, seq_len = 2, 12
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens(cfg, batch, seq_len)).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(seq_len) * batch * seq_len


def test_flops_formula():
    cfg = get_model_config("llama3-8b")
    matmul = cfg.num_params() - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    assert cfg.flops_per_token(2048) == 6 * matmul + 12 * cfg.n_layers * cfg.dim * 2048
    assert cfg.flops_per_token() == cfg.flops_per_token(cfg.max_seq_len)
    # Tying removes a parameter, not a matmul.
    assert tiny(tie_embeddings=True).flops_per_token(8) == tiny().flops_per_token(8)
    with pytest.raises(ValueError, match="seq_len=0"):
        cfg.flops_per_token(0)


# --- init contract ---------------------------------------------------------------------------


def materialise_module_by_module(cfg: LlamaConfig, seed: int) -> Transformer:
    """What the sharding engine does: meta build, then per module (recurse=False)."""
    model = build_model(cfg, device="meta")
    torch.manual_seed(seed)
    for _, module in model.named_modules():
        module.to_empty(device="cpu", recurse=False)
        init_module_weights(module)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_meta_module_by_module_materialisation_is_bitwise_eager(tie):
    cfg = tiny(tie_embeddings=tie, n_layers=3)
    eager = build_model(cfg, device="cpu", seed=7)
    lazy = materialise_module_by_module(cfg, seed=7)
    a, b = tensors(eager), tensors(lazy)
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].device.type == "cpu" and b[name].dtype == a[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    if tie:
        assert lazy.output.weight is lazy.tok_embeddings.weight
    x = tokens(cfg)
    assert torch.equal(eager(x), lazy(x))


def test_meta_build_uses_no_rng_and_no_storage():
    state = torch.get_rng_state()
    model = build_model(get_model_config("llama3-8b"), device="meta")
    assert torch.equal(state, torch.get_rng_state())
    assert all(t.is_meta for t in tensors(model).values())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_build_model_is_seeded_and_init_weights_matches():
    cfg = tiny()
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    torch.manual_seed(3)
    c.init_weights()
    assert all(torch.equal(a.state_dict()[k], c.state_dict()[k]) for k in a.state_dict())


def test_init_distribution():
    cfg = tiny(dim=64, n_heads=4, n_kv_heads=4, n_layers=8, init_std=0.05)
    model = build_model(cfg)
    block = model.layers[0]
    assert torch.equal(block.attention_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    expected_std = [(block.attention.wq.weight, cfg.init_std), (model.output.weight, cfg.init_std),
                    (block.attention.wo.weight, scaled), (block.feed_forward.w2.weight, scaled)]
    for weight, std in expected_std:
        assert abs(weight.std().item() / std - 1) < 0.1
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    assert torch.equal(model.rope.cos, cos) and torch.equal(model.rope.sin, sin)


def test_init_module_weights_rejects_foreign_module_with_params():
    with pytest.raises(ValueError, match="Linear.*init_std"):
        init_module_weights(nn.Linear(2, 2))
    init_module_weights(nn.ReLU())  # nothing to initialise: a no-op


def test_rope_buffers_stay_fp32_in_bf16():
    cfg = tiny()
    model = build_model(cfg)
    cos = model.rope.cos.clone()
    model.to(torch.bfloat16)
    assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32
    assert torch.equal(model.rope.cos, cos)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    logits = model(tokens(cfg))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    model.half()
    assert model.rope.cos.dtype == torch.float32


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    ({"dim": 30}, "dim=30"),
    ({"n_kv_heads": 3}, "n_kv_heads=3"),
    ({"dim": 24, "n_heads": 8, "n_kv_heads": 8}, "head_dim=dim/n_heads=24/8=3"),
    ({"dim": 0}, "dim=0"),
    ({"n_layers": -1}, "n_layers=-1"),
    ({"vocab_size": 2.5}, "vocab_size=2.5"),
    ({"max_seq_len": True}, "max_seq_len=True"),
    ({"ffn_dim": 0}, "ffn_dim=0"),
    ({"norm_eps": 0.0}, "norm_eps=0.0"),
    ({"rope_theta": float("nan")}, "rope_theta=nan"),
    ({"ffn_dim_multiplier": -1.0}, "ffn_dim_multiplier=-1.0"),
    ({"tie_embeddings": 1}, "tie_embeddings=1"),
])
def test_bad_config_names_the_value(overrides, needle):
    with pytest.raises(ValueError) as info:
        tiny(**overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize("bad, needle", [
    (torch.zeros(2, 4), "torch.float32"),
    (torch.zeros(8, dtype=torch.long), "(8,)"),
    (torch.zeros(2, 17, dtype=torch.long), "sequence length 17"),
])
def test_bad_input_names_the_value(bad, needle):
    model = build_model(tiny())
    with pytest.raises(ValueError) as info:
        model(bad)
    assert needle in str(info.value)
    if "sequence" in needle:
        assert "max_seq_len=16" in str(info.value)


def test_registry_lookup_and_errors():
    assert list_model_configs()[:3] == ["debug", "debug-moe", "small"]
    assert {"llama3-8b", "llama3-70b", "llama3-405b"} <= set(list_model_configs())
    cfg = get_model_config("debug", vocab_size=512)
    assert cfg.vocab_size == 512 and get_model_config("debug").vocab_size == 256
    with pytest.raises(ValueError) as info:
        get_model_config("llama3-8")
    assert "'llama3-8'" in str(info.value) and "did you mean 'llama3-8b'" in str(info.value)
    assert "debug" in str(info.value)
    with pytest.raises(ValueError, match="'dimm'.*did you mean 'dim'"):
        get_model_config("debug", dimm=64)
    with pytest.raises(ValueError, match="dim=100"):
        get_model_config("debug", dim=100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 64


def test_public_names():
    assert set(models.__all__) >= {"LlamaConfig", "Transformer", "TransformerBlock", "build_model",
                                   "get_model_config", "list_model_configs", "init_module_weights"}
    assert all(hasattr(models, name) for name in models.__all__)


# --- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_adam_steps_reduce_loss(tie):
    cfg = tiny(tie_embeddings=tie)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = tokens(cfg, batch=4, seq_len=cfg.max_seq_len)
    losses = []
    for _ in range(8):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(cfg.vocab_size), rel=0.05)  # small init: ~uniform
    assert losses[-1] < 0.8 * losses[0]
