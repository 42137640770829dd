"""Hugging Face safetensors export / import: names, the RoPE layout, tied weights, bitwise
round trips at any world size, and the errors of mismatched files."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardwise
from shardwise import checkpoint
from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.export import export_safetensors, import_safetensors
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.models.llama import apply_rotary, repeat_kv, rope_tables
from shardwise.testing import run_ranks

LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def _config(tie: bool):
    return get_model_config("debug", **LLAMA, tie_embeddings=tie)


def _exported(tmp_path, tie: bool, max_shard_bytes: int = 10**9):
    model = build_model(_config(tie), seed=3)
    checkpoint.save(tmp_path / "ckpt", model, step=5)
    index = export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=max_shard_bytes)
    return model, index


def _import(src: str, tie: bool, stage: int):
    model = shardwise.shard(build_model(_config(tie), seed=9), stage=stage,
                            wrap={TransformerBlock})
    import_safetensors(src, model)
    return shardwise.full_state_dict(model)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_then_import_at_other_world_sizes_is_bitwise(tmp_path, tie):
    model, index = _exported(tmp_path, tie, max_shard_bytes=20_000)
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    want = model.state_dict()
    for world, stage in ((3, 3), (2, 1)):
        for got in run_ranks(_import, world, args=(str(tmp_path / "hf"), tie, stage)):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), (world, stage)


def test_hugging_face_names_config_and_tied_weights_stored_once(tmp_path):
    for tie in (False, True):
        _, index = _exported(tmp_path / str(tie), tie)
        names = set(json.loads(index.read_text())["weight_map"])
        layer = {f"model.layers.0.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
            "mlp.down_proj")}
        assert layer <= names and {"model.embed_tokens.weight", "model.norm.weight"} <= names
        assert ("lm_head.weight" in names) == (not tie)
        assert len(names) == 2 + 9 * 2 + (not tie)
        cfg = json.loads((index.parent / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is tie and cfg["num_key_value_heads"] == 2
        assert cfg["hidden_size"] == 32 and cfg["intermediate_size"] == 96


def _rotate_half_rope(x: torch.Tensor, positions: int, theta: float) -> torch.Tensor:
    """Hugging Face's LlamaRotaryEmbedding + apply_rotary_pos_emb, for (T, H, hd)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :].float(), emb.sin()[:, None, :].float()
    rotated = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
    return x * cos + rotated * sin


def test_exported_q_k_give_our_attention_scores_under_rotate_half(tmp_path):
    """[Note: RoPE layouts]: HF's q_proj/k_proj with rotate_half == our wq/wk interleaved."""
    model, index = _exported(tmp_path, False)
    tensors = {}
    for file in set(json.loads(index.read_text())["weight_map"].values()):
        tensors.update(load_file(str(index.parent / file)))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))  # (T, C)
    attn = model.layers[1].attention
    cos, sin = rope_tables(8, 8, model.config.rope_theta)

    def ours_scores():
        q = apply_rotary(attn.wq(x).view(1, 8, 4, 8), cos, sin)[0]  # (T, H, hd)
        k = apply_rotary(attn.wk(x).view(1, 8, 2, 8), cos, sin)[0]
        return q, k

    def hf_scores():
        q = (x @ tensors["model.layers.1.self_attn.q_proj.weight"].t()).view(8, 4, 8)
        k = (x @ tensors["model.layers.1.self_attn.k_proj.weight"].t()).view(8, 2, 8)
        return _rotate_half_rope(q, 8, 10000.0), _rotate_half_rope(k, 8, 10000.0)

    with torch.no_grad():
        results = []
        for q, k in (ours_scores(), hf_scores()):
            k = repeat_kv(k.permute(1, 0, 2)[None], 2)[0]  # (H, T, hd)
            results.append(q.permute(1, 0, 2) @ k.transpose(1, 2) / math.sqrt(8))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(tensors["model.layers.1.self_attn.q_proj.weight"], attn.wq.weight)


def test_import_names_the_missing_or_misshapen_tensor(tmp_path):
    _exported(tmp_path, False)
    other = build_model(get_model_config("debug", **{**LLAMA, "n_layers": 3}), seed=0)
    with pytest.raises(CheckpointError, match=r"config\.json: n_layers is 2, the model has 3"):
        import_safetensors(tmp_path / "hf", other)
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no tensor model\.layers\.2\.\S+ \(the "
                                              r"model's layers\.2\."):
        import_safetensors(tmp_path / "hf", other)
    wide = build_model(get_model_config("debug", **{**LLAMA, "vocab_size": 80}), seed=0)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001\.safetensors: tensor "
                                              r"model\.embed_tokens\.weight has shape \(64, 32\)"):
        import_safetensors(tmp_path / "hf", wide)


def test_export_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The writer asks for tensors one by one and keeps none: peak = the largest tensor."""
    from shardwise.checkpoint import export

    live, peak = [], [0]
    real = export.write_safetensors

    def spy(path, entries, produce, metadata=None):
        def watched(name):
            t = produce(name)
            live.append(t.numel())
            peak[0] = max(peak[0], t.numel())
            return t
        return real(path, entries, watched, metadata)
    monkeypatch.setattr(export, "write_safetensors", spy)
    model, index = _exported(tmp_path, False)
    assert peak[0] == max(p.numel() for p in model.parameters())
    with safe_open(str(index.parent / "model-00001-of-00001.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(live) == 21
