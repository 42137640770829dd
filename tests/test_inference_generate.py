"""shardwise.inference.generate: the KV cache against recomputing the whole sequence, padded
batches against prompts run alone, sampling, stop tokens, bad input, and Hugging Face models
imported from configs against transformers' own ``generate``."""

from __future__ import annotations

import pytest
import torch

from shardwise.inference import Decoder, Sampling, generate
from shardwise.models import build_model, get_model_config

SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97,
         "max_seq_len": 64}
MLA = {"attention": "mla", "n_kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12}
VARIANTS = {
    "dense": {},
    "mha": {"n_kv_heads": 4},
    "tied": {"tie_embeddings": True},
    "moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1},
    "mla": MLA,
}
PROMPTS = [[1, 5, 9, 33, 2, 7, 8, 40, 41], [4, 5], [60], [90, 12, 13, 14, 15]]


def _model(name: str, **extra) -> torch.nn.Module:
    base = "debug-moe" if "num_experts" in VARIANTS[name] else "debug"
    over = {**SMALL, **VARIANTS[name], **extra}
    if base == "debug-moe":
        over.setdefault("moe_ffn_dim", 64)
    return build_model(get_model_config(base, **over), seed=3).eval()


def _recompute(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the whole sequence's forward at every step: no cache."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_greedy_equals_recomputing_the_sequence(variant):
    model = _model(variant)
    got = generate(model, PROMPTS, max_new_tokens=10)
    want = [_recompute(model, p, 10) for p in PROMPTS]
    assert got.tokens == want
    assert got.finished == ["length"] * len(PROMPTS) and got.steps == 9


@pytest.mark.parametrize("variant", ["dense", "moe", "mla"])
def test_cached_logits_match_the_full_forward(variant):
    """Not only the argmax: each decode step's logits are the full forward's (fp32)."""
    model = _model(variant)
    prompt = PROMPTS[0]
    dec = Decoder(model)
    logits = [dec.prefill([prompt], max_new_tokens=4)]
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(logits[-1].argmax()))
        logits.append(dec.step(torch.tensor([seq[-1]])))
    with torch.no_grad():
        full = model(torch.tensor([seq]))[0]  # (T, V)
    want = full[len(prompt) - 1:]
    torch.testing.assert_close(torch.cat(logits), want, rtol=1e-5, atol=1e-5)


def test_a_padded_batch_equals_each_prompt_alone():
    model = _model("dense")
    batch = generate(model, PROMPTS, max_new_tokens=8).tokens
    alone = [generate(model, [p], max_new_tokens=8).tokens[0] for p in PROMPTS]
    assert batch == alone


def test_the_cache_is_preallocated_for_the_batch_and_length():
    model = _model("dense")
    dec = Decoder(model)
    dec.prefill(PROMPTS, max_new_tokens=5)
    longest = max(len(p) for p in PROMPTS)
    per_layer = 2 * len(PROMPTS) * SMALL["n_kv_heads"] * (longest + 5) * (64 // 4) * 4
    assert dec.cache.nbytes() == SMALL["n_layers"] * per_layer
    for _ in range(5):
        dec.step(torch.zeros(len(PROMPTS), dtype=torch.int64))
    with pytest.raises(ValueError, match="cache holds"):
        dec.step(torch.zeros(len(PROMPTS), dtype=torch.int64))
    # the attention modules are left without a cache after each forward
    assert all(layer.attention.kv_cache is None for layer in model.layers)


def test_stop_tokens_end_a_row_and_the_others_go_on():
    model = _model("dense")
    free = generate(model, PROMPTS[:2], max_new_tokens=8).tokens
    stop = free[0][2]
    assert stop not in free[0][:2] and stop not in free[1]  # the seed gives a clean case
    out = generate(model, PROMPTS[:2], max_new_tokens=8, stop_tokens=[stop])
    assert out.tokens[0] == free[0][:3] and out.finished[0] == "stop"
    assert out.tokens[1] == free[1] and out.finished[1] == "length"
    # every row stopping ends generation early
    both = generate(model, PROMPTS[:1], max_new_tokens=8, stop_tokens=[free[0][0]])
    assert both.tokens == [free[0][:1]] and both.steps == 0


def test_seeded_sampling_repeats_and_respects_top_k():
    model = _model("dense")
    s = Sampling(temperature=1.0, top_k=3, seed=7)
    a = generate(model, PROMPTS, max_new_tokens=12, sampling=s).tokens
    assert a == generate(model, PROMPTS, max_new_tokens=12, sampling=s).tokens
    other = generate(model, PROMPTS, max_new_tokens=12, sampling=Sampling(1.0, 3, seed=8))
    assert other.tokens != a
    for prompt, row in zip(PROMPTS, a):  # each sampled token is among the 3 most likely
        seq = list(prompt)
        with torch.no_grad():
            for tok in row:
                top3 = model(torch.tensor([seq]))[0, -1].topk(3).indices.tolist()
                assert tok in top3
                seq.append(tok)


def test_degenerate_sampling_is_greedy():
    model = _model("dense")
    greedy = generate(model, PROMPTS, max_new_tokens=6).tokens
    for s in (Sampling(temperature=1.0, top_k=1, seed=1), Sampling(0.7, top_p=1e-6, seed=1)):
        assert generate(model, PROMPTS, max_new_tokens=6, sampling=s).tokens == greedy


def test_on_tokens_streams_every_step():
    model = _model("dense")
    seen = []
    out = generate(model, PROMPTS[:2], max_new_tokens=5,
                   on_tokens=lambda step, toks: seen.append((step, toks)))
    assert [s for s, _ in seen] == list(range(5))
    assert [[t[i] for _, t in seen] for i in range(2)] == out.tokens


@pytest.mark.parametrize("kwargs,match", [
    ({"prompts": [[]]}, "prompt 0 is empty"),
    ({"prompts": []}, "no prompt"),
    ({"prompts": [[1, 97]]}, "token 97 outside the vocabulary"),
    ({"prompts": [[1] * 60], "max_new_tokens": 6}, "needs 65 positions"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"stop_tokens": [500]}, "stop token 500"),
])
def test_bad_input_is_named(kwargs, match):
    generate(_model("dense"), [[1] * 60], max_new_tokens=5)  # 64 positions: fits exactly
    args = {"prompts": [[1, 2]], "max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(_model("dense"), args.pop("prompts"), **args)


@pytest.mark.parametrize("bad,match", [
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
    ({"top_p": 0}, "top_p"), ({"seed": 1.5}, "seed")])
def test_bad_sampling_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**bad)


def test_a_model_that_is_not_a_decoder_is_refused():
    with pytest.raises(ValueError, match="expected a shardwise Transformer"):
        generate(torch.nn.Linear(2, 2), [[1]], max_new_tokens=2)


def test_bf16_generates():
    model = _model("dense").to(torch.bfloat16)
    out = generate(model, PROMPTS, max_new_tokens=4)
    assert all(len(r) == 4 for r in out.tokens)


# ---- Hugging Face decoders imported by the existing import path -------------------------

HF = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 101,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _hf_pair(kind: str, tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardwise.checkpoint.export import import_safetensors
    from shardwise.checkpoint.hf import config_from_hf

    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF))
    else:
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **HF, num_local_experts=4, num_experts_per_tok=2))
    hf = hf.eval()
    hf.save_pretrained(tmp_path / kind)
    cfg = config_from_hf(hf.config.to_dict())
    ours = build_model(cfg, seed=0)
    import_safetensors(tmp_path / kind, ours)
    return hf, ours.eval()


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_imported_hugging_face_decoder_equals_transformers_generate(kind, tmp_path):
    hf, ours = _hf_pair(kind, tmp_path)
    prompts = [[1, 17, 33, 8, 90, 4], [1, 50, 51]]
    ours_out = generate(ours, prompts, max_new_tokens=12).tokens
    for prompt, row in zip(prompts, ours_out):  # one prompt at a time: no padding in theirs
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert theirs[0, len(prompt):].tolist() == row
    # and their left-padded batch gives the same tokens as our padded batch
    pad = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (pad - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (pad - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    assert theirs[:, pad:].tolist() == ours_out
