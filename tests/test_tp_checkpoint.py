"""Checkpoints reshard across tensor-parallel degrees, exactly (issue 11).

* The reshard matrix: model and AdamW state saved at tp 2 x dp_shard 2 stage 3 load
  bitwise at tp 1 x dp_shard 4 stage 1 and at tp 2 on 2 ranks; trained there and saved
  again, they load bitwise at tp 4 stage 2 (every KV head copied to two tensor ranks).
* ``state_dict()`` holds the unsplit names and shapes as DTensors over the sub-mesh each
  placement names; the checkpoint stores every KV head once.
* ``full_state_dict`` at any degree equals the unsplit model's state dict.
* Hugging Face safetensors exported from a tp 2 and a tp 4 checkpoint are byte-identical
  to the export from a tp 1 one, and import into a tp 2 x dp_shard 2 model exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.checkpoint.export import export_safetensors
from shardwise.checkpoint.metadata import SafeReader
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.reshard import (assert_same_files, assert_same_states, import_whole,
                                       load_train_save, save_fresh, save_trained)

LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def _build(seed: int, tp: int, stage: int):
    model = build_model(get_model_config("debug", **LLAMA), seed=seed)
    mesh = shardwise.ParallelDims(world_size=dist.get_world_size(), tp=tp).build_mesh()
    shardwise.apply_tp(model, mesh["tp"])
    shardwise.shard(model, stage=stage, wrap={TransformerBlock}, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, mesh


def _train(model, opt, mesh, steps: int) -> None:
    gen = torch.Generator().manual_seed(7 + mesh.local_rank("dp"))
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        shardwise.vocab_parallel_cross_entropy(logits, tokens[:, 1:], mesh["tp"]).backward()
        opt.step()
        opt.zero_grad()


def _layout(model):
    """The state dict's shapes (whole, DTensor or not) and one KV weight's mesh."""
    sd = model.state_dict()
    wk = sd["layers.0.attention.wk.weight"]
    shapes = {k: (tuple(v.shape), isinstance(v, DTensor)) for k, v in sd.items()}
    return shapes, (wk.device_mesh.mesh_dim_names,
                    tuple((type(p).__name__, getattr(p, "dim", None)) for p in wk.placements))


def test_reshard_matrix_across_tensor_parallel_degrees(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    want, (shapes, (names, placements)) = run_ranks(
        save_trained, 4, args=(_build, _train, first, 2, 3, 2, _layout))[0]
    unsplit = build_model(get_model_config("debug", **LLAMA), seed=0).state_dict()
    assert shapes == {k: (tuple(v.shape), True) for k, v in unsplit.items()}
    assert names == ("tp", "dp_shard") and placements == (("Shard", 0), ("Shard", 0))
    reload = (_build, _train, first)
    for got, resharded, _ in run_ranks(load_train_save, 2, args=(*reload, 2, 1, None)):
        assert_same_states(got, want, "tp2 dp1 stage1")
        assert resharded
    out = run_ranks(load_train_save, 4, args=(*reload, 1, 1, second))
    for got, resharded, _ in out:
        assert_same_states(got, want, "tp1 dp4 stage1")
        assert resharded
    trained = out[0][2]
    for got, resharded, _ in run_ranks(load_train_save, 4,
                                       args=(_build, _train, second, 4, 2, None)):
        assert_same_states(got, trained, "tp4 dp1 stage2")
        assert resharded


def _full(tp: int):
    model, _, _ = _build(0, tp, 3)
    return shardwise.full_state_dict(model)


def test_full_state_dict_and_hf_export_equal_the_unsplit_model(tmp_path):
    unsplit = build_model(get_model_config("debug", **LLAMA), seed=0).state_dict()
    for full in run_ranks(_full, 4, args=(4,)):
        assert full.keys() == unsplit.keys()
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit)
    exports = {}
    for tp, world in ((1, 2), (2, 2), (4, 4)):
        ckpt = tmp_path / f"tp{tp}"
        run_ranks(save_fresh, world, args=(_build, str(ckpt), tp, 2))
        exports[tp] = tmp_path / f"hf{tp}"
        export_safetensors(ckpt, exports[tp])
    assert_same_files(exports)
    for full in run_ranks(import_whole, 4, args=(_build, str(exports[1]), 2)):  # tp2 x dp2
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit)
    # At tp 4 each KV head lives on two tensor ranks; the checkpoint holds it once.
    md = SafeReader(tmp_path / "tp4").read_metadata().state_dict_metadata
    wk = md["model.layers.0.attention.wk.weight"]
    assert tuple(wk.size) == (16, 32) and len(wk.chunks) == 2
