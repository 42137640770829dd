"""The vision-language-action model (issue 34): its forward contract, the action tokenizer,
the vla-7b shape, and parity with one process under ZeRO 1/2/3 (2 and 3 ranks), a frozen
vision tower, tensor parallelism and expert parallelism, each also with a rank whose
micro-batch holds no frame (its vision tower runs on N = 0 and must issue the same
collectives)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.models import (ActionTokenizer, LlamaConfig, ModelBlock, VisionBlock,
                              VisionLanguageAction, VLAConfig, build_model, get_model_config,
                              list_model_configs)
from shardwise.parallel import checkpoint_activations, compile_blocks
from shardwise.testing.dist import run_ranks
from shardwise.testing.parity import max_rel_err
from shardwise.testing.vla_parity import VLALayout, VLASamples, vla_reference, vla_run

TINY = VLAConfig(decoder=LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=48,
                                     multiple_of=16, max_seq_len=32),
                 image_size=16, patch_size=8, vision_dim=16, vision_layers=2, vision_heads=2,
                 num_action_tokens=8)
TINY_MOE = dataclasses.replace(TINY, decoder=dataclasses.replace(
    TINY.decoder, num_experts=4, top_k=2, moe_ffn_dim=16))
GLOBAL_BATCH = 6


def _build(cfg: VLAConfig):
    return lambda: build_model(cfg, seed=0)


# --- forward contract --------------------------------------------------------------------


def _sample_batch(cfg: VLAConfig, frames: list[int], seed: int = 0):
    data = VLASamples(cfg, 1, 1, len(frames), 1, text_only=False, seed=seed)
    for b, k in enumerate(frames):  # force the frame counts asked for
        ids, action, images = data.samples[b]
        words = [i for i in ids if i not in (cfg.image_token_id,)][1:]
        data.samples[b] = ([1] + [cfg.image_token_id] * (k * cfg.num_patches) + words, action,
                           torch.rand(k, 3, cfg.image_size, cfg.image_size))
    data.seq_len = max(len(s[0]) for s in data.samples)
    return data.collate(torch.arange(len(frames)))


def test_image_count_is_checked():
    model = build_model(TINY, seed=0)
    tokens, _, images = _sample_batch(TINY, [1, 2])
    with pytest.raises(ValueError, match=r"12 IMAGE ids .* give 8 patch rows"):
        model(tokens, images[:2])
    with pytest.raises(ValueError, match=r"0 IMAGE ids .* give 4 patch rows"):
        model(torch.full((1, 5), 7), images[:1])


def test_text_only_forward_and_backward_reach_the_vision_tower():
    model = build_model(TINY, seed=0)
    tokens, labels, images = _sample_batch(TINY, [0, 0])
    assert images.shape == (0, 3, 16, 16)
    logits = model(tokens, images)
    assert logits.shape == (2, tokens.shape[1], 48)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = [p.grad for p in model.vision.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # reached, and zero
    assert model.vision(torch.empty(0, 3, 16, 16)).shape == (0, 4, 16)


def test_patches_replace_image_embeddings_and_padding_is_causal():
    model = build_model(TINY, seed=0)
    tokens, _, images = _sample_batch(TINY, [1, 2])
    out = model(tokens, images)
    other = model(tokens, torch.rand_like(images))  # the frames change the outputs
    assert not torch.allclose(out, other)
    one = model(tokens[:1, :8], images[:1])  # sample 0 alone, its padding cut
    torch.testing.assert_close(one, out[:1, :8], rtol=1e-5, atol=1e-6)


def test_a_part_decodes_only_those_positions_after_the_whole_merge():
    model = build_model(TINY, seed=0)
    tokens, _, images = _sample_batch(TINY, [1, 2])  # sample 1's frames end past position 5
    out = model(tokens, images)
    part = model(tokens, images, torch.arange(5))  # a prefix: RoPE's 0 .. 4 are its places
    torch.testing.assert_close(part, out[:, :5], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="IMAGE ids"):  # the merge still sees every frame
        model(tokens, images[:1], torch.arange(5))


def test_action_tokenizer_round_trips():
    tok = ActionTokenizer(128, 16)
    ids = tok.encode(torch.arange(7))
    assert ids.tolist() == list(range(112, 119))
    assert tok.decode(ids).tolist() == list(range(7))
    with pytest.raises(ValueError, match="action 16 is outside"):
        tok.encode(torch.tensor([3, 16]))
    with pytest.raises(ValueError, match="id 111 is not an action token"):
        tok.decode(torch.tensor([111]))
    arm = ActionTokenizer(32000, 256, low=[-1.0, 0.0], high=[1.0, 2.0], bins=256)
    values = torch.tensor([[-1.0, 0.0], [1.0, 2.0], [0.3, 1.7]])
    ids = arm.encode(values)
    assert ids[0].tolist() == [31744, 31744] and ids[1].tolist() == [31999, 31999]
    centres = arm.decode(ids)
    assert (centres - values.double()).abs().max() <= torch.tensor([2 / 512, 2 / 512]).max()
    assert torch.equal(arm.encode(centres), ids)  # a centre encodes to its own bin
    with pytest.raises(ValueError, match=r"outside \[low, high\]"):
        arm.encode(torch.tensor([[1.5, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        arm.encode(torch.zeros(3))


def test_registry_and_vla_7b_size():
    assert {"debug-vla", "debug-vla-moe", "vla-7b"} <= set(list_model_configs(multimodal=True))
    assert "debug-vla" not in list_model_configs()
    for name in ("debug-vla", "debug-vla-moe", "vla-7b"):
        cfg = get_model_config(name)
        model = build_model(cfg, device="meta")
        assert isinstance(model, VisionLanguageAction)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    cfg = get_model_config("vla-7b")
    assert (cfg.decoder.dim, cfg.decoder.n_layers, cfg.decoder.ffn_hidden_dim) == (4096, 32, 11008)
    assert cfg.first_action_id == 32000 - 256 and cfg.num_patches == 256
    assert abs(cfg.num_params() / 7.541e9 - 1) < 0.03  # OpenVLA: 7.541B published
    assert get_model_config("debug-vla").num_patches == 49
    assert get_model_config("debug-vla", vision_dim=64).vision_dim == 64
    with pytest.raises(ValueError, match="unknown VLAConfig field 'dim'"):
        get_model_config("debug-vla", dim=64)


def test_blocks_of_both_towers_are_found():
    model = build_model(TINY, device="meta")
    blocks = [n for n, m in model.named_modules() if isinstance(m, ModelBlock)]
    assert blocks == ["vision.blocks.0", "vision.blocks.1", "layers.0", "layers.1"]
    assert isinstance(model.vision.blocks[0], VisionBlock)


@pytest.mark.parametrize("how", ["checkpoint", "compile"])
def test_checkpointing_and_compile_keep_the_loss(how):
    tokens, labels, images = _sample_batch(TINY, [1, 0, 2])

    def loss_and_grads(model):
        loss = F.cross_entropy(model(tokens, images).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    ref_loss, ref_grads = loss_and_grads(build_model(TINY, seed=0))
    model = build_model(TINY, seed=0)
    if how == "checkpoint":
        checkpoint_activations(model, "full")
        assert len(shardwise.parallel.checkpointed_blocks(model)) == 4
    else:
        compile_blocks(model, backend="eager")
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)


# --- parity grid ---------------------------------------------------------------------------


def _layouts(world: int) -> list[tuple[VLAConfig, VLALayout]]:
    cases = [(TINY, VLALayout(stage=s, text_only=t)) for s in (1, 2, 3) for t in (False, True)]
    cases += [(TINY, VLALayout(stage=s, freeze_vision=True)) for s in (1, 3)]
    if world == 2:
        cases += [(TINY, VLALayout(stage=3, tp=2, text_only=t)) for t in (False, True)]
        cases += [(TINY_MOE, VLALayout(stage=s, ep=2, text_only=t))
                  for s, t in ((1, False), (3, False), (3, True))]
    return cases


def _grid():
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cache, out = {}, {}
    for cfg, layout in _layouts(world):
        data_ranks = world // layout.tp
        data = VLASamples(cfg, layout.steps, layout.accum, GLOBAL_BATCH, data_ranks,
                          layout.text_only, seed=world)
        res = vla_run(_build(cfg), data, layout, cache)
        if rank == 0:
            ref = vla_reference(_build(cfg), data, layout)
            err, key = max_rel_err(res.state, ref.state)
            out[layout.name + ("-moe" if cfg is TINY_MOE else "")] = (
                err, key, res.losses, ref.losses)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_parity_grid(world):
    results = run_ranks(_grid, world_size=world, timeout_s=240)[0]
    assert len(results) == len(_layouts(world))
    bad = {name: r for name, r in results.items()
           if r[0] > 1e-5 or max(abs(a - b) / abs(b) for a, b in zip(r[2], r[3])) > 1e-5}
    assert not bad, bad
