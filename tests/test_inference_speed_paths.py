"""The decode fast paths of shardwise.inference (inference/cache.py [Note: the decode step's
mask]): no mask for an unpadded batch, the padding mask sliced from one built per cache,
``is_causal`` for an unpadded prefill, grouped heads through SDPA's ``enable_gqa``; each
against the general path it replaces."""

from __future__ import annotations

import pytest
import torch

from shardwise.inference import Decoder, KVCache, generate
from shardwise.models import build_model, get_model_config

SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97,
         "max_seq_len": 64}
MLA = {"attention": "mla", "n_kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12}
SAME_LENGTH = [[1, 5, 9, 33, 2, 7], [4, 5, 6, 7, 8, 9], [60, 61, 3, 3, 3, 1]]


def _model(**extra) -> torch.nn.Module:
    return build_model(get_model_config("debug", **{**SMALL, **extra}), seed=3).eval()


def _steps(model, prompts, n: int) -> torch.Tensor:
    """Logits of the prefill and ``n`` greedy steps, ``(n + 1, B, V)``."""
    dec = Decoder(model)
    out = [dec.prefill(prompts, max_new_tokens=n)]
    for _ in range(n):
        out.append(dec.step(out[-1].argmax(-1)))
    return torch.stack(out)


@pytest.mark.parametrize("extra", [{}, MLA], ids=["gqa", "mla"])
def test_an_unpadded_batch_equals_each_prompt_alone(extra):
    """Every start is 0: the prefill attends with is_causal, the steps with no mask."""
    model = _model(**extra)
    batch = _steps(model, SAME_LENGTH, 6)
    for i, prompt in enumerate(SAME_LENGTH):
        alone = _steps(model, [prompt], 6)[:, 0]
        torch.testing.assert_close(batch[:, i], alone, rtol=1e-5, atol=1e-5)
    got = generate(model, SAME_LENGTH, max_new_tokens=6).tokens
    assert got == [generate(model, [p], max_new_tokens=6).tokens[0] for p in SAME_LENGTH]


def test_the_step_mask_is_the_general_mask():
    model = _model()
    start = torch.tensor([0, 3, 1])
    kv = KVCache(model, 3, 12, start)
    kv.begin(5)
    assert kv.mask is not None and not kv.causal  # a padded prefill: the general mask
    kv.end(5)
    for _ in range(4):
        kv.begin(1)
        assert torch.equal(kv.mask, kv._mask(kv.filled, 1))  # the slice of the per-cache mask
        assert kv.positions.tolist() == [[kv.filled - s] for s in start.tolist()]
        kv.end(1)
    plain = KVCache(model, 2, 8, torch.zeros(2, dtype=torch.int64))
    plain.begin(3)
    assert plain.mask is None and plain.causal
    plain.end(3)
    plain.begin(1)
    assert plain.mask is None and not plain.causal


@pytest.mark.parametrize("prompts", [SAME_LENGTH, [[1, 5, 9, 33, 2, 7], [4, 5], [60]]],
                         ids=["unpadded", "padded"])
def test_enable_gqa_equals_the_model_with_its_key_heads_repeated(prompts):
    """4 query heads over 2 key heads, read by SDPA's enable_gqa from the cache, against an
    MHA model whose key / value projections repeat each key head for its 2 query heads."""
    model = _model()  # 4 query heads over 2 key heads
    mha = _model(n_kv_heads=4)
    state = model.state_dict()
    hd = SMALL["dim"] // SMALL["n_heads"]
    for name, w in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[name] = w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    torch.testing.assert_close(_steps(model, prompts, 5), _steps(mha, prompts, 5),
                               rtol=1e-5, atol=1e-5)


def test_a_stopped_row_repeats_its_stop_token_to_the_model():
    """The host-side stop bookkeeping feeds a stopped row its stop token, as before."""
    model = _model()
    free = generate(model, SAME_LENGTH, max_new_tokens=6).tokens
    stop = free[1][1]
    assert stop != free[1][0]  # the seed gives a clean case
    seen = []
    out = generate(model, SAME_LENGTH, max_new_tokens=6, stop_tokens=[stop],
                   on_tokens=lambda step, toks: seen.append(toks))
    assert out.tokens[1] == free[1][:2] and out.finished[1] == "stop"
    assert all(toks[1] == stop for toks in seen[1:])
    for i in (0, 2):  # the other rows are not disturbed by the stopped one
        if stop not in free[i]:
            assert out.tokens[i] == free[i]


def test_the_compiled_static_step_gives_the_eager_tokens(monkeypatch):
    """compile=True: fixed-shape steps over every slot ([Note: a static-shape step]), traced
    once for all the steps and both calls of one shape (backend aot_eager: the traced graph,
    without inductor's minute of C++ compilation on this CPU)."""
    from torch._dynamo.utils import counters

    from shardwise.inference import decoder as decoder_mod
    monkeypatch.setattr(decoder_mod, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    model = _model()
    prompts = [[1, 5, 9, 33, 2, 7], [4, 5], [60, 61, 3]]
    want = generate(model, prompts, max_new_tokens=8)
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        got = generate(model, prompts, max_new_tokens=8, compile=True)
        assert got.tokens == want.tokens
    assert counters["stats"]["unique_graphs"] - before == 1
    eager = _steps(model, prompts, 4)
    dec = Decoder(model, compile=True)
    static = [dec.prefill(prompts, max_new_tokens=4)]
    for _ in range(4):
        static.append(dec.step(static[-1].argmax(-1)))
    torch.testing.assert_close(torch.stack(static), eager, rtol=1e-5, atol=1e-5)
