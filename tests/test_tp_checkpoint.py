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

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwise
from shardwise import checkpoint
from shardwise.checkpoint.export import export_safetensors, import_safetensors
from shardwise.checkpoint.metadata import SafeReader
from shardwise.checkpoint.state import param_names
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.shard import sharded_param_specs
from shardwise.testing import run_ranks

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


def _full_optimizer(model, opt) -> dict:
    names, specs, out = param_names(model, opt), sharded_param_specs(model), {}
    for idx, st in sorted(opt.state_dict()["state"].items()):
        spec = specs[names[idx]]
        for key, v in sorted(st.items()):
            if key != "step":
                v = spec.to_dtensor(v).full_tensor()
            out[f"{names[idx]}.{key}"] = v.clone()
    return out


def _state(model, opt) -> tuple[dict, dict]:
    return shardwise.full_state_dict(model), _full_optimizer(model, opt)


def _save(path: str, tp: int, stage: int, train: int):
    model, opt, mesh = _build(0, tp, stage)
    _train(model, opt, mesh, train)
    checkpoint.save(path, model, opt, step=train)
    sd = model.state_dict()
    wk = sd["layers.0.attention.wk.weight"]
    shapes = {k: (tuple(v.shape), isinstance(v, DTensor)) for k, v in sd.items()}
    mesh_names = (wk.device_mesh.mesh_dim_names,
                  tuple((type(p).__name__, getattr(p, "dim", None)) for p in wk.placements))
    return _state(model, opt), shapes, mesh_names


def _load_train_save(path: str, tp: int, stage: int, out: str | None):
    model, opt, mesh = _build(1, tp, stage)
    info = checkpoint.load(path, model, opt)
    loaded = _state(model, opt)
    if out is None:
        return loaded, info.resharded, None
    _train(model, opt, mesh, 1)
    checkpoint.save(out, model, opt, step=3)
    return loaded, info.resharded, _state(model, opt)


def _same(got, want, where) -> None:
    for a, b in zip(got, want):
        assert a.keys() == b.keys(), where
        for k in a:
            assert torch.equal(a[k], b[k]), (where, k)


def test_reshard_matrix_across_tensor_parallel_degrees(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    want, shapes, (names, placements) = run_ranks(_save, 4, args=(first, 2, 3, 2))[0]
    unsplit = build_model(get_model_config("debug", **LLAMA), seed=0).state_dict()
    assert shapes == {k: (tuple(v.shape), True) for k, v in unsplit.items()}
    assert names == ("tp", "dp_shard") and placements == (("Shard", 0), ("Shard", 0))
    for got, resharded, _ in run_ranks(_load_train_save, 2, args=(first, 2, 1, None)):
        _same(got, want, "tp2 dp1 stage1")
        assert resharded
    out = run_ranks(_load_train_save, 4, args=(first, 1, 1, second))
    for got, resharded, _ in out:
        _same(got, want, "tp1 dp4 stage1")
        assert resharded
    trained = out[0][2]
    for got, resharded, _ in run_ranks(_load_train_save, 4, args=(second, 4, 2, None)):
        _same(got, trained, "tp4 dp1 stage2")
        assert resharded


def _full(tp: int):
    model, _, _ = _build(0, tp, 3)
    return shardwise.full_state_dict(model)


def _import(path: str, tp: int):
    """HF safetensors imported into a model parallelised at ``tp`` (each rank reads its
    piece), gathered back whole."""
    model, _, _ = _build(1, tp, 3)
    import_safetensors(path, model)
    return shardwise.full_state_dict(model)


def _save_fresh(path: str, tp: int) -> None:
    model, opt, _ = _build(0, tp, 2)
    checkpoint.save(path, model, opt, step=0)


def test_full_state_dict_and_hf_export_equal_the_unsplit_model(tmp_path):
    unsplit = build_model(get_model_config("debug", **LLAMA), seed=0).state_dict()
    for full in run_ranks(_full, 4, args=(4,)):
        assert full.keys() == unsplit.keys()
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit)
    exports = {}
    for tp, world in ((1, 2), (2, 2), (4, 4)):
        ckpt = tmp_path / f"tp{tp}"
        run_ranks(_save_fresh, world, args=(str(ckpt), tp))
        exports[tp] = tmp_path / f"hf{tp}"
        export_safetensors(ckpt, exports[tp])
    files = sorted(p.name for p in Path(exports[1]).iterdir())
    for tp in (2, 4):
        assert sorted(p.name for p in Path(exports[tp]).iterdir()) == files
        for name in files:
            assert (exports[tp] / name).read_bytes() == (exports[1] / name).read_bytes(), \
                (tp, name)
    for full in run_ranks(_import, 4, args=(str(exports[1]), 2)):  # tp 2 x dp_shard 2
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit)
    # At tp 4 each KV head lives on two tensor ranks; the checkpoint holds it once.
    md = SafeReader(tmp_path / "tp4").read_metadata().state_dict_metadata
    wk = md["model.layers.0.attention.wk.weight"]
    assert tuple(wk.size) == (16, 32) and len(wk.chunks) == 2
