"""MoE layer, single process: routing and expert compute against a per-token loop, capacity
drops, balance losses by hand, the bias update, init, dtypes, counts and configs."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardwise.models import (LlamaConfig, MoE, MoESettings, build_model, configure_moe,
                              finish_moe_step, get_model_config, init_module_weights,
                              moe_aux_loss, moe_layers)
from shardwise.models.experts import GroupedExperts, expert_ffn
from shardwise.models.router import sort_by_expert


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def moe_cfg(**overrides) -> LlamaConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                max_seq_len=16, num_experts=4, top_k=2, moe_ffn_dim=16)
    return LlamaConfig(**{**base, **overrides})


def layer(cfg: LlamaConfig, seed: int = 0, **settings) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg, MoESettings(**settings))
    for sub in m.modules():
        init_module_weights(sub)
    return m


# --- the per-token reference ------------------------------------------------------------------


def reference_forward(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Token by token, slot by slot; capacity by counting in priority order. Returns the
    output and the dropped (token, slot) pairs."""
    r = m.router
    n, k, e = x.shape[0], m.top_k, m.num_experts
    logits = x.float() @ r.gate.weight.float().t()
    scores = logits.softmax(-1) if r.score == "softmax" else logits.sigmoid()
    ids = (scores.detach() + r.expert_bias).topk(k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if r.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * r.scale
    cf = m.settings.capacity_factor
    cap = math.ceil(cf * n * k / e) if cf is not None else n * k
    seen, dropped = [0] * e, []
    for s in range(k):  # first choices first, then token order
        for t in range(n):
            ex = int(ids[t, s])
            if seen[ex] < cap:
                seen[ex] += 1
            else:
                dropped.append((t, s))
    w1, w2, w3 = m.experts.w1, m.experts.w2, m.experts.w3
    rows = []
    for t in range(n):
        acc = torch.zeros(x.shape[1])
        for s in range(k):
            if (t, s) in dropped:
                continue
            ex = int(ids[t, s])
            h = F.silu(x[t] @ w1[ex]) * (x[t] @ w3[ex])
            acc = acc + weights[t, s] * (h @ w2[ex])
        if m.shared_experts is not None:
            acc = acc + m.shared_experts(x[t])
        rows.append(acc)
    return torch.stack(rows), dropped


def _grads(m: MoE, x: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> dict:
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return {"x": x.grad.clone(), **grads}


def _compare(m: MoE, x: torch.Tensor, seed: int = 3) -> list[tuple[int, int]]:
    ref = copy.deepcopy(m)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = m(xa)
    want, dropped = reference_forward(ref, xb)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    got, exp = _grads(m, xa, out, g), _grads(ref, xb, want, g)
    for name in exp:
        torch.testing.assert_close(got[name], exp[name], rtol=1e-5, atol=1e-6, msg=name)
    return dropped


ROUTINGS = {  # expert_bias forcing a routing pattern (selection only)
    "random": None,
    "expert 2 starved": torch.tensor([0.0, 0.0, -1e3, 0.0]),
    "all to expert 0": torch.tensor([1e3, 0.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("compute", ["grouped_mm", "padded", "loop"])
@pytest.mark.parametrize("shape", [
    dict(), dict(top_k=1), dict(router_score="sigmoid", router_scale=2.5),
    dict(router_norm_topk=False, num_shared_experts=2),
])
def test_dropless_matches_per_token_loop(routing, compute, shape):
    m = layer(moe_cfg(**shape))
    m.experts.compute = compute
    if ROUTINGS[routing] is not None:
        m.router.expert_bias.copy_(ROUTINGS[routing])
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    assert _compare(m, x) == []
    counts = torch.bincount(m.router(x).expert_ids.flatten(), minlength=4)
    if routing == "expert 2 starved":
        assert counts[2] == 0
    if routing == "all to expert 0":
        assert counts[0] == 24


@pytest.mark.parametrize("cf, top_k, routing", [
    (1.0, 2, "random"), (0.5, 2, "random"), (1.25, 1, "random"), (1.0, 2, "all to expert 0"),
    (0.3, 3, "expert 2 starved"),
])
def test_capacity_drops_exactly_the_reference_tokens(cf, top_k, routing):
    m = layer(moe_cfg(top_k=top_k), capacity_factor=cf)
    if ROUTINGS[routing] is not None:
        m.router.expert_bias.copy_(ROUTINGS[routing])
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(2))
    dropped = _compare(m, x)
    assert dropped, "the case must drop something"
    stats = finish_moe_step(m)[0]
    assert stats.dropped == len(dropped) and stats.assignments == 24 * top_k
    assert stats.dropped_frac == pytest.approx(len(dropped) / (24 * top_k))
    d = sort_by_expert(m.router(x).expert_ids, 4, math.ceil(cf * 24 * top_k / 4))
    assert int(d.counts.max()) <= math.ceil(cf * 24 * top_k / 4)


def test_capacity_keeps_first_choices_before_second_choices():
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])  # tokens 0..2, slots 0..1
    d = sort_by_expert(ids, num_experts=2, capacity=2)
    kept = {(int(j) % 3, int(j) // 3) for j in d.order}  # (token, slot)
    # expert 0: first choices of tokens 0 and 2 win over token 1's second choice
    assert kept == {(0, 0), (2, 0), (1, 0), (0, 1)}
    assert d.routed.tolist() == [3, 3] and d.counts.tolist() == [2, 2]
    assert int(d.dropped) == 2


def test_experts_with_no_rows_at_all_get_zero_gradients():
    for compute in ("grouped_mm", "padded", "loop"):
        e = GroupedExperts(3, 8, 4, 0.02, 0.01, compute=compute)
        y = e(torch.zeros(0, 8), torch.zeros(3, dtype=torch.int64))
        y.sum().backward()
        assert y.shape == (0, 8)
        assert all(p.grad is not None and not p.grad.any() for p in e.parameters())


def test_grouped_mm_refuses_what_it_cannot_run():
    x, w = torch.randn(4, 6), torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match="grouped_mm.*16-byte"):
        expert_ffn(x, torch.tensor([2, 2]), w, w.transpose(1, 2), w, compute="grouped_mm")
    y = expert_ffn(x, torch.tensor([2, 2]), w, w.transpose(1, 2), w)  # auto falls back
    assert y.shape == (4, 6)


# --- balance losses and the bias ---------------------------------------------------------------


def test_aux_and_z_loss_against_hand_computation():
    cfg = moe_cfg(num_experts=2, top_k=1, dim=8, n_heads=2, n_kv_heads=1)
    m = layer(cfg, aux_loss_coef=0.5, z_loss_coef=0.25)
    with torch.no_grad():
        m.router.gate.weight.zero_()
        m.router.gate.weight[0, 0] = 1.0
        m.router.gate.weight[1, 1] = 1.0
    x = torch.zeros(3, 8)
    x[0, 0], x[1, 1], x[2, 0] = 1.0, 2.0, 3.0  # logits (1, 0), (0, 2), (3, 0)
    m(x)
    logits = [(1.0, 0.0), (0.0, 2.0), (3.0, 0.0)]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    frac = [2 / 3, 1 / 3]  # tokens 0 and 2 pick expert 0, token 1 expert 1
    mean_p = [sum(p[i] for p in probs) / 3 for i in range(2)]
    aux = 2 * sum(f * p for f, p in zip(frac, mean_p, strict=True))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 3
    loss = moe_aux_loss(m)
    assert loss.item() == pytest.approx(0.5 * aux + 0.25 * z, rel=1e-6)
    stats = finish_moe_step(m)[0]
    assert stats.aux_loss == pytest.approx(aux, rel=1e-6)
    assert stats.z_loss == pytest.approx(z, rel=1e-6)
    assert stats.counts.tolist() == [2.0, 1.0]


def test_aux_loss_gradient_flows_through_probabilities_only():
    m = layer(moe_cfg(), aux_loss_coef=1.0, z_loss_coef=0.0)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(4))
    m(x)
    moe_aux_loss(m).backward()
    got = m.router.gate.weight.grad.clone()
    probs = (x @ m.router.gate.weight.t()).softmax(-1)
    ids = probs.detach().topk(2, dim=-1).indices
    frac = torch.bincount(ids.flatten(), minlength=4) / (24 * 2)
    want, = torch.autograd.grad(4 * (frac * probs.mean(0)).sum(), m.router.gate.weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    assert m.experts.w1.grad is None  # the aux loss does not reach the experts


@pytest.mark.parametrize("balance, coefs, terms", [
    ("aux", (0.01, 0.001), 2), ("aux", (0.0, 0.0), 0), ("bias", (0.01, 0.001), 1),
    ("none", (0.01, 0.0), 0),
])
def test_which_losses_are_added(balance, coefs, terms):
    model = build_model(moe_cfg(), seed=0)
    configure_moe(model, MoESettings(balance=balance, aux_loss_coef=coefs[0],
                                     z_loss_coef=coefs[1]))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens)
    loss = moe_aux_loss(model)
    assert (loss is None) == (terms == 0)
    stats = finish_moe_step(model)
    assert len(stats) == 2 and all(s.aux_loss > 0 and s.z_loss > 0 for s in stats)
    assert moe_aux_loss(model) is None  # handed out once
    if terms:
        aux = sum(s.aux_loss for s in stats) * (coefs[0] if balance == "aux" else 0)
        assert loss.item() == pytest.approx(aux + sum(s.z_loss for s in stats) * coefs[1],
                                            rel=1e-5)


def test_eval_mode_records_nothing():
    model = build_model(moe_cfg(), seed=0).eval()
    model(torch.zeros(1, 4, dtype=torch.int64))
    assert moe_aux_loss(model) is None and finish_moe_step(model) == []


def test_bias_update_direction_and_size():
    m = layer(moe_cfg(), balance="bias", bias_update_rate=0.01)
    m.router.update_bias(torch.tensor([10.0, 2.0, 6.0, 6.0]), rate=0.01)
    assert m.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def _bias_run(seed: int, balance: str, steps: int = 40) -> tuple[torch.Tensor, list[float]]:
    m = layer(moe_cfg(), seed=seed, balance=balance, bias_update_rate=0.01)
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(32, generator=gen)
    with torch.no_grad():  # every token prefers expert 0 by a wide margin
        m.router.gate.weight[0] += 0.25 * direction / direction.norm()
    cvs = []
    for _ in range(steps):
        m(direction + torch.randn(64, 32, generator=gen))
        cvs.append(finish_moe_step(m)[0].tokens_cv)
    return m.router.expert_bias.clone(), cvs


def test_bias_balancing_reduces_imbalance_and_is_reproducible():
    bias, cvs = _bias_run(0, "bias")
    again, cvs_again = _bias_run(0, "bias")
    assert torch.equal(bias, again) and cvs == cvs_again
    assert bias[0] < 0 and bias[0] == bias.min()  # the favoured expert is pushed down
    assert sum(cvs[:5]) / 5 > 0.6 and sum(cvs[-10:]) / 10 < 0.4  # measured: 0.71 -> 0.33
    frozen, cvs_none = _bias_run(0, "none")
    assert not frozen.any() and cvs_none[0] == cvs[0]


def test_skipped_step_does_not_move_the_bias():
    m = layer(moe_cfg(), balance="bias")
    m(torch.randn(8, 32))
    finish_moe_step(m, update_bias=False)
    assert not m.router.expert_bias.any()


# --- init, dtypes, state -------------------------------------------------------------------------


def test_meta_init_module_by_module_is_bitwise_eager():
    cfg = moe_cfg(num_shared_experts=1, moe_every=2, router_score="sigmoid")
    eager = build_model(cfg, seed=5)
    meta = build_model(cfg, device="meta")
    torch.manual_seed(5)
    for _, module in meta.named_modules():
        module.to_empty(device="cpu", recurse=False)
        init_module_weights(module)
    want = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    got = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_bias_is_an_fp32_checkpointed_buffer():
    model = build_model(moe_cfg(), seed=0)
    router = model.layers[0].feed_forward.router
    router.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 0.0, 5e-4]))
    sd = model.state_dict()
    assert "layers.0.feed_forward.router.expert_bias" in sd
    other = build_model(moe_cfg(), seed=1)
    other.load_state_dict(sd)
    assert torch.equal(other.layers[0].feed_forward.router.expert_bias, router.expert_bias)
    half = copy.deepcopy(model).to(torch.bfloat16)
    bias = half.layers[0].feed_forward.router.expert_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, router.expert_bias)
    assert half(torch.zeros(1, 4, dtype=torch.int64)).dtype == torch.bfloat16


def test_moe_every_and_first_dense_pick_the_blocks():
    cfg = moe_cfg(n_layers=7, moe_every=2, moe_first_dense=2)
    assert cfg.moe_layer_ids == [3, 5]
    model = build_model(cfg, device="meta")
    assert [n for n, _ in moe_layers(model)] == ["layers.3.feed_forward", "layers.5.feed_forward"]
    assert not moe_cfg(num_experts=0).is_moe


# --- counts and configs --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {}, {"num_shared_experts": 2, "moe_every": 2}, {"moe_ffn_dim": None, "ffn_dim": 24},
    {"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
     "v_head_dim": 5, "q_lora_rank": 12, "tie_embeddings": True},
])
def test_num_params_and_flops_are_exact(overrides):
    cfg = moe_cfg(**overrides)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.compute = "loop"  # torch's flop counter does not count grouped_mm
    batch, seq_len = 2, 12
    # The math backend decomposes attention into matmuls the flop counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (batch, seq_len))).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(seq_len) * batch * seq_len


@pytest.mark.parametrize("name, total, active, tol", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),  # Mistral: 46.7B total, 12.9B active
    ("deepseek-v3", 671e9, 37e9, 0.02),  # DeepSeek-V3 report: 671B total, 37B activated
])
def test_published_moe_sizes(name, total, active, tol):
    cfg = get_model_config(name)
    assert abs(cfg.num_params() - total) / total < 0.001
    assert abs(cfg.num_active_params() - active) / active < tol


def test_debug_moe_matches_debug_active_width():
    moe, dense = get_model_config("debug-moe"), get_model_config("debug")
    assert moe.top_k * moe.expert_hidden_dim == dense.ffn_hidden_dim
    assert abs(moe.num_active_params() - dense.num_params()) / dense.num_params() < 0.01


@pytest.mark.parametrize("overrides, needle", [
    ({"top_k": 5}, "top_k=5 exceeds num_experts=4"),
    ({"router_score": "relu"}, "router_score='relu'"),
    ({"num_experts": 0, "num_shared_experts": 1}, "num_shared_experts=1"),
    ({"moe_every": 0}, "moe_every=0"),
    ({"router_norm_topk": 1}, "router_norm_topk=1"),
    ({"kv_lora_rank": 8}, "kv_lora_rank=8 is an MLA field"),
    ({"attention": "mla", "kv_lora_rank": 8}, "qk_nope_head_dim=None"),
    ({"attention": "mha"}, "attention='mha'"),
])
def test_bad_moe_and_mla_shapes_are_refused(overrides, needle):
    with pytest.raises(ValueError) as info:
        moe_cfg(**overrides)
    assert needle in str(info.value)


@pytest.mark.parametrize("settings, needle", [
    ({"capacity_factor": 0}, "capacity_factor=0"), ({"balance": "loss"}, "balance='loss'"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef=-1.0"), ({"bias_update_rate": math.nan}, "nan"),
])
def test_bad_settings_are_refused(settings, needle):
    with pytest.raises(ValueError, match=needle):
        MoESettings(**settings)


def test_config_roundtrip_through_replace():
    cfg = get_model_config("deepseek-v3")
    assert dataclasses.replace(cfg, n_layers=4).moe_layer_ids == [3]
