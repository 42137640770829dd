"""State dicts of sharded models: DTensors that DCP saves and reshards, full tensors on demand."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks

LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def _build(seed: int):
    return build_model(get_model_config("debug", **LLAMA), seed=seed)


def _mesh(hybrid: bool):
    if not hybrid:
        return None
    world = dist.get_world_size()
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def _train_and_save(path: str, stage: int, hybrid: bool):
    model = shardwise.shard(_build(0), stage=stage, wrap={TransformerBlock}, mesh=_mesh(hybrid))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    w = sd["layers.0.attention.wq.weight"]
    kinds = (type(w).__name__, tuple(w.placements) if isinstance(w, DTensor) else None,
             tuple(w.shape))
    dcp.save(sd, checkpoint_id=path)
    return kinds, shardwise.full_state_dict(model)


def _load(path: str, stage: int, hybrid: bool, tokens: torch.Tensor):
    model = shardwise.shard(_build(1), stage=stage, wrap={TransformerBlock}, mesh=_mesh(hybrid))
    with torch.no_grad():  # gather once with the old weights: loading must invalidate that
        model(tokens)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    with torch.no_grad():
        logits = model(tokens)
    return shardwise.full_state_dict(model), logits


def test_dcp_reshards_across_world_sizes_stages_and_meshes(tmp_path):
    path = str(tmp_path / "ckpt")
    kinds, saved = run_ranks(_train_and_save, 2, args=(path, 3, False))[0]
    assert kinds == ("DTensor", (Shard(0),), (32, 32))
    ref = _build(0)
    ref.load_state_dict(saved)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = ref(tokens)
    for world, stage, hybrid in [(3, 1, False), (1, 2, False), (4, 3, True), (5, 3, False)]:
        out = run_ranks(_load, world, args=(path, stage, hybrid, tokens))
        for full, logits in out:
            assert full.keys() == saved.keys()
            for k in saved:
                assert torch.equal(full[k], saved[k]), (world, stage, k)
            assert torch.equal(logits, expected), (world, stage)


def test_hybrid_state_dict_is_replicated_over_the_replica_axis(tmp_path):
    kinds, _ = run_ranks(_train_and_save, 4, args=(str(tmp_path / "h"), 2, True))[0]
    assert kinds == ("DTensor", (Replicate(), Shard(0)), (32, 32))


def _load_full(full: dict, stage: int):
    model = shardwise.shard(_build(2), stage=stage, wrap={TransformerBlock})
    result = model.load_state_dict(full)
    rank0 = shardwise.full_state_dict(model, rank0_only=True)
    return list(result.missing_keys), shardwise.full_state_dict(model), len(rank0)


def test_plain_full_state_dict_loads_into_any_layout():
    full = _build(3).state_dict()
    for stage in (1, 3):
        out = run_ranks(_load_full, 3, args=(full, stage))
        for rank, (missing, back, n_rank0) in enumerate(out):
            assert missing == []
            assert all(torch.equal(back[k], full[k]) for k in full)
            assert n_rank0 == (len(full) if rank == 0 else 0)


def test_wrong_shapes_are_named():
    full = _build(3).state_dict()
    full["norm.weight"] = torch.zeros(7)
    model = shardwise.shard(_build(2), stage=3, wrap={TransformerBlock})
    try:
        model.load_state_dict(full)
    except RuntimeError as e:
        assert ("size mismatch for norm.weight: the checkpoint has shape (7,), the model "
                "expects (32,)") in str(e)
    else:
        raise AssertionError("a wrong shape loaded silently")
