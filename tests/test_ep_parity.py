"""Expert parallelism trains like one process (issue 13): on 4 Gloo ranks, ep {2, 4} x ZeRO
stage {1, 3} (edp 2 and 1), ep 2 x tp 2 with sequence parallelism, stage 0, capacity mode,
the bias method with shared experts, meta-device init, and Hugging Face Mixtral / Qwen2-MoE
decoders, against one process on the same global batches (fp32, SGD + momentum, clipped):
LM losses and gradient norms within 1e-6 relative, weights within 1e-5, the global token
counts per expert equal, aux and z values within 1e-6, capacity drops equal. Every rank
holds only its ``E / ep`` experts.

One launch of 4 ranks runs every case; the references run in the test process with
``capacity_groups`` = the data-parallel degree (capacity is per rank's micro-batch).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from shardwise.models import (MoESettings, TransformerBlock, build_model, configure_moe,
                              get_model_config, init_module_weights)
from shardwise.parallel.expert import expert_modules
from shardwise.testing import run_ranks
from shardwise.testing.ep_parity import EPConfig, ep_reference_run, ep_run
from shardwise.testing.parity import make_batches, max_rel_err

WORLD, STEPS, GLOBAL_BATCH, SEQ = 4, 3, 8, 16
SMALL = dict(dim=64, n_heads=4, n_kv_heads=2, moe_ffn_dim=96)  # debug-moe, narrower
CASES = {  # name: (EPConfig, MoESettings, model overrides)
    "ep2-stage1": (EPConfig(ep=2, stage=1, steps=STEPS), MoESettings(), {}),
    "ep2-stage3-accum2": (EPConfig(ep=2, stage=3, accum=2, steps=STEPS), MoESettings(), {}),
    "ep4-stage1-accum2": (EPConfig(ep=4, stage=1, accum=2, steps=STEPS), MoESettings(), {}),
    "ep4-stage3": (EPConfig(ep=4, stage=3, steps=STEPS), MoESettings(), {}),
    "ep2-tp2-stage3-accum2": (EPConfig(ep=2, tp=2, stage=3, accum=2, steps=STEPS),
                              MoESettings(), {}),
    "ep2-tp2-stage1-shared": (EPConfig(ep=2, tp=2, stage=1, steps=STEPS),
                              MoESettings(balance="bias", bias_update_rate=0.01),
                              {"num_shared_experts": 1}),
    "ep2-stage0": (EPConfig(ep=2, stage=0, steps=STEPS), MoESettings(), {}),
    "ep4-stage3-capacity": (EPConfig(ep=4, stage=3, steps=STEPS),
                            MoESettings(capacity_factor=1.0), {}),
    "ep2-stage1-capacity-bias-shared": (EPConfig(ep=2, stage=1, accum=2, steps=STEPS),
                                        MoESettings(capacity_factor=0.75, balance="bias",
                                                    bias_update_rate=0.01),
                                        {"num_shared_experts": 1, "moe_every": 2}),
    "ep4-stage3-meta": (EPConfig(ep=4, stage=3, steps=STEPS, meta=True), MoESettings(), {}),
}
HF_CASES = {"mixtral-ep2-stage3": ("mixtral", EPConfig(ep=2, stage=3, steps=STEPS)),
            "qwen2moe-ep4-stage1": ("qwen2_moe", EPConfig(ep=4, stage=1, accum=2, steps=STEPS))}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _build(settings: MoESettings, overrides: dict, meta: bool = False):
    cfg = get_model_config("debug-moe", **SMALL, **overrides)
    model = build_model(cfg, device="meta") if meta else build_model(cfg, seed=0)
    return configure_moe(model, settings)


def _build_hf(kind: str):
    import transformers

    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8,
                                         num_experts_per_tok=2, **common)
        model_cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=False,
                                          decoder_sparse_step=1, **common)
        model_cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    return model_cls(cfg)


def _hf_layer(kind: str) -> type:
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.qwen2_moe.modeling_qwen2_moe as qwen

    return mixtral.MixtralDecoderLayer if kind == "mixtral" else qwen.Qwen2MoeDecoderLayer


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _batches() -> torch.Tensor:
    return make_batches(seed=3, steps=STEPS, accum=2, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                        vocab=256)


def _local_experts(model) -> list[int]:
    return [next(iter(m.parameters())).shape[0] for _, m in expert_modules(model)]


def _worker() -> dict:
    cache, out = {}, {}
    seen: dict[str, list[int]] = {}

    def record(model) -> None:  # the experts each rank holds, before sharding
        seen["e"] = _local_experts(model)
    for name, (cfg, settings, overrides) in CASES.items():
        res = ep_run(functools.partial(_build, settings, overrides, cfg.meta), _batches(), cfg,
                     {TransformerBlock}, cache, inspect=record,
                     init_weights=init_module_weights if cfg.meta else None)
        out[name] = (res, seen.pop("e"))
    if _has_transformers():
        for name, (kind, cfg) in HF_CASES.items():
            res = ep_run(functools.partial(_build_hf, kind), _batches(), cfg, {_hf_layer(kind)},
                         cache, logits_of=lambda o: o.logits, inspect=record)
            out[name] = (res, seen.pop("e"))
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout_s=600)


def _compare(name: str, got, ref, local: list[int], ep: int, num_experts: int = 8) -> None:
    rel = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses, strict=True))
    assert rel < 1e-6, (name, got.losses, ref.losses)
    norms = max(abs(a - b) / b for a, b in zip(got.grad_norms, ref.grad_norms, strict=True))
    assert norms < 1e-6, (name, got.grad_norms, ref.grad_norms)
    err, key = max_rel_err(got.state, ref.state)
    assert err < 1e-5, (name, key, err)
    assert local and all(e == num_experts // ep for e in local), (name, local)
    for step, (counts, want) in enumerate(zip(got.counts, ref.counts, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(counts, want, strict=True)), (name, step)
    assert got.dropped == ref.dropped, name
    for vals, want in zip(got.balance, ref.balance, strict=True):
        for (aux, z), (aux_ref, z_ref) in zip(vals, want, strict=True):
            assert aux == pytest.approx(aux_ref, rel=1e-6) and z == pytest.approx(z_ref, rel=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_trains_like_one_process(results, name):
    cfg, settings, overrides = CASES[name]
    data = WORLD // cfg.tp
    ref = ep_reference_run(functools.partial(_build, settings, overrides), _batches(), cfg,
                           data)
    for rank_result in results:
        got, local = rank_result[name]
        _compare(name, got, ref, local, cfg.ep)
    if settings.capacity_factor is not None:  # the capacity did drop assignments
        assert any(sum(d) > 0 for d in ref.dropped), ref.dropped
    if settings.balance == "bias":
        biases = [v for k, v in ref.state.items() if k.endswith("expert_bias")]
        assert biases and any(b.any() for b in biases)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hugging_face_moe_decoders_train_like_one_process(results, name):
    pytest.importorskip("transformers")
    kind, cfg = HF_CASES[name]
    ref = ep_reference_run(functools.partial(_build_hf, kind), _batches(), cfg, WORLD,
                           logits_of=lambda o: o.logits)
    for rank_result in results:
        got, local = rank_result[name]
        _compare(name, got, ref, local, cfg.ep)
