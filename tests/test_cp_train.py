"""Context parallelism in the trainer (issue 32): ``--parallel.cp``, ``cp_impl`` and
``cp_load_balance``.

* the same numbers as one process: every run of the grid trains 4 steps (validation at
  steps 2 and 4) and logs the losses, gradient norms and validation losses of the cp 1 run
  with the same global batch, within 1e-5 relative (fp32): ring at cp 2 and 3, Ulysses at
  cp 2, hybrid at cp 4 (all-to-all 2 x ring 2), zigzag and none, cp 2 x dp_shard 2 at ZeRO
  stage 3 (against dp_shard 2), cp 2 x tp 2 (sequence parallel), cp 2 x pp 2 (1F1B), an
  MoE model at cp 2 x ep 2 (experts carved out of dp_shard x cp, balance statistics over
  dp_cp);
* checkpoints do not depend on cp: the cp 4 run's step-2 checkpoint resumes at cp 1 (one
  rank) and at cp 2 (two ranks), and both continue as the uninterrupted runs do;
* the layout in ``summary.json``, the checkpoint manifest and the start line;
* every refusal before launch, its text asserted;
* ``--parallel.plan auto`` chooses cp when the ranks cannot all be data ranks;
* ``configs/long.toml`` (16K tokens at cp 4) loads, and one step of it runs (marked slow:
  20-50 s on a busy 2-core machine).

One launch of ranks per world size runs all of its grid's runs
(:func:`shardwise.testing.trainer.train_runs`): the grid costs four launches, not fifteen.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import cli_args, logged, refused, train_runs
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
# seq_len 48 cuts into the zigzag chunks of cp 2, 3 and 4 (4, 6, 8) and, at cp 2, into
# tp 2 sequence shards; 2 key/value heads take Ulysses at cp 2 and hybrid 2 x 2 at cp 4.
TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "48", "train.batch_size": "2", "train.eval_batches": "1",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "2", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1"}
CLI = cli_args(TINY)

MOE = {"model.name": "debug-moe", "model.num_experts": "4"}  # dropless: exact at any cp
# name -> (world size, overrides, the run whose numbers it must log)
GRID = {
    "cp1": (1, {}, None),
    "dp2": (2, {}, None),
    "ring2": (2, {"parallel.cp": "2"}, "cp1"),
    "ring2_none": (2, {"parallel.cp": "2", "parallel.cp_load_balance": "none"}, "cp1"),
    "ulysses2": (2, {"parallel.cp": "2", "parallel.cp_impl": "ulysses"}, "cp1"),
    "ring3": (3, {"parallel.cp": "3"}, "cp1"),
    "ring3_none": (3, {"parallel.cp": "3", "parallel.cp_load_balance": "none"}, "cp1"),
    "hybrid4": (4, {"parallel.cp": "4", "parallel.cp_impl": "hybrid",
                    "checkpoint.interval": "2"}, "cp1"),
    "cp2_dp2": (4, {"parallel.cp": "2", "parallel.stage": "3"}, "dp2"),
    "cp2_tp2": (4, {"parallel.cp": "2", "parallel.tp": "2"}, "cp1"),
    "cp2_pp2": (4, {"parallel.cp": "2", "parallel.pp": "2", "parallel.pp_schedule": "1f1b",
                    "parallel.pp_microbatches": "2"}, "cp1"),
    "moe1": (1, MOE, None),
    "moe_cp2_ep2": (2, {**MOE, "parallel.cp": "2", "parallel.ep": "2"}, "moe1"),
}
SAVED = "hybrid4"
# Resumed from the cp 4 run's step-2 checkpoint at another cp and world size.
RESUMED = {"resumed_cp1": (1, {}), "resumed_cp2": (2, {"parallel.cp": "2"})}


def _prepared(root: Path, name: str, world: int, over: dict) -> tuple:
    cfg = load_config(None, {**TINY, "log.dir": str(root / name), **over})
    return preflight(cfg, world_size=world)


def _launch(runs: list, world: int) -> None:
    run_ranks(train_runs, world, args=(runs,), timeout_s=300, threads=1,
              env={"OMP_NUM_THREADS": "1"})  # a tiny model: extra threads only spin


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """Every run of GRID and RESUMED, one launch per world size (the cp 4 run first: the
    resumed runs start from its checkpoint)."""
    root = tmp_path_factory.mktemp("cp")
    by_world: dict[int, list] = {}
    for name, (world, over, _) in GRID.items():
        by_world.setdefault(world, []).append(_prepared(root, name, world, over))
    _launch(by_world.pop(4), 4)
    step2 = root / SAVED / "checkpoints" / "step_00000002"
    for name, (world, over) in RESUMED.items():
        by_world[world].append(_prepared(root, name, world,
                                         {**over, "checkpoint.resume": str(step2)}))
    for world, runs in sorted(by_world.items()):
        _launch(runs, world)
    return root


def _numbers(root: Path, name: str) -> dict[tuple[int, str], float]:
    return {(r["step"], key): r[key] for key in ("loss", "grad_norm", "val_loss")
            for r in logged(root / name, key)}


def _close(a: dict, b: dict, rel: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= rel * abs(b[k]) for k in b)


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in GRID.items() if ref])
def test_context_parallel_runs_log_the_numbers_of_one_process(grid, name):
    ref = GRID[name][2]
    got, want = _numbers(grid, name), _numbers(grid, ref)
    assert sorted({s for s, k in got if k == "val_loss"}) == [2, 4]
    assert _close(got, want), (name, got, want)


def test_the_layout_is_recorded(grid):
    summary = json.loads((grid / SAVED / "summary.json").read_text())
    assert summary["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1,
                                 "ep": 1, "sequence_parallel": False, "stage": 3,
                                 "cp_impl": "hybrid", "cp_load_balance": "zigzag"}
    assert summary["tokens"] == 4 * 1 * 2 * 48  # steps x data ranks x batch x seq_len
    saved = json.loads((grid / SAVED / "checkpoints" / "step_00000002" / "manifest.json")
                       .read_text())["layout"]  # what the model itself reports
    assert (saved["cp"], saved["dp_shard"], saved["world_size"]) == (4, 1, 4), saved
    both = json.loads((grid / "cp2_dp2" / "summary.json").read_text())["layout"]
    assert (both["cp"], both["dp_shard"], both["stage"]) == (2, 2, 3), both
    assert json.loads((grid / "cp1" / "summary.json").read_text())["layout"]["cp"] == 1


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_cp_4_checkpoint_resumes_at_another_cp(grid, name):
    summary = json.loads((grid / name / "summary.json").read_text())
    assert summary["checkpoint"]["resumed_from_step"] == 2
    assert summary["layout"]["cp"] == int(RESUMED[name][1].get("parallel.cp", "1"))
    got = _numbers(grid, name)
    assert sorted({s for s, _ in got}) == [3, 4]
    for ref in (SAVED, "cp1"):  # the uninterrupted cp 4 run, and one process
        want = {k: v for k, v in _numbers(grid, ref).items() if k[0] > 2}
        assert _close(got, want), (name, ref, got, want)


def test_the_layout_in_words():
    from shardwise.train.parallelize import describe_layout

    def words(world: int, **over: str) -> str:
        return describe_layout(load_config(None, {**TINY, **over}), world)

    assert words(4, **{"parallel.cp": "2"}) == "cp 2 (ring, zigzag) x dp_shard 2, ZeRO stage 3"
    assert words(4, **{"parallel.cp": "2", "parallel.tp": "2", "parallel.cp_impl": "ulysses",
                       "parallel.cp_load_balance": "none"}) == \
        "tp 2 (sequence parallel) x cp 2 (ulysses, none) x dp_shard 1, ZeRO stage 3"
    assert words(8, **{"parallel.cp": "2", "parallel.pp": "2", "parallel.ep": "4",
                       "model.name": "debug-moe"}) == \
        "pp 2 x cp 2 (ring, zigzag) x dp_shard 2 (ep 4 over dp_shard x cp), ZeRO stage 3"


@pytest.mark.parametrize("args, expected", [
    (["--nproc", "3", "--parallel.cp", "2"],
     "parallel.dp_replicate * parallel.cp = 1 * 2 = 2 does not divide the world size 3"),
    (["--nproc", "4", "--parallel.cp", "2", "--parallel.dp_shard", "3"],
     "parallel.dp_replicate * parallel.dp_shard * parallel.cp = 1 * 3 * 2 = 6, expected the "
     "world size 4"),
    (["--nproc", "2", "--parallel.cp", "0"],
     "parallel.cp must be a positive int (context-parallel degree), got 0"),
    (["--parallel.cp_impl", "rign"],
     "parallel.cp_impl must be 'ring', 'ulysses' or 'hybrid', got 'rign' (did you mean "
     "'ring'?)"),
    (["--parallel.cp_load_balance", "zig"],
     "parallel.cp_load_balance must be 'zigzag' or 'none', got 'zig' (did you mean "
     "'zigzag'?)"),
    (["--nproc", "2", "--parallel.cp", "2", "--data.seq_len", "30"],
     "data.seq_len=30 must be divisible by 2 x parallel.cp = 2 x 2 = 4 "
     "(parallel.cp_load_balance='zigzag' cuts every sequence, training and validation, into "
     "4 equal chunks)"),
    (["--nproc", "3", "--parallel.cp", "3", "--parallel.cp_load_balance", "none",
      "--data.seq_len", "32"],
     "data.seq_len=32 must be divisible by parallel.cp=3 (parallel.cp_load_balance='none'"),
    (["--nproc", "4", "--parallel.cp", "2", "--parallel.tp", "2",
      "--parallel.cp_load_balance", "none", "--data.seq_len", "30"],
     "data.seq_len=30 / parallel.cp=2 = 15 positions per context-parallel rank must be "
     "divisible by parallel.tp=2 with sequence parallelism"),
    (["--nproc", "4", "--parallel.cp", "4", "--parallel.cp_impl", "ulysses"],
     "parallel.cp_impl='ulysses' at cp=4 needs the key/value heads (2 per tensor rank) to "
     "divide by 4: each rank takes whole heads; use cp_impl='ring' or 'hybrid' (model "
     "'debug': n_kv_heads=2)"),
    (["--nproc", "4", "--parallel.cp", "2", "--parallel.tp", "2",
      "--parallel.cp_impl", "ulysses"],
     "parallel.cp_impl='ulysses' at cp=2 needs the key/value heads (1 per tensor rank) to "
     "divide by 2"),
    (["--nproc", "2", "--parallel.cp", "2", "--parallel.cp_impl", "hybrid"],
     "parallel.cp_impl='hybrid' at cp=2 needs a degree d with 1 < d < 2 dividing both cp and "
     "the key/value heads (2 per tensor rank); none does"),
    (["--nproc", "3", "--parallel.cp", "3", "--parallel.cp_impl", "hybrid"],
     "parallel.cp_impl='hybrid' at cp=3 needs a degree d with 1 < d < 3"),
    (["--nproc", "4", "--parallel.cp", "2", "--parallel.ep", "3", "--model.name",
      "debug-moe", "--model.num_experts", "6"],
     "parallel.ep=3 must divide parallel.dp_shard x parallel.cp = 2 x 2 = 4 (the experts "
     "are spread over the data ranks of a replica)"),
])
def test_bad_cp_layouts_are_refused_before_launch(capsys, tmp_path, args, expected):
    assert expected in refused(capsys, *CLI, "--log.dir", str(tmp_path / "out"), *args)


def test_latent_attention_is_refused_by_name(capsys, tmp_path):
    args = ["--model.name", "deepseek-v3", "--data.seq_len", "48", "--data.max_bytes",
            "200000", "--nproc", "2", "--parallel.cp", "2", "--log.dir", str(tmp_path)]
    assert refused(capsys, *args) == (
        "parallel.cp=2: model 'deepseek-v3' has multi-head latent attention "
        "(attention='mla'), which context parallelism does not cover yet; expected a "
        "grouped-query attention model, or parallel.cp=1")


def test_help_describes_the_cp_keys(capsys):
    from shardwise.train.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in ("--parallel.cp ", "--parallel.cp_impl", "--parallel.cp_load_balance"):
        assert key in text, key
    assert "data.seq_len must divide by 2 x cp (cp_load_balance \"zigzag\") or cp" in text
    assert '"ring" (key/value blocks passed around the cp ranks)' in text


def test_the_config_choices_are_the_libraries():
    from shardwise.parallel.context import CP_IMPLS, LOAD_BALANCES
    from shardwise.train.config import checks

    assert checks.CP_IMPLS == CP_IMPLS and checks.CP_LOAD_BALANCES == LOAD_BALANCES


def _long(**over: str):
    return load_config(ROOT / "configs" / "long.toml", over)


def test_plan_auto_chooses_context_parallelism_for_one_long_sequence(tmp_path):
    """One 16K-token sequence per step on 4 ranks: no rank can be a data rank, and the
    planner (priced on an H100) splits the sequence rather than the layers."""
    from shardwise.train.plan_layout import plan_start, rank_layouts
    from shardwise.train.config import resolve_world
    from shardwise.train.preflight import build_model_config

    cfg = resolve_world(_long(**{"parallel.plan": "auto", "parallel.plan_hardware": "h100",
                                 "parallel.plan_fixed": "", "log.dir": str(tmp_path)}), 4)
    model_cfg = build_model_config(cfg, 256)
    ranked = rank_layouts(cfg, model_cfg, 4)
    assert ranked and all(e.layout.dp == 1 for e in ranked)
    assert any(e.layout.cp > 1 for e in ranked)
    chosen = plan_start(cfg, model_cfg, 4).parallel
    assert (chosen.cp, chosen.cp_impl) == (ranked[0].layout.cp, "ring"), chosen


def test_long_toml_is_16k_tokens_at_cp_4():
    cfg = _long()
    assert (cfg.data.seq_len, cfg.model.max_seq_len, cfg.model.name) == (16384, 16384, "debug")
    par = cfg.parallel
    assert (par.cp, par.nproc, par.cp_impl, par.cp_load_balance) == (4, 4, "ring", "zigzag")
    text = (ROOT / "configs" / "long.toml").read_text()
    assert text.startswith("# Long context: the debug model")


@pytest.mark.slow
def test_one_step_of_long_toml_runs(tmp_path):
    """One step and the validation pass of configs/long.toml, ranks forked (not the CLI's
    fresh interpreters: this is the one expensive run of the module, a minute at most)."""
    from shardwise.train.parallelize import describe_layout

    cfg = _long(**{"train.steps": "1", "log.dir": str(tmp_path / "long"), "log.plot": "false",
                   "log.progress": "false"})
    cfg, data = preflight(cfg, world_size=4)
    # the start line's layout (the ranks' stdout goes wherever the forkserver's went)
    assert describe_layout(cfg, 4) == "cp 4 (ring, zigzag) x dp_shard 1, ZeRO stage 3"
    run_ranks(train_runs, 4, args=([(cfg, data)],), timeout_s=300)
    summary = json.loads((tmp_path / "long" / "summary.json").read_text())
    assert summary["tokens"] == 16384 and summary["layout"]["cp"] == 4
    assert 4.0 < summary["final_train_loss"] < 6.0  # byte-level text: about ln 256 at start
    assert summary["final_val_loss"] is not None
