"""Sharded checkpoints: resharding across layouts (model + optimizer), exact state, named
errors for damaged or foreign checkpoints, no unsafe unpickling, kills during save, and
background saves that overlap training with bounded memory."""

from __future__ import annotations

import os
import pickle
import random
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardwise
from shardwise import checkpoint
from shardwise.checkpoint import Checkpointer, CheckpointError, jsonable
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.dist import RankFailure
from shardwise.testing.reshard import assert_same_states, full_optimizer_state

LLAMA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             multiple_of=16)


def _build(seed: int, stage: int | None, hybrid: bool = False, **over):
    model = build_model(get_model_config("debug", **{**LLAMA, **over}), seed=seed)
    if stage is not None:
        mesh = None
        if hybrid:
            world = dist.get_world_size()
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        model = shardwise.shard(model, stage=stage, wrap={TransformerBlock}, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model, opt, steps: int, seed: int = 0) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()


def _state(model, opt) -> tuple[dict, dict, list]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return shardwise.full_state_dict(model), full_optimizer_state(model, opt), groups


def _save(path: str, stage: int, hybrid: bool):
    model, opt = _build(0, stage, hybrid)
    _train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.0042  # a hyper-parameter that must come back
    checkpoint.save(path, model, opt, step=2)
    return _state(model, opt)


def _load(path: str, stage: int, hybrid: bool):
    model, opt = _build(1, stage, hybrid)
    info = checkpoint.load(path, model, opt)
    return _state(model, opt), info.resharded


def _assert_same(got, want, where) -> None:
    assert_same_states(got[:2], want[:2], where)
    assert got[2] == want[2], where


# (save world, stage, hybrid) -> [(load world, stage, hybrid)]
_MATRIX = {
    (2, 3, False): [(3, 1, False), (1, 2, False), (8, 3, True)],
    (4, 2, True): [(5, 3, False), (1, 3, False)],
    (3, 1, False): [(4, 3, True), (2, 2, False)],
    (2, 0, False): [(3, 3, False)],
}


@pytest.mark.parametrize("source", list(_MATRIX), ids=lambda s: f"w{s[0]}s{s[1]}{'h' * s[2]}")
def test_model_and_optimizer_reshard_across_world_sizes_stages_and_meshes(tmp_path, source):
    path = str(tmp_path / "ckpt")
    world, stage, hybrid = source
    want = run_ranks(_save, world, args=(path, stage, hybrid), timeout_s=120)[0]
    assert len(want[1]) == 3 * len(want[0])  # exp_avg, exp_avg_sq, step per parameter
    for target in _MATRIX[source]:
        out = run_ranks(_load, target[0], args=(path, *target[1:]), timeout_s=120)
        for got, resharded in out:
            _assert_same(got, want, (source, target))
            assert resharded


# ----------------------------------------------------------------------------- single process


def _saved(tmp_path: Path, **over) -> tuple[Path, torch.nn.Module]:
    model, opt = _build(0, None, **over)
    _train(model, opt, 1)
    path = tmp_path / "ckpt"
    checkpoint.save(path, model, opt, extra={"note": "hi", "nums": (1, 2.5)}, step=1)
    return path, model


def test_rng_states_and_extras_round_trip(tmp_path):
    model, opt = _build(0, None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    _train(model, opt, 1)  # an optimizer step before the schedule's, as training runs them
    sched.step()
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    checkpoint.save(tmp_path / "c", model, opt, extra={"schedule": sched, "k": {"a": (1, None)}})
    expect = (torch.rand(3), random.random(), np.random.rand())
    model2, opt2 = _build(1, None)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s)
    info = checkpoint.load(tmp_path / "c", model2, opt2, extra={"schedule": sched2})
    assert info.rng_restored and not info.resharded
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1]
    assert np.random.rand() == expect[2]
    assert sched2.last_epoch == 1 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert info.extra["k"] == {"a": (1, None)}


def test_json_state_is_lossless_and_refuses_objects():
    value = {"t": (1, 2.0, float("inf")), 3: b"\x00\xff", "x": torch.arange(4).view(2, 2),
             "a": np.arange(3, dtype=np.uint32), "n": [None, True, "s"]}
    back = jsonable.decode(jsonable.encode(value))
    assert back["t"] == value["t"] and back[3] == value[3] and back["n"] == value["n"]
    assert torch.equal(back["x"], value["x"]) and (back["a"] == value["a"]).all()
    with pytest.raises(ValueError, match=r"extra\.cfg\.fn = .* cannot be stored"):
        jsonable.encode({"cfg": {"fn": object()}})


def _damage(path: Path, what: str) -> None:
    data = sorted(path.glob("__*.distcp"))[0]
    if what == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif what == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3] ^= 0x40
        data.write_bytes(bytes(raw))
    elif what == "delete":
        data.unlink()
    elif what == "metadata":
        md = path / ".metadata"
        md.write_bytes(md.read_bytes()[:-7])
    elif what == "manifest":
        (path / "manifest.json").unlink()


@pytest.mark.parametrize("what, expected", [
    ("truncate", r"file __0_0\.distcp is truncated: \d+ bytes, the manifest says \d+; tensor "
                 r"\S+ \(bytes \d+\.\.\d+\) is cut off"),
    ("flip", r"file __0_0\.distcp is corrupted: bytes \d+\.\.\d+, tensor (model|optim)\.\S+ "
             r"\(chunk at offset .*\), fail their sha256 check"),
    ("delete", r"file __0_0\.distcp is missing \(written by rank 0 of 1\); the checkpoint is "
               r"incomplete"),
    ("metadata", r"\.metadata \(DCP's index\) is truncated"),
    ("manifest", r"has no manifest\.json: it is incomplete or not a shardwise checkpoint"),
])
def test_damaged_checkpoints_fail_naming_file_and_tensor(tmp_path, what, expected):
    path, _ = _saved(tmp_path)
    _damage(path, what)
    model, opt = _build(1, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched


@pytest.mark.parametrize("over, expected", [
    ({"dim": 48, "n_heads": 6, "n_kv_heads": 3},
     r"tensor model\.tok_embeddings\.weight has shape \(64, 32\), the model expects \(64, 48\)"),
    ({"n_layers": 3}, r"has no tensor model\.layers\.2\.\S+ \(missing 9 of the model's 30"),
    ({"n_layers": 1}, r"has tensors the model lacks: model\.layers\.1\.\S+ \(9 in all"),
])
def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path, over, expected):
    path, _ = _saved(tmp_path)
    model, opt = _build(1, None, **over)
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load(path, model, opt)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_malicious_metadata_pickle_is_never_executed(tmp_path, monkeypatch):
    """Even with a manifest re-hashed to match, the restricted unpickler refuses os.system."""
    import json

    from shardwise.checkpoint.atomic import hash_whole_file

    monkeypatch.chdir(tmp_path)
    path, _ = _saved(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["metadata"] = hash_whole_file(path / ".metadata")
    (path / "manifest.json").write_text(json.dumps(manifest))
    model, opt = _build(1, None)
    with pytest.raises(CheckpointError, match=r"refers to posix\.system.*refusing to unpickle"):
        checkpoint.load(path, model, opt)
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- kills


def _save_then_die(root: str, where: str):
    model, opt = _build(0, 3)
    ckpt = Checkpointer(root, keep_last=0)
    _train(model, opt, 1)
    ckpt.save(1, model, opt)
    _train(model, opt, 1)
    if where == "rank 1 mid-write" and dist.get_rank() == 1:
        import torch.distributed.checkpoint.filesystem as fs

        real = fs._write_item

        def write_half_then_die(transforms, stream, data, *args, **kwargs):
            stream.write(b"\x00" * 100)
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return real(transforms, stream, data, *args, **kwargs)
        fs._write_item = write_half_then_die
    if where == "rank 0 before commit" and dist.get_rank() == 0:
        from shardwise.checkpoint import atomic

        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        atomic.commit = die
    ckpt.save(2, model, opt)
    return "survived"


@pytest.mark.parametrize("where", ["rank 1 mid-write", "rank 0 before commit"])
def test_a_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    root = tmp_path / "ckpts"
    with pytest.raises(RankFailure, match="SIGKILL"):
        run_ranks(_save_then_die, 2, args=(str(root), where), timeout_s=60, grace_s=2)
    assert checkpoint.latest_checkpoint(root) == root / "step_00000001"
    assert (root / ".step_00000002.partial").is_dir()
    model, opt = _build(1, None)
    assert checkpoint.load(root / "step_00000001", model, opt).step == 1
    with pytest.raises(CheckpointError, match="never committed: it may be incomplete"):
        checkpoint.load(root / ".step_00000002.partial", model, opt)


# ----------------------------------------------------------------------------- async


def _any(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _async_run(root: str, delay_s: float, limit: int | None):
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def slow(*args, **kwargs):  # a slow disk
        time.sleep(delay_s)
        return real(*args, **kwargs)
    fs._write_item = slow
    model, opt = _build(0, 3)
    _train(model, opt, 1)
    ckpt = Checkpointer(root, keep_last=0, async_save=True, max_snapshot_bytes=limit)
    params = list(model.parameters())  # weights, exp_avg, exp_avg_sq, and a 0-d step each
    local = sum(p.numel() * 4 for p in params) * 3 + 4 * len(params)
    at_save = shardwise.full_state_dict(model)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = ckpt.save(1, model, opt)
    submit_s = time.perf_counter() - t0
    steps_during = 0
    while _any(ckpt.in_flight):  # every rank trains the same steps (collectives must match)
        _train(model, opt, 1, seed=steps_during + 1)  # training goes on, weights change
        steps_during += 1
    t0 = time.perf_counter()
    ckpt.save(2, model, opt)
    ckpt.close()
    second_s = time.perf_counter() - t0
    fresh, opt2 = _build(1, 3)
    checkpoint.load(Path(root) / "step_00000001", fresh, opt2)
    same = all(torch.equal(v, at_save[k]) for k, v in shardwise.full_state_dict(fresh).items())
    steps_total = int(opt.state_dict()["state"][0]["step"].item())
    return (returned, submit_s, steps_during, ckpt.peak_snapshot_bytes, local, same,
            second_s, steps_total, [str(w.message) for w in caught])


def test_async_save_overlaps_training_with_a_bounded_snapshot(tmp_path):
    out = run_ranks(_async_run, 2, args=(str(tmp_path / "a"), 0.02, None), timeout_s=120)
    for returned, submit_s, steps_during, peak, local, same, second_s, _, _ in out:
        assert returned is None and steps_during >= 1      # the write ran behind training
        assert submit_s < second_s  # blocking on the snapshot only, not on the write
        assert peak == local        # the snapshot is exactly this rank's shards + state
        assert same                 # and holds the weights as they were at save time
    steps_during = out[0][2]
    assert [s for *_, s, _ in out] == [steps_during + 1] * 2
    assert checkpoint.list_checkpoints(tmp_path / "a")[-1][0] == 2


def test_async_save_over_its_memory_bound_saves_synchronously(tmp_path):
    out = run_ranks(_async_run, 2, args=(str(tmp_path / "b"), 0.0, 1000), timeout_s=120)
    for returned, _, steps_during, peak, _, same, _, _, caught in out:
        assert returned is not None and steps_during == 0 and peak == 0 and same
        assert any("saving synchronously" in m for m in caught)


def _offloaded(root: str, stage: int):
    from shardwise.shard.offload import Offload, offload_optimizer

    model, plain = _build(0, stage)
    opt = offload_optimizer(plain, Offload(device="disk", path=root, buffer_mb=0.05),
                            model=model, _force_host_masters=True)
    _train(model, opt, 2)
    checkpoint.save(Path(root) / "ckpt", model, opt)
    want = _state(model, opt)
    opt.close()
    return want


def test_an_offloaded_optimizer_saves_and_loads_like_any_other(tmp_path):
    """Disk offload with host masters standing in for the parameters, 2 ranks -> 3 ranks."""
    want = run_ranks(_offloaded, 2, args=(str(tmp_path), 3), timeout_s=120)[0]
    for got, _ in run_ranks(_load, 3, args=(str(tmp_path / "ckpt"), 2, False), timeout_s=120):
        _assert_same(got, want, "offload")
