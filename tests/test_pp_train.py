"""Pipelines in the trainer (issue 12): ``--parallel.pp`` and the ``pp_*`` keys.

* refusals before any rank starts, each naming the key: an unknown schedule (with the
  closest name), too few micro-batches for the schedule, micro-batches that do not divide
  ``train.batch_size``, fewer layers than pp x virtual stages, a bad per-stage list, a
  virtual the schedule cannot run, a pp that does not divide the world;
* pp 2 (ZB-H1, ZeRO 3) trains and validates like pp 1: the same losses, gradient norms and
  validation losses, with activation checkpointing too;
* ``--checkpoint.resume auto`` across pp: a checkpoint saved at pp 2 resumes at pp 1 and at
  pp 4 (1F1B) and continues as the uninterrupted pp 1 run does;
* pp 2 x tp 2 on 4 ranks (tensor and sequence parallelism inside each stage) trains and
  validates like pp 1, and its checkpoint resumes at pp 1 x tp 1 (and the other way round).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

TINY = {"model.dim": "32", "model.n_layers": "4", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "16", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "100000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "2", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1"}
PP2 = {"parallel.pp": "2", "parallel.pp_schedule": "zb1", "parallel.pp_microbatches": "2"}


@pytest.mark.parametrize("over, world, message", [
    ({"parallel.pp_schedule": "onef1b"}, 2,
     "parallel.pp_schedule: unknown pipeline schedule 'onef1b'; did you mean '1f1b'?"),
    ({"parallel.pp_schedule": "dualpipev", "parallel.pp_microbatches": "2"}, 2,
     "parallel.pp_microbatches=2: schedule 'dualpipev' at parallel.pp=2 needs at least 4 "
     "micro-batches"),
    ({"parallel.pp_microbatches": "3"}, 2,
     "parallel.pp_microbatches=3 must divide train.batch_size=4"),
    ({"parallel.pp_schedule": "zbv", "model.n_layers": "3"}, 2,
     "model.n_layers: the model has 3 layers, fewer than the 4 pipeline stages (pp x virtual); "
     "every stage needs a layer (parallel.pp=2 x virtual=2)"),
    ({"parallel.pp_layers_per_stage": "3,2,2"}, 2,
     "parallel.pp_layers_per_stage: layers_per_stage=[3, 2, 2] has 3 entries; expected one "
     "per stage (pp x virtual = 2)"),
    ({"parallel.pp_layers_per_stage": "3,2"}, 2,
     "parallel.pp_layers_per_stage: layers_per_stage=[3, 2] sums to 5; the model has 4 layers"),
    ({"parallel.pp_schedule": "zbv", "parallel.pp_virtual": "3"}, 2,
     "parallel.pp_virtual: schedule 'zbv' runs exactly 2 stages per rank; got virtual=3"),
    ({"parallel.pp": "3"}, 4, "parallel.pp=3 must divide the world size 4"),
    ({"train.grad_accum": "2"}, 2, "parallel.pp=2 does not run with train.grad_accum=2"),
    ({"parallel.pp_schedule": "zb1", "train.activation_checkpoint": "selective"}, 2,
     "parallel.pp=2 does not run with train.activation_checkpoint='selective' under "
     "parallel.pp_schedule='zb1' (split backward"),
    ({"parallel.tp": "4"}, 4, "parallel.dp_replicate * parallel.tp = 1 * 4 = 4 does not "
     "divide the world size 2 / parallel.pp=2"),
])
def test_refused_before_launch_naming_the_key(over, world, message, tmp_path):
    values = {**TINY, **PP2, "parallel.pp_schedule": "1f1b", "log.dir": str(tmp_path), **over}
    with pytest.raises(ValueError) as info:
        cfg = load_config(None, values)
        preflight(cfg, world_size=world)
    assert str(info.value).startswith(message), str(info.value)


def test_the_command_line_refuses_with_exit_code_2_and_no_ranks(capsys, tmp_path):
    code = main(["train", "--parallel.nproc", "2", "--parallel.pp", "2",
                 "--parallel.pp_schedule", "dualpipe", "--log.dir", str(tmp_path)])
    assert code == 2
    assert "did you mean 'dualpipev'?" in capsys.readouterr().err


@pytest.mark.parametrize("schedule, pp, batch, expected", [
    ("zbv", 2, 4, 4),        # pp x virtual = 4: 4% idle (1 micro-batch: 40%)
    ("1f1b", 2, 4, 4),       # 2 would idle 33%, 4 idle 20%
    ("1f1b", 2, 16, 4),      # the fewest that does: micro-batches stay large
    ("zb1", 2, 8, 2),        # zero bubble: 2 already idle 14%
    ("interleaved_1f1b", 2, 4, 4),
    ("dualpipev", 2, 4, 4),  # its own minimum, 2 pp
    ("1f1b", 4, 4, 4),       # no count under 25% divides 4: one sequence each (43%)
    ("gpipe", 2, 3, 3),      # 3 divides nothing else: one sequence each
])
def test_default_microbatches_overlap_the_stages(schedule, pp, batch, expected):
    """Issue 30.2: ``pp_microbatches = 0`` is chosen for throughput, not the schedule's
    fewest (1 micro-batch at pp 2 idles half of every step)."""
    from shardwise.parallel.pipeline.schedules import (TARGET_BUBBLE, default_microbatches,
                                                       expected_bubble)
    from shardwise.train.pipeline import resolve_microbatches

    assert default_microbatches(schedule, pp, batch) == expected
    cfg = load_config(None, {**TINY, "parallel.pp": str(pp), "parallel.pp_schedule": schedule,
                             "train.batch_size": str(batch)})
    assert resolve_microbatches(cfg) == expected
    v = 2 if schedule in ("zbv", "interleaved_1f1b", "dualpipev") else 1
    fewer = [m for m in range(max(1, 2 * pp * (schedule == "dualpipev")), expected)
             if batch % m == 0]  # each leaves a stage without work, or idles too much
    assert all(m < pp * v or expected_bubble(schedule, pp, m) > TARGET_BUBBLE for m in fewer)
    assert expected_bubble("1f1b", 2, 1) == 0.5 and expected_bubble("zbv", 2, 4) < 0.05


def test_a_mostly_idle_pipeline_is_warned_about_before_launch(tmp_path):
    """A choice that leaves most of the pipeline idle warns with the expected bubble and
    what would shrink it; the default at pp 2 does not warn."""
    def checked(world=2, **over):
        cfg = load_config(None, {**TINY, "log.dir": str(tmp_path / "x"), "parallel.pp": "2",
                                 **over})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight(cfg, world_size=world)
        return [str(w.message) for w in caught if "pipeline" in str(w.message)]

    assert checked() == []
    [message] = checked(**{"parallel.pp_microbatches": "1"})
    assert message == ("pipeline: 1 micro-batch of schedule '1f1b' at pp 2 (parallel."
                       "pp_microbatches) leaves an expected 50% of the ranks' time idle (the "
                       "bubble, simulated with unit costs); parallel.pp_microbatches=4 "
                       "(micro-batches of 1 sequence) would idle 20%")
    [message] = checked(4, **{"parallel.pp": "4"})
    assert "4 micro-batches of schedule '1f1b' at pp 4 (the default) leave an expected 43%" \
        in message and "with train.batch_size=16" in message


def test_help_says_what_the_default_micro_batches_are(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0: chosen for throughput" in text and "simulated bubble is at most 25%" in text
    assert "pp x dp_replicate x dp_shard x cp x tp = world size" in text  # dp_replicate's rule


def _train(cfg, data):
    train(cfg, data, build_env(cfg))


def _run(log_dir: Path, world: int, **over: str) -> list[dict]:
    cfg = load_config(None, {**TINY, "log.dir": str(log_dir), **over})
    cfg, data = preflight(cfg, world_size=world)
    run_ranks(_train, world, args=(cfg, data), timeout_s=240, threads=1,
              env={"OMP_NUM_THREADS": "1"})  # a tiny model: extra threads only spin
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict], key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("pp1"), 1)


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= rel * abs(b[k]) for k in b)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    log = tmp_path_factory.mktemp("pp2")
    return log, _run(log, 2, **PP2, **{"checkpoint.interval": "2"})


def test_pp2_trains_and_validates_like_pp1(pp1, pp2):
    _, records = pp2
    assert _close(_losses(records), _losses(pp1), 1e-5)
    assert _close(_losses(records, "grad_norm"), _losses(pp1, "grad_norm"), 1e-5)
    assert _close(_losses(records, "val_loss"), _losses(pp1, "val_loss"), 1e-5)
    assert sorted(_losses(records, "val_loss")) == [2, 4]


def test_pp2_with_activation_checkpointing_matches_pp1(pp1, tmp_path):
    """Checkpointing wraps the blocks of each rank's stages (before sharding): the recompute
    re-gathers the stage-3 units inside the block and the numbers stay those of pp 1."""
    records = _run(tmp_path, 2, **PP2, **{"train.activation_checkpoint": "full"})
    assert _close(_losses(records), _losses(pp1), 1e-5)
    assert _close(_losses(records, "grad_norm"), _losses(pp1, "grad_norm"), 1e-5)


def test_resume_auto_across_pp(pp1, pp2, tmp_path):
    saved, _ = pp2
    for pp, world, over in (("1", 1, {}), ("4", 4, {"parallel.pp_schedule": "1f1b",
                                                    "parallel.pp_microbatches": "4"})):
        log = tmp_path / f"resumed-pp{pp}"
        shutil.copytree(saved / "checkpoints" / "step_00000002",
                        log / "checkpoints" / "step_00000002")
        records = _run(log, world, **{"parallel.pp": pp, "checkpoint.resume": "auto", **over})
        assert sorted(_losses(records)) == [3, 4], pp
        assert _close(_losses(records), {s: v for s, v in _losses(pp1).items() if s > 2},
                      1e-5), pp


PP2_TP2 = {**PP2, "parallel.pp_schedule": "1f1b", "parallel.tp": "2"}


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory):
    log = tmp_path_factory.mktemp("pp2tp2")
    return log, _run(log, 4, **PP2_TP2, **{"checkpoint.interval": "2"})


def test_pp2_tp2_trains_and_validates_like_pp1(pp1, pp2_tp2):
    """The tensor ranks of a stage read their data rank's batch; the stages send sequence
    shards and the last computes the vocab-parallel loss: the numbers stay pp 1's."""
    log, records = pp2_tp2
    layout = json.loads((log / "summary.json").read_text())["layout"]
    assert (layout["pp"], layout["tp"], layout["sequence_parallel"]) == (2, 2, True), layout
    manifest = log / "checkpoints" / "step_00000002" / "manifest.json"
    saved = json.loads(manifest.read_text())["layout"]  # what the model itself reports
    assert (saved["pp"], saved["tp"]) == (2, 2), saved
    assert _close(_losses(records), _losses(pp1), 1e-5)
    assert _close(_losses(records, "grad_norm"), _losses(pp1, "grad_norm"), 1e-5)
    assert _close(_losses(records, "val_loss"), _losses(pp1, "val_loss"), 1e-5)
    assert sorted(_losses(records, "val_loss")) == [2, 4]


def test_resume_auto_across_pp_and_tp(pp1, pp2, pp2_tp2, tmp_path):
    """Saved at pp 2 x tp 2, resumed at pp 1 x tp 1; saved at pp 2 (tp 1), resumed at
    pp 2 x tp 2: both continue as the uninterrupted pp 1 run does."""
    (saved_tp, _), (saved_pp, _) = pp2_tp2, pp2
    for name, saved, world, over in (("pp1tp1", saved_tp, 1, {"parallel.pp": "1"}),
                                     ("pp2tp2", saved_pp, 4, PP2_TP2)):
        log = tmp_path / name
        shutil.copytree(saved / "checkpoints" / "step_00000002",
                        log / "checkpoints" / "step_00000002")
        records = _run(log, world, **{**over, "checkpoint.resume": "auto"})
        assert sorted(_losses(records)) == [3, 4], name
        assert _close(_losses(records), {s: v for s, v in _losses(pp1).items() if s > 2},
                      1e-5), name
