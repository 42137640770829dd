"""MoE models in pipelines in the trainer (issue 13, EP x PP).

* refusals before launch, naming the values: ep not dividing a stage's data ranks or the
  experts, ep with tp but without sequence parallelism, activation checkpointing with
  experts;
* ``--parallel.pp 2`` (ZB-H1) with ``debug-moe`` on 2 ranks (bias balancing) trains and
  validates like
  pp 1 on one rank with the same micro-batches (``batch_size / pp_microbatches`` x
  ``grad_accum``): loss, gradient norm, aux and z losses, per-layer token counts of *all*
  layers (rank 0 holds half of them) and validation loss; its checkpoint resumes at pp 1;
* pp 2 x tp 2 on 4 ranks (ZB-V) trains and validates like pp 1 x tp 2 on 2;
* ``shardwise train --parallel.nproc 4 --parallel.pp 2 --parallel.ep 2 --model.name
  debug-moe``: the layout line, ``summary.json`` and the checkpoint's layout say pp 2 x ep 2,
  and the numbers are those of pp 2 x ep 1 on the same 4 ranks; its step-2 checkpoint
  resumes at pp 2 x ep 1 (continuing as the uninterrupted run) and at pp 1 x ep 2 (the same
  next loss: the weights and the data position came back; later steps group the balance
  statistics by pp 1's micro-batches).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.train import plan_layout
from shardwise.train.cli import main
from shardwise.train.config import load_config, resolve_world
from shardwise.train.preflight import build_model_config, preflight
from shardwise.train.trainer import build_env, train

TINY = {"model.name": "debug-moe", "model.dim": "32", "model.n_layers": "4",
        "model.n_heads": "4", "model.n_kv_heads": "2", "model.moe_ffn_dim": "48",
        "data.seq_len": "16", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "100000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "2", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1"}
PP2 = {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "parallel.pp_microbatches": "2"}
# pp 1 with pp 2's micro-batches: half the sequences per forward, two of them per step, and
# twice the validation batches of half the size (the same held-out windows).
PP1 = {"train.batch_size": "2", "train.grad_accum": "2", "train.eval_batches": "4"}
BIAS = {"moe.balance": "bias", "moe.bias_update_rate": "0.01"}
MOE_KEYS = ("loss", "grad_norm", "aux_loss", "z_loss")


@pytest.mark.parametrize("over, world, message", [
    ({"parallel.tp": "2", "parallel.ep": "2", "parallel.sequence_parallel": "false"}, 8,
     "parallel.ep=2 with parallel.tp=2 needs sequence parallelism"),
    ({"parallel.ep": "4"}, 4, "parallel.ep=4 must divide parallel.dp_shard=2"),
    ({"parallel.ep": "4", "model.num_experts": "6"}, 8,
     "parallel.ep=4 must divide the number of experts (model.num_experts=6)"),
    ({"train.activation_checkpoint": "full"}, 2,
     "train.activation_checkpoint='full' need a dense model"),
])
def test_refused_before_launch_naming_the_values(over, world, message, tmp_path):
    values = {**TINY, **PP2, "log.dir": str(tmp_path), **over}
    with pytest.raises(ValueError) as info:
        preflight(load_config(None, values), world_size=world)
    assert str(info.value).startswith(message), str(info.value)


def test_planner_layouts_carry_ep_through_pipelines(tmp_path):
    """``--parallel.plan auto`` prices the run's ep with every pipeline layout it ranks
    and maps the layout to config keys and back."""
    over = {**TINY, **PP2, "parallel.ep": "2", "parallel.plan": "auto",
            "parallel.plan_hardware": "h100-sxm", "log.dir": str(tmp_path)}
    cfg = resolve_world(load_config(None, over), 4)
    L = plan_layout.layout_of(cfg)
    assert (L.pp, L.ep, L.dp_shard) == (2, 2, 2)
    assert plan_layout.layout_of(plan_layout.with_layout(cfg, L)) == L
    assert plan_layout.trainer_keys(L)["parallel.ep"] == 2
    assert plan_layout.describe(L).startswith("pp 2 (1f1b) x dp_shard 2 (ep 2)")
    ranked = plan_layout.rank_layouts(cfg, build_model_config(cfg, 256), 4)
    assert ranked and all(e.layout.ep == 2 for e in ranked)


def _train(cfg, data):
    train(cfg, data, build_env(cfg))


def _run(log_dir: Path, world: int, **over: str) -> list[dict]:
    cfg = load_config(None, {**TINY, "log.dir": str(log_dir), **over})
    cfg, data = preflight(cfg, world_size=world)
    run_ranks(_train, world, args=(cfg, data), timeout_s=300, threads=1,
              env={"OMP_NUM_THREADS": "1"})  # a tiny model: extra threads only spin
    return _records(log_dir)


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _by_step(records: list[dict], key: str) -> dict[int, object]:
    return {r["step"]: r[key] for r in records if key in r}


def _same(a: list[dict], b: list[dict], keys=MOE_KEYS, rel: float = 1e-5, steps=None) -> None:
    for key in keys:
        got, want = _by_step(a, key), _by_step(b, key)
        if steps is not None:
            got = {s: v for s, v in got.items() if s in steps}
            want = {s: v for s, v in want.items() if s in steps}
        assert got.keys() == want.keys(), (key, got, want)
        for s in want:
            assert got[s] == pytest.approx(want[s], rel=rel), (key, s, got[s], want[s])


def _resume(saved: Path, log: Path, world: int, **over: str) -> list[dict]:
    shutil.copytree(saved / "checkpoints" / "step_00000002",
                    log / "checkpoints" / "step_00000002")
    return _run(log, world, **{"checkpoint.resume": "auto", **over})


def test_pp2_moe_trains_validates_and_resumes_like_pp1(tmp_path):
    pp2 = _run(tmp_path / "pp2", 2, **{**PP2, **BIAS, "checkpoint.interval": "2",
                                       "parallel.pp_schedule": "zb1"})
    pp1 = _run(tmp_path / "pp1", 1, **PP1, **BIAS)
    _same(pp2, pp1, MOE_KEYS + ("val_loss",))
    assert sorted(_by_step(pp2, "val_loss")) == [2, 4]
    for key in ("moe_tokens_min", "moe_tokens_max"):  # every layer, the same routing
        assert _by_step(pp2, key) == _by_step(pp1, key), key
    assert all(len(v) == 4 for v in _by_step(pp2, "moe_tokens_cv").values())
    back = _resume(tmp_path / "pp2", tmp_path / "back", 1, **PP1, **BIAS)
    assert sorted(_by_step(back, "loss")) == [3, 4]
    _same(back, pp1, steps={3, 4})


def test_pp2_tp2_moe_trains_and_validates_like_pp1_tp2(tmp_path):
    """Tensor and sequence parallelism inside each stage: each tensor rank routes its
    sequence shard, the balance statistics are summed over the stage's data and tensor
    ranks; the numbers are those of pp 1 x tp 2 with the same micro-batches."""
    pp2 = _run(tmp_path / "pp2", 4, **{**PP2, "parallel.tp": "2",
                                       "parallel.pp_schedule": "zbv"})
    pp1 = _run(tmp_path / "pp1", 2, **PP1, **{"parallel.tp": "2"})
    _same(pp2, pp1, MOE_KEYS + ("val_loss",))
    for key in ("moe_tokens_min", "moe_tokens_max"):
        assert _by_step(pp2, key) == _by_step(pp1, key), key


@pytest.fixture(scope="module")
def pp2_ep2(tmp_path_factory):
    log = tmp_path_factory.mktemp("pp2ep2")
    args = [a for k, v in {**TINY, **PP2}.items() for a in (f"--{k}", v)]
    return log, main(["train", *args, "--parallel.nproc", "4", "--parallel.ep", "2",
                      "--checkpoint.interval", "2", "--log.dir", str(log)])


def test_the_ep2_pp2_command_trains_like_ep1(pp2_ep2, tmp_path, capfd):
    log, code = pp2_ep2
    out = capfd.readouterr().out
    assert code == 0, out
    summary = json.loads((log / "summary.json").read_text())
    assert (summary["layout"]["pp"], summary["layout"]["ep"]) == (2, 2), summary["layout"]
    saved = json.loads((log / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert (saved["layout"]["pp"], saved["layout"]["ep"]) == (2, 2), saved["layout"]
    ep1 = _run(tmp_path / "ep1", 4, **PP2)
    ep2 = _records(log)
    _same(ep2, ep1, MOE_KEYS + ("val_loss",))
    for key in ("moe_tokens_min", "moe_tokens_max"):
        assert _by_step(ep2, key) == _by_step(ep1, key), key


def test_the_ep2_pp2_checkpoint_resumes_at_ep1_and_at_pp1(pp2_ep2, tmp_path):
    log, code = pp2_ep2
    assert code == 0
    ep2 = _records(log)
    at_ep1 = _resume(log, tmp_path / "ep1", 4, **PP2)
    _same(at_ep1, ep2, steps={3, 4})
    at_pp1 = _resume(log, tmp_path / "pp1", 2, **PP1, **{"parallel.ep": "2"})
    summary = json.loads((tmp_path / "pp1" / "summary.json").read_text())
    assert (summary["layout"]["pp"], summary["layout"]["ep"]) == (1, 2)
    assert summary["checkpoint"]["resumed_from_step"] == 2
    _same(at_pp1, ep2, ("loss",), steps={3})
