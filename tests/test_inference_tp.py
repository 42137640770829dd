"""Tensor-parallel decoding (shardwise/inference/tensor_parallel.py) against one process.

One launch of 4 Gloo ranks runs the whole grid: tp 4 (the 4 ranks) and tp 2 (two groups of
2, each decoding on its own), on the dense debug shape with grouped-query attention (2 KV
heads: at tp 4 each is copied to two ranks), full multi-head attention, tied embeddings and
MoE, on a left-padded batch of prompts of different lengths:

* greedy tokens identical to the unsharded model (tp 1), prefill and decode logits within
  1e-5;
* seeded top-k / top-p sampling identical on every rank and to tp 1, also when the ranks
  are given different seeds (rank 0's picks are broadcast: the ``choose`` hook matters);
* DCP checkpoints (dense, tied, MoE) and Hugging Face safetensors, each rank reading only
  its rows, hold exactly the pieces of the saved model and decode as it does;
* degrees the plan cannot split are refused with a ValueError naming the value, on every
  rank before any collective (the collectives after it still pair up), and in the launching
  process by ``check_tp_degree``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwise.checkpoint import save
from shardwise.checkpoint.export import export_safetensors
from shardwise.distributed.placement import placement_of
from shardwise.inference import Decoder, Sampling, generate
from shardwise.inference.tensor_parallel import (check_tp_degree, load_tp_model,
                                                 parallelize_for_decode, rank0_tokens)
from shardwise.models import build_model, get_model_config
from shardwise.testing import run_ranks

SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96,
         "max_seq_len": 64}
VARIANTS = {
    "dense": {},
    "mha": {"n_kv_heads": 4},
    "tied": {"tie_embeddings": True},
    "moe": {"num_experts": 4, "top_k": 2, "num_shared_experts": 1, "moe_ffn_dim": 64},
}
REFUSED = {  # (variant overrides, tp) the plan cannot split
    "heads_6_tp_4": ({"n_heads": 6, "n_kv_heads": 3, "dim": 96}, 4),
    "kv_3_tp_2": ({"n_heads": 6, "n_kv_heads": 3, "dim": 96}, 2),
    "mla_tp_2": ({"attention": "mla", "n_kv_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
                  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12}, 2),
}
LOADED = ("dense", "tied", "moe")  # saved as DCP checkpoints; dense also as safetensors
PROMPTS = [[1, 5, 9, 33, 2, 7, 8, 40, 41], [4, 5], [60], [90, 12, 13, 14, 15]]
NEW = 8
SAMPLING = Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=5)


def _config(over: dict):
    base = "debug-moe" if "num_experts" in over else "debug"
    return get_model_config(base, **{**SMALL, **over})


def _model(name: str) -> torch.nn.Module:
    return build_model(_config(VARIANTS[name]), seed=3).eval()


def _logits(model) -> torch.Tensor:
    """Prefill logits of the padded batch and 3 greedy decode steps': ``(4, B, V)``."""
    dec = Decoder(model)
    out = [dec.prefill(PROMPTS, max_new_tokens=3)]
    for _ in range(3):
        out.append(dec.step(out[-1].argmax(-1)))
    return torch.stack(out)


def _decode_all(model, group) -> dict:
    choose = rank0_tokens(group, "cpu")
    rank = dist.get_rank(group)  # within the tensor-parallel group
    return {
        "greedy": generate(model, PROMPTS, max_new_tokens=NEW, choose=choose).tokens,
        "logits": _logits(model),
        "sampled": generate(model, PROMPTS, max_new_tokens=NEW, sampling=SAMPLING,
                            choose=choose).tokens,
        # every rank of the group a different seed: only its rank 0's (seed 5) picks survive
        "sampled_own_seed": generate(
            model, PROMPTS, max_new_tokens=NEW, choose=choose,
            sampling=Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=5 + 7 * rank)).tokens,
    }


def _refusals(mesh) -> dict:
    out = {}
    for name, (over, tp) in REFUSED.items():
        if tp != mesh.size():
            continue
        try:
            parallelize_for_decode(build_model(_config(over), device="meta"), mesh)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _worker(checkpoints: dict[str, str]) -> dict:
    world = dist.get_world_size()
    meshes = {4: init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"],
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]}
    out = {}
    for tp, mesh in meshes.items():
        for name in VARIANTS:
            model = parallelize_for_decode(_model(name), mesh)
            out[(tp, name)] = _decode_all(model, mesh.get_group())
        out[(tp, "refused")] = _refusals(mesh)
        for kind, path in checkpoints.items():
            loaded = load_tp_model(path, mesh)
            name = kind.split("-")[1]
            whole = _model(name).state_dict()
            params = dict(loaded.model.named_parameters())
            out[(tp, kind)] = {
                "greedy": generate(loaded.model, PROMPTS, max_new_tokens=NEW,
                                   choose=rank0_tokens(mesh.get_group(), "cpu")).tokens,
                "local_shapes": {n: tuple(p.shape) for n, p in params.items()},
                "pieces_equal": all(torch.equal(p, placement_of(p).local_piece(whole[n]))
                                    for n, p in params.items())}
        dist.barrier()  # a refusal that had entered a collective would hang or mis-pair here
    return out


@functools.lru_cache(maxsize=None)
def _reference(name: str) -> dict:
    model = _model(name)
    return {"greedy": generate(model, PROMPTS, max_new_tokens=NEW).tokens,
            "logits": _logits(model),
            "sampled": generate(model, PROMPTS, max_new_tokens=NEW, sampling=SAMPLING).tokens}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_tp")
    checkpoints = {}
    for name in LOADED:
        save(root / name, _model(name), step=7)
        checkpoints[f"dcp-{name}"] = str(root / name)
    export_safetensors(root / "dense", root / "hf")
    checkpoints["hf-dense"] = str(root / "hf")
    per_rank = run_ranks(_worker, 4, args=(checkpoints,), timeout_s=240)
    return per_rank


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp_decode_equals_one_process(grid, tp, variant):
    want = _reference(variant)
    for rank, results in enumerate(grid):
        got = results[(tp, variant)]
        assert got["greedy"] == want["greedy"], (rank, variant, tp)
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        assert got["sampled"] == want["sampled"], (rank, variant, tp)
        # different seeds on the ranks: every rank continues with rank 0's (seed 5) picks
        assert got["sampled_own_seed"] == want["sampled"], (rank, variant, tp)


def test_the_ranks_differ_without_the_broadcast():
    """The seeds of the test above do give other tokens (so that test can fail)."""
    model = _model("dense")
    other = Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=12)
    assert generate(model, PROMPTS, max_new_tokens=NEW, sampling=other).tokens != \
        _reference("dense")["sampled"]


@pytest.mark.parametrize("kind", [f"dcp-{n}" for n in LOADED] + ["hf-dense"])
@pytest.mark.parametrize("tp", [2, 4])
def test_checkpoints_load_only_the_local_pieces(grid, tp, kind):
    want = _reference(kind.split("-")[1])["greedy"]
    for results in grid:
        got = results[(tp, kind)]
        assert got["greedy"] == want and got["pieces_equal"]
        shapes = got["local_shapes"]
        assert shapes["tok_embeddings.weight"] == (96 // tp, 64)
        assert shapes["layers.0.attention.wq.weight"] == (64 // tp, 64)
        assert shapes["layers.0.attention.wk.weight"] == (16 * max(2 // tp, 1), 64)
        assert shapes["layers.0.attention.wo.weight"] == (64, 64 // tp)


def test_degrees_the_plan_cannot_split_are_refused(grid):
    wants = {"heads_6_tp_4": "n_heads=6 is not divisible by tp=4",
             "kv_3_tp_2": "n_kv_heads=3 is not divisible by tp=2",
             "mla_tp_2": "attention='mla'"}
    for name, (over, tp) in REFUSED.items():
        for results in grid:
            assert wants[name] in results[(tp, "refused")][name]
        with pytest.raises(ValueError, match=wants[name].replace("(", r"\(")):
            check_tp_degree(_config(over), tp)
    check_tp_degree(_config(VARIANTS["dense"]), 4)  # 2 KV heads, each copied to 2 ranks
    with pytest.raises(ValueError, match="tp=0"):
        check_tp_degree(_config({}), 0)
