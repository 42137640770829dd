"""CPU and disk offload of optimizer state: bitwise parity with no offload (one process and
two ranks at stage 3), RAM for streamed state under the buffer, directory checks before
training, files removed at exit, state dicts and LR schedulers."""

from __future__ import annotations

import gc
import io
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import build_model, get_model_config
from shardwise.shard.offload import Offload, offload_optimizer
from shardwise.shard.offload.disk import RUN_PREFIX, _host_tag, remove_orphans
from shardwise.shard.offload.host import estimate_state_bytes
from shardwise.testing.dist import _context as _mp_context

CFG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
BUFFER_MB = 0.2  # the debug model's AdamW state is ~0.8 MB: about 4x the buffer
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: a second intra-op thread only adds contention on a busy 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model():
    return build_model(get_model_config("debug", **CFG), seed=0)


def _batches(n: int, rank: int = 0, world: int = 1, batch: int = 2, seq: int = 16):
    """This rank's slice of n global batches of random tokens."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG["vocab_size"], (n, world * batch, seq + 1), generator=g)
    return [t[rank * batch:(rank + 1) * batch] for t in tokens]


def _train(model, opt, batches, sched=None) -> None:
    for x in batches:
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _policy(kind: str, path) -> tuple[Offload, dict]:
    """(policy, extra offload_optimizer kwargs) of a named configuration."""
    disk = dict(device="disk", path=str(path), buffer_mb=BUFFER_MB)
    return {
        "cpu": (Offload(), {}),
        "cpu-host-masters": (Offload(), {"_force_host_masters": True}),
        "cpu-budget": (Offload(budget_bytes=300_000), {"_force_host_masters": True}),
        "disk": (Offload(**disk), {}),
        "disk-no-prefetch": (Offload(**disk, prefetch=False), {}),
        "disk-host-masters": (Offload(**disk), {"_force_host_masters": True}),
        "disk-budget": (Offload(**disk, budget_bytes=300_000), {}),
    }[kind]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _reference(opt_name: str, steps: int):
    model = _model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, _batches(steps))
    return model, opt


@pytest.mark.parametrize("kind", ["cpu", "cpu-host-masters", "cpu-budget", "disk",
                                  "disk-no-prefetch", "disk-host-masters", "disk-budget"])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_offload_is_bitwise_equal_to_no_offload(opt_name, kind, tmp_path):
    ref, ref_opt = _reference(opt_name, 4)
    model = _model()
    policy, kw = _policy(kind, tmp_path)
    with offload_optimizer(OPTIMIZERS[opt_name](model.parameters()), policy, model=model,
                           **kw) as opt:
        _train(model, opt, _batches(4))
        assert _same(ref.parameters(), model.parameters())
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        assert sd["state"].keys() == ref_sd["state"].keys()
        for k, st in ref_sd["state"].items():
            assert _same(st.values(), sd["state"][k].values())
        stats = opt.stats()
        if kind.endswith("budget"):
            assert stats.offloaded_params > 0 and stats.kept_params > 0
            assert stats.offloaded_bytes <= policy.budget_bytes
    assert os.listdir(tmp_path) == []


def test_disk_state_streams_through_a_buffer_several_times_smaller(tmp_path):
    model = _model()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                            Offload(device="disk", path=str(tmp_path), buffer_mb=BUFFER_MB))
    _train(model, opt, _batches(3))
    stats = opt.stats()
    assert stats.file_bytes >= 3 * stats.buffer_bytes  # the state is >3x the buffer ...
    assert 0 < stats.peak_resident_bytes <= stats.buffer_bytes  # ... and RAM held stays under it
    assert stats.read_bytes == 2 * stats.file_bytes  # steps 2 and 3 read it all, step 1 made it
    opt.step()  # no gradients: nothing to read
    assert not opt.state  # between steps no streamed state stays in RAM
    file = os.path.join(stats.run_dir, "state.bin")
    assert os.path.getsize(file) == stats.file_bytes  # the files exist during training
    opt.close()
    assert not os.path.exists(stats.run_dir) and os.listdir(tmp_path) == []
    opt.close()  # idempotent


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_odd_sizes_scalars_and_empty_shards_stream_exactly(opt_name, tmp_path):
    # Sizes that are not multiples of the 64-byte alignment, a 0-d parameter and an empty
    # shard (a rank with no rows of a small parameter).
    shapes = [(0, 4), (3,), (), (5, 7)]
    ps, ref = ([torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                for i, s in enumerate(shapes)] for _ in range(2))
    opt = offload_optimizer(OPTIMIZERS[opt_name](ps),
                            Offload(device="disk", path=str(tmp_path), buffer_mb=0.001))
    ref_opt = OPTIMIZERS[opt_name](ref)
    for i in range(3):
        for a, b in zip(ps, ref):
            a.grad = torch.full_like(a, i + 0.5)
            b.grad = torch.full_like(b, i + 0.5)
        opt.step()
        ref_opt.step()
    assert _same(ps, ref)
    for k, st in ref_opt.state_dict()["state"].items():
        assert _same(st.values(), opt.state_dict()["state"][k].values())
    opt.close()


def test_state_size_estimate_matches_the_first_step():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    est, how = estimate_state_bytes(opt)
    _train(model, opt, _batches(1))
    real = [sum(-(-v.numel() * v.element_size() // 64) * 64 for v in opt.state[p].values())
            for p in model.parameters()]
    assert how == "meta" and est == real


def _leave_files(path: str, run_atexit: bool, q) -> None:
    """In a child process: make a disk-offloaded optimizer, step, exit without close()."""
    import atexit
    p = torch.nn.Parameter(torch.ones(1000))
    p.grad = torch.ones(1000)
    opt = offload_optimizer(torch.optim.AdamW([p]), Offload(device="disk", path=path))
    opt.step()
    q.put(opt.stats().run_dir)
    if run_atexit:  # only the interpreter-exit hook may remove the files here
        opt._store._mp_finalizer.cancel()
        atexit._run_exitfuncs()  # what a plain interpreter runs at exit


def test_files_are_removed_on_garbage_collection_and_at_exit(tmp_path):
    model = _model()
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()),
                            Offload(device="disk", path=str(tmp_path), buffer_mb=BUFFER_MB))
    _train(model, opt, _batches(1))
    run_dir = opt.stats().run_dir
    assert os.path.exists(run_dir)
    del opt
    gc.collect()
    assert not os.path.exists(run_dir)
    ctx = _mp_context()  # the test harness's preloaded forkserver: a child costs a fork
    for run_atexit in (True, False):  # atexit; multiprocessing's exit (os._exit skips atexit)
        q = ctx.Queue()
        child = ctx.Process(target=_leave_files, args=(str(tmp_path), run_atexit, q))
        child.start()
        run_dir = q.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0 and run_dir.startswith(str(tmp_path))
        assert not os.path.exists(run_dir)


def test_orphans_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    import fcntl
    dead, live = (tmp_path / f"{RUN_PREFIX}-{_host_tag()}-rank{r}-x" for r in (0, 1))
    other = tmp_path / f"{RUN_PREFIX}-otherhost-rank0-x"
    for d in (dead, live, other):
        d.mkdir()
        (d / "state.bin").write_bytes(b"x" * 10)
    fd = os.open(live / "state.bin", os.O_RDONLY)  # a live owner holds the lock
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_orphans(str(tmp_path)) == [str(dead)]
        assert live.exists() and other.exists()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="gpu"), "'gpu'"),
    (dict(device="disk"), "needs path"),
    (dict(device="cpu", path="/tmp"), "only used with device='disk'"),
    (dict(buffer_mb=0), r"Offload\(buffer_mb=0\): expected a number > 0"),
    (dict(buffer_mb=-1.5), "-1.5"),
    (dict(buffer_mb=True), "True"),
    (dict(budget_bytes=-1), "budget_bytes.*-1"),
])
def test_bad_policies_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Offload(**kwargs)


def _wrap(path, **kw):
    p = torch.nn.Parameter(torch.zeros(1000))
    return offload_optimizer(torch.optim.AdamW([p]), Offload(device="disk", path=str(path)),
                             **kw)


def test_missing_or_non_directory_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="nope.*does not exist"):
        _wrap(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file.*is not a directory"):
        _wrap(tmp_path / "file")


def test_read_only_directory_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root ignores modes: simulate what a non-root user sees
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(ro)
                                else real(p, mode, **kw))
        with pytest.raises(ValueError, match="ro'.*read-only"):
            _wrap(ro)
    finally:
        ro.chmod(0o755)


def test_full_directory_is_refused_before_training(tmp_path, monkeypatch):
    need = 2 * 4032 + 64  # exp_avg, exp_avg_sq (4000 bytes each) and step, 64-byte aligned
    full = lambda p: SimpleNamespace(free=need - 1)  # noqa: E731
    with pytest.raises(ValueError, match=f"needs .*\\({need} bytes\\)"):
        _wrap(tmp_path, disk_usage=full)
    _wrap(tmp_path, disk_usage=lambda p: SimpleNamespace(free=need)).close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks of this host share the disk
    with pytest.raises(ValueError, match="4 rank"):
        _wrap(tmp_path, disk_usage=lambda p: SimpleNamespace(free=3 * need))
    assert os.listdir(tmp_path) == []  # refused before writing anything


def test_bad_optimizers_and_small_buffers_are_refused(tmp_path):
    p = torch.nn.Parameter(torch.zeros(100_000))
    with pytest.raises(ValueError, match="LBFGS"):
        offload_optimizer(torch.optim.LBFGS([p]), Offload())
    with pytest.raises(ValueError, match="torch.optim.Optimizer, got list"):
        offload_optimizer([p], Offload())
    opt = offload_optimizer(torch.optim.SGD([p]), Offload())
    with pytest.raises(ValueError, match="already offloaded"):
        offload_optimizer(opt, Offload())
    with pytest.raises(ValueError, match=r"800064 bytes.*buffer_mb >= 1.53"):
        offload_optimizer(torch.optim.Adam([p]),
                          Offload(device="disk", path=str(tmp_path), buffer_mb=0.5))


@pytest.mark.parametrize("kind", ["cpu-host-masters", "disk"])
def test_state_dict_round_trip_resumes_bitwise(kind, tmp_path):
    ref, _ = _reference("adamw", 6)
    batches = _batches(6)
    model = _model()
    policy, kw = _policy(kind, tmp_path)
    with offload_optimizer(OPTIMIZERS["adamw"](model.parameters()), policy, **kw) as opt:
        _train(model, opt, batches[:3])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    plain = torch.optim.AdamW(_model().parameters())  # the format is torch.optim's own
    plain.load_state_dict(ckpt["optim"])
    resumed = _model()
    resumed.load_state_dict(ckpt["model"])
    with offload_optimizer(OPTIMIZERS["adamw"](resumed.parameters()), policy, **kw) as opt:
        opt.load_state_dict(ckpt["optim"])
        _train(resumed, opt, batches[3:])
    assert _same(ref.parameters(), resumed.parameters())


def test_lr_scheduler_and_closure_work_on_the_wrapper(tmp_path):
    def run(policy):
        model = _model()
        opt = OPTIMIZERS["adamw"](model.parameters())
        if policy is not None:
            opt = offload_optimizer(opt, policy)
            assert isinstance(opt, torch.optim.Optimizer)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            _train(model, opt, _batches(3), sched)
        x = _batches(1)[0]

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            return loss
        loss = opt.step(closure)
        return model, opt.param_groups[0]["lr"], loss, sched.state_dict()

    ref = run(None)
    got = run(Offload(device="disk", path=str(tmp_path), buffer_mb=BUFFER_MB))
    assert got[1] == ref[1] == 1e-2 / 4 and torch.equal(got[2], ref[2])
    assert got[3]["last_epoch"] == 3
    assert _same(ref[0].parameters(), got[0].parameters())


def test_state_created_before_wrapping_moves_to_disk(tmp_path):
    ref, _ = _reference("adamw", 4)
    model = _model()
    opt = OPTIMIZERS["adamw"](model.parameters())
    _train(model, opt, _batches(4)[:2])
    with offload_optimizer(opt, Offload(device="disk", path=str(tmp_path),
                                        buffer_mb=BUFFER_MB)) as wrapped:
        assert not wrapped.state and wrapped.stats().file_bytes > 0
        _train(model, wrapped, _batches(4)[2:])
    assert _same(ref.parameters(), model.parameters())
