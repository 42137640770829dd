"""Fault tolerance across replica groups (``parallel.fault_tolerant``, docs/failures.md).

The combine, lineages and the summary are tested on built inputs; one run on the path a user
runs (``shardwise train`` with ``--faults``) kills a rank of a 2-rank group, and a replay of
its membership must end on the same bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.train.config import load_config
from shardwise.train.fault_tolerant.combine import (combine_contributions, combine_gradients,
                                                    flatten_grads, next_lineage)
from shardwise.train.fault_tolerant.launch import threads_per_rank
from shardwise.train.fault_tolerant.summary import summarize
from shardwise.train.faults import FaultPlan, parse_faults

ROOT = Path(__file__).resolve().parents[1]


def _contribution(group: int, values, taking_part=True, lineage=0) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values, dtype=torch.float32)
    return flatten_grads([p], group, taking_part, torch.device("cpu"), lineage)


def test_a_parameter_no_participant_has_a_gradient_for_keeps_none():
    """A module every group's batch skipped: no gradient, so no weight decay and no moment
    update, as without fault tolerance; skipped by one group only: it counts zeros."""
    def params(with_grads):
        ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
        for p, g in zip(ps, with_grads):
            p.grad = None if g is None else torch.tensor(g)
        return ps

    mine = params([[1.0, 1.0], None, None])
    other = params([[3.0, 3.0], [4.0, 8.0], None])
    gathered = [flatten_grads(mine, 0, True, torch.device("cpu")),
                flatten_grads(other, 1, True, torch.device("cpu"))]
    combine_gradients(mine, 0, True, lambda flat: gathered)
    assert mine[0].grad.tolist() == [2.0, 2.0]
    assert mine[1].grad.tolist() == [2.0, 4.0]  # group 0 skipped it: zeros there
    assert mine[2].grad is None


# ----------------------------------------------------------------------------- the combine


def test_the_combine_is_the_same_bits_in_any_order_and_sums_in_group_order():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1000, generator=g) * 10 ** (i - 2) for i in range(4)]
    gathered = [_contribution(i, r.tolist()) for i, r in enumerate(rows)]
    first, decision = combine_contributions(gathered)
    assert decision.participants == [0, 1, 2, 3] and decision.kept
    for order in ([3, 1, 0, 2], [2, 3, 1, 0]):
        again, _ = combine_contributions([gathered[i] for i in order])
        assert torch.equal(first, again)
    expected = ((rows[0] + rows[1]) + rows[2]) + rows[3]
    assert torch.equal(first, expected / 4)
    # A different summation order gives different bits for these magnitudes: the order is
    # what the test pins, not a tolerance.
    assert not torch.equal(first, (((rows[3] + rows[2]) + rows[1]) + rows[0]) / 4)


def test_groups_not_taking_part_or_outside_the_script_do_not_count():
    gathered = [_contribution(0, [1.0, 2.0]), _contribution(1, [3.0, 4.0], taking_part=False),
                _contribution(2, [5.0, 6.0])]
    mean, decision = combine_contributions(gathered)
    assert decision.participants == [0, 2] and mean.tolist() == [3.0, 4.0]
    mean, decision = combine_contributions(gathered, participants=[1, 2])
    assert decision.participants == [1, 2] and mean.tolist() == [4.0, 5.0]


@pytest.mark.parametrize("gathered, script, match", [
    ([(0, [1.0]), (0, [2.0])], None, "group 0 contributed twice"),
    ([(0, [1.0])], [0, 3], r"replica groups \[3\] take part .* only groups \[0\]"),
    ([(0, [1.0])], [], "no replica group takes part"),
])
def test_a_combine_that_cannot_be_made_is_named(gathered, script, match):
    with pytest.raises(ValueError, match=match):
        combine_contributions([_contribution(g, v) for g, v in gathered], script)


def test_lineages_keep_the_majority_history_and_the_rest_must_heal():
    a, b = next_lineage(0, 1, [0, 1]), next_lineage(0, 1, [2])
    assert a != b and a == next_lineage(0, 1, [1, 0]) and a < 2**48
    gathered = [_contribution(0, [1.0], lineage=a), _contribution(1, [3.0], lineage=a),
                _contribution(2, [100.0], lineage=b)]
    mean, decision = combine_contributions(gathered, group=0)
    assert decision.participants == [0, 1] and mean.tolist() == [2.0]
    mean, decision = combine_contributions(gathered, group=2)
    assert mean is None and not decision.kept  # it does not commit, and heals next quorum
    # A tie keeps the history of the lowest group id.
    _, decision = combine_contributions(gathered[1:], group=2)
    assert decision.participants == [1] and not decision.kept


# ----------------------------------------------------------------------------- config, faults


@pytest.mark.parametrize("values, match", [
    ({"parallel.tp": "2"}, r"does not combine with parallel.tp=2"),
    ({"parallel.ft_min_groups": "3"}, r"ft_min_groups=3 is more than the "
                                      r"parallel.dp_replicate=2"),
    ({"parallel.ft_lighthouse": "localhost:29510"}, r"ft_lighthouse must be .*http"),
    ({"parallel.ft_timeout_s": "0"}, r"ft_timeout_s must be a positive number"),
])
def test_fault_tolerant_configs_that_cannot_run_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, {"parallel.fault_tolerant": "true", "parallel.dp_replicate": "2",
                           **values})


def test_the_fault_grammar_names_groups_stops_and_the_reduction_phase():
    f, g = parse_faults("stop:group=2:step=9:seconds=1.5:phase=reduction;kill:group=0:rank=1")
    assert (f.action, f.group, f.step, f.phase, f.options) == (
        "stop", 2, 9, "reduction", {"seconds": "1.5"})
    assert (g.group, g.rank) == (0, 1)
    plan = FaultPlan([f, g], rank=0, steps=10, group=2)
    assert plan.faults == [f]  # rank 0 of group 2: not group 0's rank 1
    assert FaultPlan([f, g], rank=1, steps=10, group=0).faults == [g]
    with pytest.raises(ValueError, match="seconds must be a number >= 0, got 'soon'"):
        parse_faults("stop:seconds=soon")


@pytest.mark.parametrize("spec, match", [
    ("stop:group=1:step=4:rejoin=9", r"rejoin= applies to kill and exit .*not 'stop'"),
    ("kill:group=1:step=4:rejoin=soon", r"rejoin must be a step \(an int\) or 'never', "
                                        r"got 'soon'"),
    ("kill:group=1:step=9:rejoin=9", r"rejoin=9 must come after the fault's step 9"),
])
def test_rejoin_is_a_later_step_or_never_on_a_fault_that_restarts_a_group(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_faults(spec)
    kill, gone = parse_faults("kill:group=1:step=4:rejoin=9;exit:group=2:rejoin=never")
    assert kill.options == {"rejoin": "9"} and gone.options == {"rejoin": "never"}
    with pytest.raises(ValueError, match="rejoin= needs parallel.fault_tolerant"):
        FaultPlan([kill], rank=0, steps=10, group=None)


def test_a_restart_rejoins_at_once_unless_the_fault_of_its_previous_attempt_said_when(tmp_path):
    from shardwise.train.fault_tolerant.rejoin import rejoin_target

    lines = [{"group": "1", "attempt": 0, "rejoin": "12"},
             {"group": "2", "attempt": 0, "rejoin": "never"},
             {"group": "1", "attempt": 1, "rejoin": None}]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert rejoin_target(tmp_path, group=1, attempt=0) is None  # the first start
    assert rejoin_target(tmp_path, group=1, attempt=1) == 12
    assert rejoin_target(tmp_path, group=1, attempt=2) is None  # killed again, no rejoin=
    assert rejoin_target(tmp_path, group=1, attempt=3) is None  # a real failure: no fault
    assert rejoin_target(tmp_path, group=2, attempt=1) == "never"


# ----------------------------------------------------------------------------- the summary


def _journal(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "st')  # cut


def _step(step, ids, before, after, t):
    return {"event": "step", "step": step, "committed": True, "participants": ids,
            "loss": 1.0 / step, "tokens": 10 * len(ids), "time": t, "lineage_before": before,
            "lineage": after}


def test_the_summary_follows_the_history_that_survived(tmp_path):
    tmp_path = tmp_path / "ft"  # <log.dir>/ft: metrics.jsonl goes to <log.dir>
    tmp_path.mkdir()
    # Group 1 committed step 1 alone, group 0 too; they met at step 2, group 0's history
    # was kept (lowest id) and group 1 healed from it.
    a1, b1 = next_lineage(0, 1, [0]), next_lineage(0, 1, [1])
    a2 = next_lineage(a1, 2, [0, 1])
    _journal(tmp_path / "group0.jsonl", [
        {"event": "start", "pid": 10}, _step(1, [0], 0, a1, 1.0), _step(2, [0, 1], a1, a2, 2.0),
        {"event": "finish", "digests": ["x"], "lineage": a2, "step": 2}])
    _journal(tmp_path / "group1.jsonl", [
        {"event": "start", "pid": 11}, _step(1, [1], 0, b1, 1.1), {"event": "healed", "step": 2},
        _step(2, [0, 1], a1, a2, 2.1),
        {"event": "finish", "digests": ["x"], "lineage": a2, "step": 2}])
    (tmp_path / "faults.jsonl").write_text(json.dumps({"time": 1.5, "action": "kill",
                                                       "group": "1"}) + "\n")
    s = summarize(tmp_path, steps=2)
    assert s["problems"] == [] and s["steps"] == 2 and s["discarded_steps"] == 1
    assert json.loads((tmp_path / "membership.json").read_text()) == {"1": [0], "2": [0, 1]}
    assert s["committed_tokens"] == 30 and s["recovery_s"]["all"] == [0.5]
    assert s["healed"] == {0: 0, 1: 1} and s["restarts"] == {0: 0, 1: 0}
    metrics = [json.loads(x) for x in (tmp_path.parent / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["participants"]) for m in metrics] == [(1, [0]), (2, [0, 1])]


def test_the_summary_names_divergence_and_missing_steps(tmp_path):
    tmp_path = tmp_path / "ft"
    tmp_path.mkdir()
    a1, b1 = next_lineage(0, 1, [0]), next_lineage(0, 1, [1])
    _journal(tmp_path / "group0.jsonl", [_step(1, [0], 0, a1, 1.0),
                                         {"event": "finish", "digests": ["x"], "lineage": a1}])
    _journal(tmp_path / "group1.jsonl", [_step(1, [1], 0, b1, 1.0),
                                         {"event": "finish", "digests": ["y"], "lineage": b1}])
    problems = summarize(tmp_path, steps=3)["problems"]
    assert any("2 different histories" in p for p in problems)
    assert any("steps never committed: [1, 2, 3]" in p for p in problems)
    assert any("final states differ" in p for p in problems)


# ----------------------------------------------------------------------------- the user's path


def _shardwise(args: list[str], cwd: Path, env_extra: dict | None = None, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    env.pop("SHARDWISE_FAULT", None)
    return subprocess.run([sys.executable, "-m", "shardwise.train.cli", "train", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_faults_and_layouts_exit_2_before_any_rank_starts(tmp_path):
    out = _shardwise(["--faults", "kill:group=x"], tmp_path, timeout=60)
    assert out.returncode == 2 and "group must be an int, got 'x'" in out.stderr
    out = _shardwise(["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "2",
                      "--parallel.tp", "2", "--nproc", "4"], tmp_path, timeout=60)
    assert out.returncode == 2 and "does not combine with parallel.tp=2" in out.stderr


def test_a_killed_rank_takes_its_group_out_it_heals_and_a_replay_ends_on_the_same_bits(tmp_path):
    """2 groups of 2 ranks (ZeRO-3 inside each); rank 1 of group 1 is killed in backward at
    step 4: group 0 goes on alone without restarting, group 1 restarts as a whole and heals
    from group 0; then the membership is replayed without faults."""
    common = ["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "2",
              "--nproc", "4", "--train.steps", "24", "--log.progress", "false",
              "--parallel.ft_timeout_s", "5"]
    run = _shardwise([*common, "--log.dir", "run", "--faults",
                      "kill:group=1:rank=1:step=4:phase=backward"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "groups [1] dropped at step 4" in run.stdout
    summary = json.loads((tmp_path / "run" / "ft" / "summary.json").read_text())
    assert summary["problems"] == [] and summary["steps"] == 24, summary
    assert summary["faults"] == 1 and summary["restarts"] == {"0": 0, "1": 1}
    assert summary["healed"]["1"] >= 1 and summary["steps_with_fewer_groups"] >= 1
    assert summary["recovery_s"]["max"] < 60
    journal0 = [json.loads(x) for x in (tmp_path / "run/ft/group0.jsonl").read_text().split("\n")
                if x]
    assert len({r["pid"] for r in journal0 if r.get("event") == "start"}) == 1  # kept its PID
    membership = tmp_path / "run" / "ft" / "membership.json"
    assert any(ids == [0] for ids in json.loads(membership.read_text()).values())

    replay = _shardwise([*common, "--log.dir", "replay", "--parallel.ft_min_groups", "2"],
                        tmp_path, {"SHARDWISE_FT_REPLAY": str(membership)})
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]

    def digests(run_dir):
        return {json.loads((tmp_path / run_dir / "ft" / f"result{g}.json").read_text())[
            "digests"][0] for g in (0, 1)}

    assert digests("run") == digests("replay") and len(digests("run")) == 1


@pytest.mark.parametrize("group, lighthouse, match", [
    (None, "http://h:29510", r"set SHARDWISE_FT_GROUP to this replica group's id in 0..1"),
    ("2", "http://h:29510", r"in 0..1 .*got '2'"),
    ("1", "", r"set parallel.ft_lighthouse to the address of the job's quorum server"),
])
def test_a_group_launched_by_torchrun_needs_its_id_and_the_quorum_server(monkeypatch, group,
                                                                          lighthouse, match):
    from shardwise.train.launch import _replica_here

    monkeypatch.delenv("SHARDWISE_FT_GROUP", raising=False)
    if group is not None:
        monkeypatch.setenv("SHARDWISE_FT_GROUP", group)
    cfg = load_config(None, {"parallel.fault_tolerant": "true", "parallel.dp_replicate": "2",
                             "parallel.ft_lighthouse": lighthouse})
    with pytest.raises(ValueError, match=match):
        _replica_here(cfg)  # refused before joining any process group


def test_the_launcher_names_a_missing_torchft_and_groups_that_do_not_split(monkeypatch):
    from shardwise.train.fault_tolerant.launch import run_fault_tolerant

    cfg = load_config(None, {"parallel.fault_tolerant": "true", "parallel.dp_replicate": "2",
                             "parallel.nproc": "3"})
    with pytest.raises(ValueError, match=r"nproc=3 local ranks do not split into "
                                         r"parallel.dp_replicate=2 equal groups"):
        run_fault_tolerant(cfg, data=None)
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ValueError, match=r"needs torchft .*pip install 'shardwise\[ft\]'"):
        run_fault_tolerant(cfg, data=None)


def test_with_every_group_in_every_step_the_numbers_are_those_of_a_run_without_it(tmp_path):
    """2 groups of 1 rank, both in every step (ft_min_groups 2), against plain data
    parallelism over the same 2 ranks: the same batches, the same mean gradient, the same
    logged losses (up to the order of fp32 sums in the gradient norm)."""
    args = ["--nproc", "2", "--train.steps", "8", "--log.progress", "false"]
    ft = _shardwise([*args, "--log.dir", "ft", "--parallel.fault_tolerant", "true",
                     "--parallel.dp_replicate", "2", "--parallel.ft_min_groups", "2"], tmp_path)
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    plain = _shardwise([*args, "--log.dir", "plain"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]

    def metrics(run):
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().split("\n")
                 if x]
        return ([m["loss"] for m in lines if "loss" in m],
                [m["val_loss"] for m in lines if "val_loss" in m])

    (ft_loss, ft_val), (loss, val) = metrics("ft"), metrics("plain")
    assert len(ft_loss) == len(loss) == 8 and len(ft_val) == len(val) == 1
    assert ft_loss == pytest.approx(loss, rel=1e-4) and ft_val == pytest.approx(val, rel=1e-4)


def test_a_group_rejoins_at_its_chosen_step_and_one_whose_capacity_is_gone_never_does(tmp_path):
    """3 groups of 1 rank: group 1 is killed at step 4 and comes back only once step 12 is
    committed; group 2 is killed at step 6 and never comes back. The others never restart;
    the run finishes with groups 0 and 1 holding the same bits. Group 0 is frozen 8 s at step
    8, so group 1 is up before step 12 however fast the steps are: its hold keeps it out."""
    run = _shardwise(["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "3",
                      "--nproc", "3", "--train.steps", "22", "--log.progress", "false",
                      "--parallel.ft_timeout_s", "5", "--log.dir", "run", "--faults",
                      "kill:group=1:step=4:rejoin=12;kill:group=2:step=6:phase=backward:"
                      "rejoin=never;stop:group=0:step=8:seconds=8"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "group 2 left the run for good" in run.stdout
    ft = tmp_path / "run" / "ft"
    summary = json.loads((ft / "summary.json").read_text())
    assert summary["problems"] == [] and summary["steps"] == 22, summary
    assert summary["groups_finished"] == [0, 1] and summary["groups_left"] == [2]
    assert summary["restarts"] == {"0": 0, "1": 1, "2": 1} and summary["digests_equal"]
    membership = {int(k): v for k, v in json.loads((ft / "membership.json").read_text()).items()}
    assert all(2 not in ids for step, ids in membership.items() if step > 6)
    assert all(1 not in ids for step, ids in membership.items() if 4 <= step <= 12)
    assert 1 in membership[22]
    journal0 = [json.loads(x) for x in (ft / "group0.jsonl").read_text().splitlines() if x]
    step12 = next(r["time"] for r in journal0 if r.get("event") == "step"
                  and r["step"] == 12 and r["committed"])
    journal1 = [json.loads(x) for x in (ft / "group1.jsonl").read_text().splitlines() if x]
    restarted = [r for r in journal1 if r.get("event") == "start"][1]
    assert restarted["time"] > step12  # it started at once, then held until step 12
    assert restarted["launched"] < step12
    assert len({r["pid"] for r in journal0 if r.get("event") == "start"}) == 1
    # Each rank (restarted ones too) its share of the cores the 3 groups share.
    starts = [r for r in journal0 + journal1 if r.get("event") == "start"]
    assert len(starts) == 3 and {r["threads"] for r in starts} == {threads_per_rank(3)}


_GATHER_TIMEOUT_S = 180  # far beyond the test's wait: a survivor that waits it out fails


def _gather_after_a_peer_dies(rank: int, world: int, port: int, out_dir: str) -> None:
    import datetime

    from torch._C._distributed_c10d import AllgatherOptions
    from torchft import ProcessGroupGloo

    from shardwise.train.fault_tolerant.wide import PeerLost, wait_or_abort

    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=_GATHER_TIMEOUT_S))
    pg.configure(f"localhost:{port}/gather", f"g{rank}", rank, world)

    def gather(flat):  # the wide group's wait: a failure aborts this rank's connections
        out = [torch.empty_like(flat) for _ in range(world)]
        wait_or_abort(pg, pg.allgather([out], [flat], AllgatherOptions()), "gather")

    gather(torch.full((64,), float(rank)))  # everyone connected
    if rank == 1:
        os._exit(0)  # a group dies between two combines
    try:
        gather(torch.full((64,), float(rank)))
        text = "completed"
    except PeerLost as exc:
        text = str(exc)
    Path(out_dir, f"rank{rank}.txt").write_text(text)


def test_every_survivor_of_a_combine_hears_of_a_lost_group_at_once_not_at_its_timeout(tmp_path):
    """In Gloo's ring only the dead rank's neighbours see its connection close; a survivor
    closing its own on the error passes it on: the rank two places away fails at once too
    ("connection closed" or "read error"), not at its timeout."""
    import time
    from torch.distributed import TCPStore
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    ctx = torch.multiprocessing.spawn(_gather_after_a_peer_dies, nprocs=4, join=False,
                                      args=(4, store.port, str(tmp_path)))
    deadline = time.monotonic() + _GATHER_TIMEOUT_S / 2  # start-up under load included
    for p in ctx.processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(p.exitcode is None for p in ctx.processes):
        for p in ctx.processes:
            p.kill()
        pytest.fail("a survivor of the lost group is still waiting for its timeout")
    texts = {r: (tmp_path / f"rank{r}.txt").read_text() for r in (0, 2, 3)}
    assert all(t.startswith("gather: RuntimeError") and "Timed out" not in t
               for t in texts.values()), texts
