"""Context parallelism on Hugging Face decoders (shardwise/parallel/context/hf.py) computes
what one process computes: Llama, Qwen2 (attention biases) and Mistral (a sliding window
exactly the sequence's length, head_dim wider than hidden / heads), fp32, grouped-query
attention, at cp 2 (ring and ulysses) and cp 3 (ring), zigzag and none, with and without
packed documents (HF's position_ids restarting at 0, different per row): the loss and every
parameter's gradient averaged over the cp ranks within 1e-5 relative of one process on the
same global batch (HF's own packed-sequence mask, ``use_cache=False``), and three steps of
SGD with momentum under ``shardwise.replicate`` leave the weights within 1e-5. Keys and
values repeated before the call (older transformers) give the same numbers, and what the
kernel cannot do is refused with a ValueError naming it. HF's own activation checkpointing
recomputes the same attention (its recomputation gets the same keyword arguments).

One launch of ranks per world size runs every case; the references run in the test process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MODELS = ("llama", "qwen2", "mistral")
BATCH, SEQ, VOCAB, STEPS, LR = 2, 24, 128, 3, 0.05
GRID = {2: [(kind, impl, lb, docs) for kind in MODELS for impl in ("ring", "ulysses")
            for lb in ("zigzag", "none") for docs in (False, True)],
        3: [(kind, "ring", lb, docs) for kind in MODELS for lb in ("zigzag", "none")
            for docs in (False, True)]}
TRAIN = {2: [("llama", "ring", "zigzag", True), ("qwen2", "ulysses", "none", False)],
         3: [("mistral", "ring", "zigzag", True)]}
TOL = 1e-5


def _build(kind: str, **overrides):
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.MistralConfig(**{**common, "sliding_window": SEQ, "head_dim": 32})
        cls = transformers.MistralForCausalLM
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return cls(cfg)


def _batch(step: int, docs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, next tokens, packed position ids or None), whole sequences."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = None
    if docs:
        rows = [(7, 10, 7), (5, 19)]
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return tokens[:, :-1], tokens[:, 1:], pos


def _loss(model, x, y, pos) -> torch.Tensor:
    kwargs = {"use_cache": False} if pos is None else {"use_cache": False, "position_ids": pos}
    logits = model(x, **kwargs).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _avg(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _repeated_attention(module, query, key, value, attention_mask, **kwargs):
    """What transformers < 4.48's convention looked like: KV heads repeated to H."""
    from shardwise.models.layers import repeat_kv
    from shardwise.parallel.context.hf import hf_cp_attention

    g = module.num_key_value_groups
    return hf_cp_attention(module, query, repeat_kv(key, g), repeat_kv(value, g),
                           attention_mask, **kwargs)


def _gradients(kind, impl, lb, docs, cp_mesh, repeated: bool = False,
               checkpointed: bool = False):
    import shardwise

    model = _build(kind)
    if checkpointed:  # HF's own activation checkpointing: the recomputation sees the kwargs
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
    model = shardwise.apply_cp(model, cp_mesh, impl, lb)
    if repeated:
        from transformers import AttentionInterface
        AttentionInterface.register("shardwise_cp_repeated", _repeated_attention)
        model.set_attn_implementation("shardwise_cp_repeated")
    cp = shardwise.cp_context(model)
    x, y, pos = _batch(0, docs)
    loss = _loss(model, cp.shard(x), cp.shard(y), None if pos is None else cp.shard(pos))
    loss.backward()
    return _avg(loss).item(), {n: _avg(p.grad) for n, p in model.named_parameters()}


def _train(kind, impl, lb, docs, mesh):
    import shardwise

    model = shardwise.apply_cp(_build(kind), mesh["cp"], impl, lb)
    model = shardwise.replicate(model, mesh=mesh)
    cp = shardwise.cp_context(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y, pos = _batch(step, docs)
        loss = _loss(model, cp.shard(x), cp.shard(y), None if pos is None else cp.shard(pos))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_avg(loss).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _refusals(cp_mesh) -> dict[str, str]:
    import shardwise

    out = {}
    x, _, _ = _batch(0, False)

    def refused(name, fn):
        try:
            fn()
        except ValueError as e:
            out[name] = str(e)

    refused("not-a-model", lambda: shardwise.apply_cp(torch.nn.Linear(4, 4), cp_mesh))
    model = shardwise.apply_cp(_build("llama"), cp_mesh)
    cp = shardwise.cp_context(model)
    pad = torch.ones(BATCH, SEQ // dist.get_world_size(), dtype=torch.long)
    pad[0, -1] = 0
    refused("padding", lambda: model(cp.shard(x), attention_mask=pad))
    out["all-ones-mask-ok"] = tuple(model(cp.shard(x), attention_mask=torch.ones_like(pad))
                                    .logits.shape)
    refused("again", lambda: shardwise.apply_cp(model, cp_mesh))
    short = shardwise.apply_cp(_build("mistral", sliding_window=SEQ - 1), cp_mesh)
    refused("window", lambda: short(cp.shard(x)))
    drop = shardwise.apply_cp(_build("llama", attention_dropout=0.1), cp_mesh).train()
    refused("dropout", lambda: drop(cp.shard(x)))
    return out


def _worker(world: int) -> dict:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from shardwise.distributed.parallel_dims import ParallelDims

    mesh = ParallelDims(world_size=world, cp=world).build_mesh()
    out: dict = {"grads": {c: _gradients(*c, mesh["cp"]) for c in GRID[world]},
                 "train": {c: _train(*c, mesh) for c in TRAIN[world]}}
    if world == 2:
        out["repeated"] = _gradients("llama", "ring", "zigzag", True, mesh["cp"], True)
        out["checkpointed"] = _gradients("qwen2", "ulysses", "zigzag", True, mesh["cp"],
                                         checkpointed=True)
        out["refusals"] = _refusals(mesh["cp"])
    out["no_mask_function"] = "shardwise_cp" not in ALL_MASK_ATTENTION_FUNCTIONS
    return out


@functools.lru_cache(maxsize=None)
def _ranks(world: int) -> dict:
    return run_ranks(_worker, world, args=(world,), timeout_s=600)[0]


@functools.lru_cache(maxsize=None)
def _reference_grads(kind: str, docs: bool):
    model = _build(kind)
    loss = _loss(model, *_batch(0, docs))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference_train(kind: str, docs: bool):
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step, docs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_grads(case, got) -> None:
    loss, grads = got
    ref_loss, ref_grads = _reference_grads(case[0], case[3])
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (case, loss, ref_loss)
    err, name = max_rel_err(grads, ref_grads)
    assert err <= TOL, (case, name, err)


@pytest.mark.parametrize("world", [2, 3])
def test_loss_and_gradients_match_one_process(world):
    res = _ranks(world)
    assert res["no_mask_function"]
    assert set(res["grads"]) == set(GRID[world])
    for case, got in res["grads"].items():
        _check_grads(case, got)


@pytest.mark.parametrize("world", [2, 3])
def test_sgd_momentum_steps_match_one_process(world):
    for (kind, impl, lb, docs), (losses, state) in _ranks(world)["train"].items():
        ref_losses, ref_state = _reference_train(kind, docs)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert rel <= TOL, (kind, impl, lb, docs, losses, ref_losses)
        err, name = max_rel_err(state, ref_state)
        assert err <= TOL, (kind, impl, lb, docs, name, err)


def test_repeated_key_value_heads_are_undone():
    _check_grads(("llama", "ring", "zigzag", True), _ranks(2)["repeated"])


def test_hf_activation_checkpointing_recomputes_the_same_attention():
    _check_grads(("qwen2", "ulysses", "zigzag", True), _ranks(2)["checkpointed"])


def test_refusals_name_what_is_wrong():
    out = _ranks(2)["refusals"]
    assert "Linear" in out["not-a-model"] and "neither" in out["not-a-model"]
    assert "attention_mask" in out["padding"]
    assert out["all-ones-mask-ok"] == (BATCH, SEQ // 2, VOCAB)
    assert "already context-parallel" in out["again"]
    assert f"sliding_window={SEQ - 1}" in out["window"]
    assert "dropout 0.1" in out["dropout"]


def test_is_hf_model_does_not_import_transformers():
    from shardwise.parallel.context.hf import is_hf_model

    assert not is_hf_model(torch.nn.Linear(2, 2))
    assert is_hf_model(_build("llama"))


def test_bidirectional_attention_is_refused():
    """A vision tower's attention (is_causal=False) must not get causal context-parallel
    attention silently."""
    from shardwise.parallel.context.hf import hf_cp_attention

    tower = torch.nn.Module()
    tower.is_causal = False
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"Module is bidirectional \(is_causal=False\)"):
        hf_cp_attention(tower, q, q, q, None, shardwise_cp=object())
