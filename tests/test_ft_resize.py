"""A fault-tolerant replica group that comes back with fewer ranks (``ranks=M`` faults,
issue 36): the fault grammar and its log, the data a resized group trains on (the same
sequences as its original ranks, the same gradient), the layout it plans for its ranks with
``--parallel.plan auto``, and one run on the path a user runs: a 2-rank group killed at step
4 comes back with 1 rank and ends where an uninterrupted 2-rank run ends.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from shardwise.data import TokenLoader
from shardwise.train.config import load_config, resolve_world
from shardwise.train.fault_tolerant.rejoin import restart_size
from shardwise.train.fault_tolerant.resize import GroupShare, check_resize_faults
from shardwise.train.faults import FaultPlan, parse_faults

from test_fault_tolerant import _shardwise

# ----------------------------------------------------------------------------- the grammar


def test_ranks_is_a_positive_int_on_a_fault_that_restarts_a_group():
    kill, ex = parse_faults("kill:group=1:step=4:ranks=2:rejoin=9;exit:ranks=1")
    assert kill.options == {"ranks": "2", "rejoin": "9"} and ex.options == {"ranks": "1"}
    for spec, match in [("stop:group=1:ranks=1", r"ranks= applies to kill and exit .*'stop'"),
                        ("kill:ranks=0", r"ranks must be an int >= 1 .*got '0'"),
                        ("kill:ranks=half", r"ranks must be an int >= 1 .*got 'half'")]:
        with pytest.raises(ValueError, match=match):
            parse_faults(spec)
    with pytest.raises(ValueError, match="ranks= needs parallel.fault_tolerant"):
        FaultPlan([ex], rank=0, steps=10, group=None)


def test_ranks_must_divide_the_groups_size_checked_before_any_rank_starts(tmp_path):
    check_resize_faults(parse_faults("kill:ranks=2;kill:group=1:ranks=1;stop:group=0"), n0=4)
    with pytest.raises(ValueError, match=r"ranks=3 of fault 'kill:.*ranks=3'.* \(3\) must "
                                         r"be at least 1 and divide the group's original "
                                         r"size n0=4"):
        check_resize_faults(parse_faults("kill:group=1:step=5:ranks=3"), n0=4)
    out = _shardwise(["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "1",
                      "--nproc", "2", "--log.dir", "run", "--faults", "kill:step=2:ranks=3"],
                     tmp_path, timeout=120)
    assert out.returncode == 2 and "divide the group's original size n0=2" in out.stderr
    assert not (tmp_path / "run" / "ft" / "group0.jsonl").exists()  # no rank started


def test_capacity_is_the_latest_ranks_fault_of_the_group_before_the_attempt(tmp_path):
    lines = [{"group": "1", "attempt": 0, "ranks": 2},
             {"group": "2", "attempt": 0, "ranks": None},
             {"group": "1", "attempt": 1, "ranks": None},   # killed again: capacity stays
             {"group": "1", "attempt": 2, "ranks": 1}]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sizes = [restart_size(tmp_path, group=1, attempt=a) for a in range(5)]
    assert sizes == [None, 2, 2, 1, 1]
    assert restart_size(tmp_path, group=2, attempt=1) is None
    assert restart_size(tmp_path, group=0, attempt=3) is None


def test_attempts_count_on_across_a_groups_relaunches(monkeypatch):
    from shardwise.train.attempts import ATTEMPT_BASE_ENV, ft_attempt

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv(ATTEMPT_BASE_ENV, raising=False)
    assert ft_attempt() == 1
    monkeypatch.setenv(ATTEMPT_BASE_ENV, "2")  # the relaunch began at attempt 2
    first, third = parse_faults("kill:step=3:attempt=1;kill:step=5:attempt=3")
    assert ft_attempt() == 3 and FaultPlan([first, third], 0, 9, group=0).faults == [third]


def test_the_agent_relaunches_a_resized_attempt_keeping_its_number_and_restart_budget():
    """Launch 1 (2 ranks) fails once, its attempt 1 finds capacity 1: relaunched with 1 rank
    as attempt 1 (base 1), 4 restarts left of 5; it fails twice more, attempt 3 finds
    capacity 2 again: relaunched with 2 ranks from attempt 3, 2 restarts left."""
    from shardwise.train.fault_tolerant.launch import launch_resizing

    results = iter([{"resize": 1, "attempt": 1}, {"resize": 2, "attempt": 3},
                    {"group": 0, "step": 9, "attempt": 3}])
    calls = []

    def launch(size, base, max_restarts):
        calls.append((size, base, max_restarts))
        return next(results)

    assert launch_resizing(launch, 2, 5) == {"group": 0, "step": 9, "attempt": 3}
    assert calls == [(2, 0, 5), (1, 1, 4), (2, 3, 2)]


def test_the_summary_follows_a_history_through_a_resume_from_its_checkpoint(tmp_path):
    """Every group lost at once: the restarted one resumes from the checkpoint of step 2,
    with the lineage of a resume (replica.py); its history goes on from that step's."""
    from shardwise.train.fault_tolerant.combine import next_lineage
    from shardwise.train.fault_tolerant.summary import summarize

    ft = tmp_path / "ft"
    ft.mkdir()
    lineages, lines = [0], [{"event": "start", "pid": 1}]
    for step in (1, 2, 3):  # step 3 committed, not checkpointed, then lost
        lineages.append(next_lineage(lineages[-1], step, [0]))
        lines.append({"event": "step", "step": step, "committed": True, "participants": [0],
                      "loss": 1.0, "tokens": 8, "time": float(step),
                      "lineage_before": lineages[-2], "lineage": lineages[-1]})
    resumed = next_lineage(0, 2, [])
    after = next_lineage(resumed, 3, [0])
    lines += [{"event": "start", "pid": 2},
              {"event": "step", "step": 3, "committed": True, "participants": [0], "loss": 1.0,
               "tokens": 8, "time": 9.0, "lineage_before": resumed, "lineage": after},
              {"event": "finish", "digests": ["x"], "lineage": after, "step": 3}]
    (ft / "group0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summarize(ft, steps=3)
    assert s["problems"] == [] and s["steps"] == 3 and s["discarded_steps"] == 1
    assert summarize(ft, steps=4)["problems"] == ["steps never committed: [4]"]


# ----------------------------------------------------------------------------- the data


def _cfg(**values):
    return load_config(None, {"data.seq_len": "8", "train.batch_size": "2",
                              "train.grad_accum": "3", **values})


def _windows(inputs: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for row in inputs]


@pytest.mark.parametrize("micro", [2, 3, 4, 12])
def test_a_resized_rank_sees_its_original_data_ranks_sequences_and_a_rank_free_state(micro):
    """2 groups of n0 = 2 ranks; group 1 has 1 rank now: per step it takes data ranks 2 and
    3's sequences, in micro-batches of any size that makes the step whole; its loader's
    state is the one every original rank holds after the step, and loads a peer's."""
    cfg = _cfg()
    tokens = torch.arange(9 * 200) % 97 + torch.arange(9 * 200) // 97  # distinct windows
    accum, bs, n0 = cfg.train.grad_accum, cfg.train.batch_size, 2
    originals = [TokenLoader(tokens, 8, bs, rank=r, world_size=4) for r in (2, 3)]
    share = GroupShare(group=1, groups=2, n0=n0, ranks=1, rank=0)
    gcfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=micro))
    resized = share.loader(tokens, cfg, gcfg)
    for _ in range(3):  # steps
        want = sorted(w for o in originals for _ in range(accum)
                      for w in _windows(o.next_batch()[0]))
        got = []
        for _ in range(n0 * accum * bs // micro):
            inputs, targets = resized.next_batch()
            assert inputs.shape == (micro, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
            got += _windows(inputs)
        assert sorted(got) == want
        assert resized.state_dict() == originals[0].state_dict() == originals[1].state_dict()
    peer = TokenLoader(tokens, 8, bs, rank=0, world_size=4)
    peer.next_batch()
    resized.load_state_dict(peer.state_dict())
    assert resized.state_dict() == peer.state_dict()
    assert share.first_data_rank == 2 and GroupShare(1, 2, 4, 2, 1).first_data_rank == 6
    evals = list(share.eval_batches(tokens[:9 * 40], _cfg(**{"train.eval_batches": "2"})))
    assert len(evals) == 4  # 2 data ranks x 2 batches, each of batch_size sequences


def test_the_resized_groups_gradient_is_the_mean_over_its_original_ranks_sequences(
        monkeypatch):
    """forward_backward on 1 rank standing for 2 (accumulating twice the micro-batches)
    gives the mean of the 2 ranks' gradients: the group's step is the same step."""
    import contextlib

    from shardwise import LossScaler
    from shardwise.models import build_model
    from shardwise.train import step
    from shardwise.train.plan_layout import plan_group
    from shardwise.train.preflight import build_model_config

    # One process, a plain model: no engine, so no communication for no_sync to defer.
    monkeypatch.setattr(step, "no_sync", lambda model: contextlib.nullcontext())

    cfg = resolve_world(_cfg(**{"parallel.fault_tolerant": "true"}), 2)
    model_cfg = build_model_config(cfg, 97 * 2)
    model = build_model(model_cfg, seed=0)
    env = types.SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0)
    tokens = torch.arange(9 * 200) % 97 + torch.arange(9 * 200) // 97

    def grads(loader, gcfg):
        model.zero_grad(set_to_none=True)
        step.forward_backward(model, loader, gcfg, env, LossScaler(enabled=False), None)
        return [p.grad.clone() for p in model.parameters()]

    full = plan_group(cfg, model_cfg, 2, 2)
    per_rank = [grads(TokenLoader(tokens, 8, 2, rank=r, world_size=2), full) for r in (0, 1)]
    small = plan_group(cfg, model_cfg, 1, 2)
    assert (small.train.batch_size, small.train.grad_accum) == (2, 6)
    one = grads(GroupShare(0, 1, 2, 1, 0).loader(tokens, cfg, small), small)
    for g, a, b in zip(one, *per_rank):
        torch.testing.assert_close(g, (a + b) / 2, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- the layout

_DEVICE = """[local]
description = "test device: a memory cap the tiny model feels"
family = "local"
peak_tflops = {{ fp32 = 0.005, bf16 = 0.005, fp16 = 0.005 }}
hbm_gib = {hbm}
hbm_gbs = 5
gpus_per_node = 2
intra_gbs = 0.01
inter_gbs = 0.01
intra_latency_us = 50
inter_latency_us = 50
pcie_gbs = 5
host_gbs = 5
host_gib = 16
reserved_gib = 0.0
matmul_max = 0.5
matmul_half_gflop = 0.001
memory_efficiency = 1.0
intra_efficiency = 0.5
inter_efficiency = 1.0
"""


def _planned(tmp_path: Path, hbm: float, ranks: int, **values):
    from shardwise.train.plan_layout import plan_group
    from shardwise.train.preflight import build_model_config

    device = tmp_path / f"device-{hbm}.toml"
    device.write_text(_DEVICE.format(hbm=hbm))
    cfg = load_config(None, {"parallel.fault_tolerant": "true", "parallel.plan": "auto",
                             "parallel.plan_calibration": str(device),
                             "parallel.dp_replicate": "2", **values})
    cfg = resolve_world(cfg, 4)
    return cfg, plan_group(cfg, build_model_config(cfg, 256), ranks, 2)


def test_plan_auto_is_accepted_under_fault_tolerance():
    cfg = load_config(None, {"parallel.fault_tolerant": "true", "parallel.plan": "auto",
                             "parallel.dp_replicate": "2"})
    assert cfg.parallel.plan == "auto"


def test_each_group_plans_its_own_ranks_keeping_its_tokens_per_step(tmp_path):
    """Under a memory cap a group of 1 rank holds the whole model: the planner gives it
    another layout than at 2 ranks (not only the accumulation), within fault tolerance's
    constraints and the same tokens per step; one that nothing fits is refused, named."""
    layouts = {}
    for ranks in (2, 1):
        cfg, g = _planned(tmp_path, 0.09, ranks)
        par, t = g.parallel, g.train
        assert (par.dp_replicate, par.dp_shard, par.tp, par.cp, par.pp, par.ep) == (
            1, ranks, 1, 1, 1, 1)
        assert ranks * t.batch_size * t.grad_accum == 2 * cfg.train.batch_size * \
            cfg.train.grad_accum
        layouts[ranks] = (par.stage, t.batch_size, t.activation_checkpoint)
    assert layouts[1][1:] != layouts[2][1:]
    # plan_fixed: the micro-batch as configured, at any size
    _, g = _planned(tmp_path, 0.09, 1, **{"train.batch_size": "4"})
    assert g.train.batch_size == 4 and g.train.grad_accum == 2
    with pytest.raises(ValueError, match="no layout of 1 ranks fits 'local' memory"):
        _planned(tmp_path, 0.055, 1)


# ----------------------------------------------------------------------------- the user's path


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_a_group_killed_at_step_4_comes_back_with_1_rank_and_trains_the_same_steps(tmp_path):
    """One group of 2 ranks (no live peer: it resumes from its checkpoint of step 3,
    resharded 2 -> 1 by DCP) comes back with 1 rank: every step is trained on the same
    sequences, so the losses follow an uninterrupted 2-rank run's (float-close: the sums
    run in another order)."""
    common = ["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "1",
              "--nproc", "2", "--train.steps", "8", "--log.progress", "false",
              "--checkpoint.interval", "1", "--parallel.ft_timeout_s", "5"]
    run = _shardwise([*common, "--log.dir", "run", "--faults", "kill:group=0:step=4:ranks=1"],
                     tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "group 0: 1 of 2 ranks, each taking 2 data rank(s)" in run.stdout
    ft = tmp_path / "run" / "ft"
    summary = json.loads((ft / "summary.json").read_text())
    assert summary["problems"] == [] and summary["steps"] == 8, summary
    assert summary["restarts"] == {"0": 1}
    starts = [r for r in _records(ft / "group0.jsonl") if r.get("event") == "start"]
    assert [(r["attempt"], r["ranks"]) for r in starts] == [(0, 2), (1, 1)]
    assert starts[1]["layout"].startswith("dp_shard 1,")
    assert [f["ranks"] for f in _records(ft / "faults.jsonl")] == [1]

    plain = _shardwise([*common, "--log.dir", "plain"], tmp_path)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]

    def losses(run_dir):
        return [(m["step"], m["loss"], m["tokens"])
                for m in _records(tmp_path / run_dir / "metrics.jsonl") if "loss" in m]

    resized, whole = losses("run"), losses("plain")
    assert [s for s, _, _ in resized] == list(range(1, 9)) == [s for s, _, _ in whole]
    assert [t for *_, t in resized] == [t for *_, t in whole]  # the group's tokens per step
    assert resized[:3] == whole[:3]  # before the fault: the same run
    assert [x for _, x, _ in resized] == pytest.approx([x for _, x, _ in whole], rel=1e-5)


def test_a_group_back_with_1_rank_trains_beside_a_2_rank_group_and_ends_on_its_bits(tmp_path):
    """2 groups of 2 ranks, each laid out by the planner (``--parallel.plan auto``); group 1
    loses a rank for good at step 4 and comes back with 1, re-planned for it: it heals from
    group 0's two ranks into its own layout (the whole model on one rank), combines with
    group 0 in every step after, and both end on the same state ([Note: layouts across
    groups] in shardwise/train/fault_tolerant/pieces.py)."""
    run = _shardwise(["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", "2",
                      "--nproc", "4", "--train.steps", "14", "--log.progress", "false",
                      "--parallel.ft_timeout_s", "5", "--log.dir", "run",
                      "--parallel.plan", "auto", "--parallel.plan_hardware", "h100",
                      "--faults", "kill:group=1:rank=1:step=4:phase=backward:ranks=1"],
                     tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "group 1: 1 of 2 ranks, each taking 2 data rank(s); layout dp_shard 1," in run.stdout
    ft = tmp_path / "run" / "ft"
    summary = json.loads((ft / "summary.json").read_text())
    assert summary["problems"] == [] and summary["steps"] == 14, summary
    assert summary["digests_equal"] and summary["healed"]["1"] >= 1
    group1 = _records(ft / "group1.jsonl")
    starts = [r for r in group1 if r.get("event") == "start"]
    assert [r["ranks"] for r in starts] == [2, 1]
    back = group1.index(starts[-1])
    together = [r["step"] for r in group1[back:]
                if r.get("event") == "step" and r["committed"] and r["participants"] == [0, 1]]
    assert together and together[-1] == 14  # trained beside group 0 to the end
    group0 = [r for r in _records(ft / "group0.jsonl") if r.get("event") == "start"]
    assert len(group0) == 1  # never restarted
