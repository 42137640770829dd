"""The collective watchdog on real Gloo ranks: hangs, divergence, dead and failing ranks.

Every case checks the one report all ranks raise: its first line names the cause (the rank,
the collective's kind, label and sequence number), and the detection time is bounded by the
timeout (seconds here, minutes by default). Ranks that die write what they saw to files,
since ``run_ranks`` reports a dead rank instead of the survivors' return values.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed import watchdog as wdm
from shardwise.distributed.watchdog.diagnosis import compact_ranks, compose
from shardwise.testing.dist import RankFailure, run_ranks

T = 2.0  # collective timeout of these tests, seconds


def _start(**kw) -> wdm.Watchdog:
    kw.setdefault("timeout_s", T)
    return wdm.start(wdm.WatchdogConfig(**kw))


def _outcome(fn, *args) -> tuple[float, str, bool]:
    """Run ``fn``; return (seconds until the report, the report, whether this rank wrote it)."""
    start = time.monotonic()
    try:
        with wdm.guard():
            fn(*args)
    except wdm.CollectiveError as exc:
        return time.monotonic() - start, str(exc), exc.reporter
    finally:
        wdm.stop()
    return time.monotonic() - start, "no report", False


def _save(out: str, result) -> None:
    Path(out, f"rank{dist.get_rank()}.txt").write_text(f"{result[0]}\n{result[1]}")


def _read(out: Path, rank: int) -> tuple[float, str]:
    seconds, report = (out / f"rank{rank}.txt").read_text().split("\n", 1)
    return float(seconds), report


# ----------------------------------------------------------------------------- scenarios


def _never_issues_then_idles() -> None:
    x = torch.ones(4)
    comm.all_reduce(x, label="warmup")
    if dist.get_rank() == 1:
        while True:  # stuck in Python, never reaching the collective
            time.sleep(0.02)
    comm.all_reduce(x, label="step.loss")


def _skip_case():
    _start()
    return _outcome(_never_issues_then_idles)


def test_a_skipped_collective_fails_every_rank_with_one_report_within_the_timeout():
    results = run_ranks(_skip_case, world_size=2, timeout_s=60, collective_timeout_s=T + 2)
    (t0, report, mine0), (t1, report1, mine1) = results
    assert report == report1 and mine0 != mine1  # one message, composed by one rank
    head = report.splitlines()[0]
    assert head == ("shardwise watchdog: collective all_reduce 'step.loss' float32[4] (seq 1 of "
                    f"group 0 [ranks 0-1]) did not complete within {T:g} s on rank 0: rank 1 "
                    "never issued it")
    assert "rank 1 (host" in report and "not in a collective" in report
    assert "in _never_issues_then_idles\n    time.sleep(0.02)" in report  # rank 1's stack
    assert "--- Python stack of rank 0:" in report
    assert 'comm.all_reduce(x, label="step.loss")' in report
    assert T <= t0 < T + 4 and T <= t1 < T + 4, (t0, t1)  # slack for a loaded machine


def _reordered(rank_to_swap: int) -> None:
    x = torch.ones(4)
    for i in range(10_000):
        order = ("a", "b") if dist.get_rank() != rank_to_swap or i != 5 else ("b", "a")
        for label in order:
            comm.all_reduce(x, label=label)
        time.sleep(0.001)


def _reorder_case():
    _start()
    return _outcome(_reordered, 2)


def test_a_reordered_collective_is_caught_without_any_hang():
    """Same shapes, so Gloo silently pairs the wrong collectives; the fingerprints differ."""
    results = run_ranks(_reorder_case, world_size=3, timeout_s=60, collective_timeout_s=30)
    reports = {r[1] for r in results}
    assert len(reports) == 1
    report = reports.pop()
    assert report.splitlines()[0] == (
        "shardwise watchdog: ranks disagree on collective seq 10 of group 0 [ranks 0-2]: "
        "ranks 0-1 issued all_reduce 'a' float32[4]; rank 2 issued all_reduce 'b' float32[4]")
    assert "rank 2 diverged from the others" in report
    assert max(r[0] for r in results) < 5.0  # a few polls, not the 30 s timeout


def _shapes_differ() -> None:
    comm.all_reduce(torch.ones(3), label="ok")
    comm.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 6), label="grads.bucket0")


def _debug_case():
    _start(mode="debug")
    return _outcome(_shapes_differ)


def test_debug_mode_names_differing_shapes_before_the_collective_runs():
    results = run_ranks(_debug_case, world_size=2, timeout_s=60, collective_timeout_s=T + 2)
    assert results[0][1] == results[1][1]
    assert results[0][1].splitlines()[0] == (
        "shardwise watchdog: ranks disagree on collective seq 1 of group 0 [ranks 0-1]: rank 0 "
        "issued all_reduce 'grads.bucket0' float32[4]; rank 1 issued all_reduce "
        "'grads.bucket0' float32[6]")
    assert max(r[0] for r in results) < 1.5


def _raises_on_rank_one() -> None:
    x = torch.ones(4)
    comm.all_reduce(x, label="warmup")
    if dist.get_rank() == 1:
        raise ValueError("tokenizer returned id 70000 >= vocab_size 32000")
    comm.all_reduce(x, label="step.loss")


def _exception_case():
    _start(timeout_s=30.0)
    try:
        return _outcome(_raises_on_rank_one)
    except ValueError as exc:
        return 0.0, f"own: {exc}", False


def test_an_exception_on_one_rank_stops_the_others_promptly_naming_it():
    results = run_ranks(_exception_case, world_size=2, timeout_s=60, collective_timeout_s=30)
    seconds, report, _ = results[0]
    assert results[1][1] == "own: tokenizer returned id 70000 >= vocab_size 32000"
    assert report.splitlines()[0] == ("shardwise watchdog: rank 1 failed: ValueError: tokenizer "
                                      "returned id 70000 >= vocab_size 32000")
    assert "--- traceback of rank 1:" in report and "in _raises_on_rank_one" in report
    assert seconds < 3.0  # not the 30 s timeout


def _killed(out: str):
    _start(timeout_s=30.0)

    def body():
        x = torch.ones(4)
        comm.all_reduce(x, label="warmup")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(x, label="step.loss")

    _save(out, _outcome(body))


def test_a_killed_rank_is_named_and_the_others_stop_at_once(tmp_path):
    with pytest.raises(RankFailure, match="rank 1 of 2 first"):
        run_ranks(_killed, world_size=2, args=(str(tmp_path),), timeout_s=60,
                  collective_timeout_s=30)
    seconds, report = _read(tmp_path, 0)
    assert report.splitlines()[0].startswith(
        "shardwise watchdog: rank 1 stopped answering: its process ")
    assert "has exited: killed, out of memory, or crashed in native code" in report
    assert "rank 0 (host" in report and "all_reduce 'step.loss'" in report
    assert seconds < 3.0


def _stuck_in_native(out: str):
    _start(exit_grace_s=1.0)

    def body():
        x = torch.ones(4)
        comm.all_reduce(x, label="warmup")
        if dist.get_rank() == 1:
            time.sleep(3600)  # one C call: no Python bytecode runs, no exception can land
        comm.all_reduce(x, label="step.loss")

    _save(out, _outcome(body))


def test_a_rank_stuck_in_native_code_is_ended_and_named(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(_stuck_in_native, world_size=2, args=(str(tmp_path),), timeout_s=60,
                  collective_timeout_s=T + 2)
    assert "rank 1: died\nprocess exited with code 1" in str(info.value)  # ended by its watchdog
    seconds, report = _read(tmp_path, 0)
    assert "rank 1 never issued it" in report.splitlines()[0]
    assert "in body\n    time.sleep(3600)" in report
    assert seconds < T + 6


# ----------------------------------------------------------------------------- the engine


def _engine_in_debug_mode(stage: int, hybrid: bool):
    from shardwise.testing.models import EdgeBlock, EdgeCaseModel
    from shardwise.testing.parity import ParityConfig, make_batches, sharded_run

    wd = _start(timeout_s=30.0, mode="debug")

    def build():
        torch.manual_seed(0)
        return EdgeCaseModel()

    batches = make_batches(0, 2, 2, 4, 8, 11)
    sharded_run(build, batches, ParityConfig(stage=stage, accum=2, steps=2, hybrid=hybrid),
                wrap={EdgeBlock})
    seqs = dict(wd.tracker.seq)
    wdm.stop()
    return seqs


@pytest.mark.parametrize("world, stage, hybrid", [(2, 0, False), (2, 1, False), (2, 2, False),
                                                  (3, 3, False), (4, 3, True)])
def test_the_engine_passes_the_debug_fingerprint_check(world, stage, hybrid):
    """Every collective of every stage agrees in kind, label, shape and dtype on all ranks
    (the edge-case model: uneven shards, a parameter only some ranks use, tied weights)."""
    seqs = run_ranks(_engine_in_debug_mode, world_size=world, args=(stage, hybrid),
                     timeout_s=120)
    assert all(sum(s.values()) >= 4 for s in seqs)
    for group in set().union(*seqs):  # members of a group issued equally many on it
        assert len({s[group] for s in seqs if group in s}) == 1, (group, seqs)


def _quantized_bf16_in_debug_mode():
    import shardwise
    from shardwise.testing.models import EdgeBlock, EdgeCaseModel

    wd = _start(timeout_s=30.0, mode="debug")
    torch.manual_seed(0)
    model = shardwise.shard(EdgeCaseModel(), stage=3, wrap={EdgeBlock},
                            mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16),
                            comm=shardwise.CommQuant(weights="int8", grads="int4"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randint(0, 11, (2, 8), generator=g)).float().square().mean().backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    seqs = dict(wd.tracker.seq)
    wdm.stop()
    return seqs


def test_quantized_bf16_communication_passes_the_debug_fingerprint_check():
    seqs = run_ranks(_quantized_bf16_in_debug_mode, world_size=2, timeout_s=120)
    assert seqs[0] == seqs[1] and sum(seqs[0].values()) > 4


# ----------------------------------------------------------------------------- the report


def test_compact_ranks():
    assert compact_ranks([3, 0, 1, 2, 5, 7, 8]) == "0-3, 5, 7-8"


def _state(rank, seqs, blocked=None, **kw):
    recent = [{"group": "0", "seq": s, "kind": "all_reduce", "label": f"op{s}", "shape": [4],
               "dtype": "float32"} for s in range(seqs)]
    return {"rank": rank, "host": "h", "pid": 100 + rank, "seqs": {"0": seqs},
            "groups": {"0": [0, 1, 2, 3]}, "recent": recent, "stack": f"stack of {rank}\n",
            "blocked": ({**recent[blocked], "seconds": 5.0} if blocked is not None else None),
            **kw}


def test_report_when_every_rank_issued_the_stuck_collective():
    states = {r: _state(r, 3, blocked=2) for r in range(4)}
    report = compose(states, {}, {}, 4, 5.0)
    assert report.splitlines()[0].endswith("did not complete within 5 s on ranks 0-3 although "
                                           "every rank of the group issued it (a backend or "
                                           "network problem, or a collective the watchdog "
                                           "does not see)")
    assert report.count("--- Python stack of") == 4  # distinct stacks are all kept


def test_report_names_a_silent_rank_and_shows_identical_stacks_once():
    states = {r: {**_state(r, 3, blocked=2), "stack": "same\n"} for r in (0, 1, 3)}
    silent = {2: "no state within 1 s: dead, or stuck in native code"}
    report = compose(states, {2: _state(2, 2)}, silent, 4, 5.0)
    assert report.splitlines()[0] == ("shardwise watchdog: rank 2 stopped answering: no state "
                                      "within 1 s: dead, or stuck in native code")
    assert "--- Python stack of ranks 0-1, 3:\nsame" in report
    assert "its last heartbeat: last collective: all_reduce 'op1' float32[4]" in report


# ----------------------------------------------------------------------------- no launcher


def _slurm_env(rank: int, port: int) -> None:
    """This process as one rank of a 2-rank SLURM-style job (no torchrun: rank 0 hosts the
    c10d store)."""
    os.environ.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                      SLURM_NTASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _launch_two(target: str) -> tuple[list, list[tuple[str, str]]]:
    """Run ``test_watchdog.<target>(rank, port)`` in 2 fresh interpreters, without any
    launcher's variables; (the processes, their (stdout, stderr))."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = str(Path(__file__).parent)
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_watchdog;"
                               f" test_watchdog.{target}({r}, {port})"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    return procs, [p.communicate(timeout=60) for p in procs]


def _store_host_dies(rank: int, port: int) -> None:
    """One rank of a 2-rank SLURM-style job (rank 0 hosts the store, then is killed)."""
    _slurm_env(rank, port)
    from shardwise.distributed import env

    env.init(backend="gloo", timeout_s=T)
    x = torch.ones(4)
    comm.all_reduce(x, label="warmup")
    if rank == 0:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(x, label="step.loss")
    except wdm.CollectiveError as exc:
        print(exc, flush=True)


def test_when_the_rank_hosting_the_store_dies_the_others_still_report():
    """Without torchrun, rank 0 hosts the c10d store: the survivor cannot ask anyone, and says
    so instead of hanging."""
    procs, outs = _launch_two("_store_host_dies")
    out = [o for o, _ in outs]
    assert procs[0].returncode == -signal.SIGKILL and procs[1].returncode == 0
    assert out[1].startswith("shardwise watchdog: all_reduce 'step.loss' float32[4] (seq 1 of "
                             "group 0) failed: Connection closed by peer"), out[1]
    assert "the other ranks could not be asked: the c10d store failed" in out[1]
    assert "rank 0: no answer: could not be asked" in out[1]


def _ends_without_destroy(rank: int, port: int) -> None:
    """One rank of a 2-rank job that returns with its process group and watchdog alive."""
    import atexit
    import threading

    def report() -> None:  # registered first, so it runs after the handlers env.init adds
        alive = [t.name for t in threading.enumerate() if t.name == "shardwise-watchdog"]
        group = torch.distributed.is_initialized()
        print(f"process group at exit: {group}; watchdog threads at exit: {alive}", flush=True)
    atexit.register(report)
    _slurm_env(rank, port)
    from shardwise.distributed import env

    env.init(backend="gloo", timeout_s=T)
    comm.all_reduce(torch.ones(4), label="only")
    assert wdm.active() is not None


def test_the_watchdog_thread_is_stopped_before_the_interpreter_finalises():
    """[Note: watchdog at exit], [Note: process group at exit]: a script that ends without
    ``destroy`` must not leave the watchdog's thread inside a store call, nor a Gloo group's
    worker threads, while Python finalises (each aborted a process once in CI), so
    ``atexit`` stops and joins the one and destroys the other."""
    procs, out = _launch_two("_ends_without_destroy")
    for p, (stdout, stderr) in zip(procs, out):
        assert p.returncode == 0, stderr[-2000:]
        assert stdout.strip().endswith(
            "process group at exit: False; watchdog threads at exit: []"), stdout
