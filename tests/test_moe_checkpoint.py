"""MoE models in Hugging Face's Mixtral layout: names, shapes, config.json, bitwise round trips
at other world sizes, Hugging Face's own MixtralForCausalLM (when transformers is installed),
and the refusals (shared experts, non-Mixtral routing, a non-zero routing bias)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from shardwise import checkpoint
from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.export import export_safetensors, import_safetensors
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
            moe_ffn_dim=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _config(**overrides):
    return get_model_config("debug-moe", **{**TINY, **overrides})


def _export(tmp_path, **overrides):
    model = build_model(_config(**overrides), seed=3)
    checkpoint.save(tmp_path / "ckpt", model, step=1)
    return model, export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=40_000)


def _import(src: str, stage: int):
    model = shardwise.shard(build_model(_config(), seed=9), stage=stage, wrap={TransformerBlock})
    import_safetensors(src, model)
    return shardwise.full_state_dict(model)


def test_mixtral_names_shapes_and_config(tmp_path):
    model, index = _export(tmp_path)
    weight_map = json.loads(index.read_text())["weight_map"]
    moe = "model.layers.1.block_sparse_moe"
    expected = {f"{moe}.gate.weight"} | {f"{moe}.experts.{j}.w{i}.weight"
                                         for j in range(8) for i in (1, 2, 3)}
    assert expected <= set(weight_map)
    assert not any("expert_bias" in n or "mlp." in n for n in weight_map)
    tensors = {}
    for file in set(weight_map.values()):
        tensors.update(load_file(str(tmp_path / "hf" / file)))
    experts = model.layers[1].feed_forward.experts
    for j in range(8):
        assert torch.equal(tensors[f"{moe}.experts.{j}.w1.weight"], experts.w1[j].t())
        assert torch.equal(tensors[f"{moe}.experts.{j}.w2.weight"], experts.w2[j].t())
        assert torch.equal(tensors[f"{moe}.experts.{j}.w3.weight"], experts.w3[j].t())
    assert torch.equal(tensors[f"{moe}.gate.weight"],
                       model.layers[1].feed_forward.router.gate.weight)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (8, 2, 16)


def test_export_then_import_at_other_world_sizes_is_bitwise(tmp_path):
    model, _ = _export(tmp_path)
    want = model.state_dict()
    for world, stage in ((2, 3), (3, 1)):  # 8 experts over 3 ranks: 3 + 3 + 2 each
        for got in run_ranks(_import, world, args=(str(tmp_path / "hf"), stage)):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), (world, stage)
    plain = build_model(_config(), seed=11)
    import_safetensors(tmp_path / "hf", plain)
    assert all(torch.equal(plain.state_dict()[k], want[k]) for k in want)


def test_import_sets_the_routing_bias_to_zero(tmp_path):
    _export(tmp_path)
    model = build_model(_config(), seed=9)
    model.layers[0].feed_forward.router.expert_bias.fill_(0.5)
    import_safetensors(tmp_path / "hf", model)
    assert not model.layers[0].feed_forward.router.expert_bias.any()


@pytest.mark.parametrize("overrides, field", [
    ({"num_shared_experts": 1}, "num_shared_experts=1"),
    ({"router_score": "sigmoid"}, "router_score='sigmoid'"),
    ({"moe_every": 2}, "moe_every=2"),
    ({"router_scale": 2.5}, "router_scale=2.5"),
    ({"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
      "v_head_dim": 4}, "attention='mla'"),
])
def test_models_without_a_mixtral_layout_are_refused(tmp_path, overrides, field):
    model = build_model(_config(**overrides), seed=3)
    checkpoint.save(tmp_path / "ckpt", model, step=1)
    with pytest.raises(ValueError, match=field):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match=field):
        import_safetensors(tmp_path / "nowhere", model)


def test_a_nonzero_routing_bias_is_refused(tmp_path):
    model = build_model(_config(), seed=3)
    model.layers[1].feed_forward.router.expert_bias[2] = 1e-3
    checkpoint.save(tmp_path / "ckpt", model, step=1)
    with pytest.raises(CheckpointError, match=r"layers\.1\.feed_forward\.router\.expert_bias "
                                              r"is non-zero"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf")


def test_missing_expert_tensor_is_named(tmp_path):
    _export(tmp_path)
    index = tmp_path / "hf" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["weight_map"]["model.layers.0.block_sparse_moe.experts.5.w2.weight"]
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"no tensor model\.layers\.0\.block_sparse_moe"
                                              r"\.experts\.5\.w2\.weight"):
        import_safetensors(tmp_path / "hf", build_model(_config(), seed=0))


def test_hugging_face_mixtral_computes_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, _ = _export(tmp_path)
    theirs = transformers.MixtralForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model.eval()(tokens), rtol=1e-5,
                                   atol=1e-6)
    theirs.save_pretrained(str(tmp_path / "saved"))  # their writer, our reader
    again = build_model(_config(), seed=5)
    import_safetensors(tmp_path / "saved", again)
    want = model.state_dict()
    assert all(torch.equal(again.state_dict()[k], want[k]) for k in want)
