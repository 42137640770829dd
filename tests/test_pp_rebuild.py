"""Several layouts built and trained one after another in the same processes, pipelines
among them, as bench/planner_choice.py once measured them and as ``--parallel.plan auto``
rebuilds after a switch (tests/test_replan.py switches into and out of a pipeline).

A layout the pipeline executor cannot run (selective checkpointing under a schedule with
weight-gradient passes) must be refused on every rank alike when it is built: it used to
fail mid-step on the last stage's rank only, while the first stage's rank went on to the
step's loss all-reduce, so a caller that carried on in the same processes hung with the
ranks one collective apart ([Note: refused on every pipeline rank] in
shardwise/parallel/pipeline/executor.py). The layouts that do run must then train in the
same processes exactly as in a launch of their own (losses bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from shardwise.planner.parallel_layout import Layout
from shardwise.testing.dist import run_ranks
from shardwise.train import plan_layout
from shardwise.train.config import load_config, resolve_world
from shardwise.train.preflight import build_model_config

TINY = {"model.dim": "32", "model.n_layers": "4", "model.n_heads": "4",
        "model.n_kv_heads": "2", "data.seq_len": "16", "log.progress": "false",
        "parallel.watchdog": "off"}
STEPS = 2
SPLIT_SELECTIVE = [Layout(pp=2, pp_schedule="zb1", microbatch=2, pp_microbatches=2,
                          ac="selective"),
                   Layout(pp=2, pp_schedule="zbv", pp_virtual=2, microbatch=2,
                          pp_microbatches=2, ac="selective")]
"""Built by the engine directly (the trainer's checks refuse them before launch)."""
RUNS = [Layout(pp=2, pp_schedule="1f1b", microbatch=2, pp_microbatches=2),
        Layout(dp_shard=2, zero=3, microbatch=2),
        Layout(pp=2, pp_schedule="zb1", microbatch=2, pp_microbatches=2, ac="full"),
        Layout(pp=2, pp_schedule="zbv", pp_virtual=2, microbatch=2, pp_microbatches=2,
               zero=3)]
CHAIN = [SPLIT_SELECTIVE[0], *RUNS[:2], SPLIT_SELECTIVE[1], *RUNS[2:]]
"""The order one launch builds them in: a refusal first, pipeline -> ZeRO -> pipeline."""


def _cfg(L: Layout):
    return plan_layout.with_layout(resolve_world(load_config(None, TINY), 2), L)


def _train(cfg, model_cfg) -> tuple[str, object]:
    """Build ``cfg``'s layout and train ``STEPS`` steps on seeded random tokens: ("ok",
    losses), or (the error's type, its message) when building or training raises, caught
    and gone on from as bench/planner_choice.py once did (every rank must then fail alike
    for the next layout's collectives to pair)."""
    from shardwise import LossScaler
    from shardwise.distributed import env as dist_env
    from shardwise.train.parallelize import build_parallel_model, data_rank, wrap_optimizer
    from shardwise.train.trainer import build_optimizer, train_step

    env = dist_env.init(backend="gloo", watchdog="off")  # the group run_ranks made
    try:
        model = build_parallel_model(cfg, model_cfg, env)
        opt = wrap_optimizer(build_optimizer(model, cfg.optim), model)
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    gen = torch.Generator().manual_seed(data_rank(cfg, env)[0])
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)

    class Loader:
        def next_batch(self):
            t = torch.randint(0, model_cfg.vocab_size, shape, generator=gen)
            return t[:, :-1], t[:, 1:]

    scaler = LossScaler(enabled=False)
    try:
        return "ok", [train_step(model, opt, Loader(), cfg, env, s + 1, scaler)["loss"]
                      for s in range(STEPS)]
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)


def _in_turn(cfgs, model_cfg) -> list[tuple[str, object]]:
    return [_train(cfg, model_cfg) for cfg in cfgs]


@pytest.fixture(scope="module")
def model_cfg():
    return build_model_config(_cfg(RUNS[0]))


@pytest.fixture(scope="module")
def chained(model_cfg):
    """Every layout of CHAIN in one launch of 2 ranks, each rank's results (a few seconds;
    ranks one collective apart would hang until the timeout)."""
    return run_ranks(_in_turn, 2, args=([_cfg(L) for L in CHAIN], model_cfg), threads=1,
                     timeout_s=60, collective_timeout_s=20)


def test_split_backward_with_selective_checkpointing_is_refused_on_every_rank(chained):
    for L in SPLIT_SELECTIVE:
        got = [per_rank[CHAIN.index(L)] for per_rank in chained]
        assert [kind for kind, _ in got] == ["ValueError", "ValueError"], got
        assert got[0] == got[1]  # the same words on every rank
        assert f"schedule {L.pp_schedule!r} splits each backward" in got[0][1]
        assert "policy 'full'" in got[0][1]


@pytest.mark.parametrize("L", RUNS, ids=plan_layout.describe)
def test_layouts_built_in_turn_train_as_in_their_own_launch(chained, model_cfg, L):
    alone = run_ranks(_in_turn, 2, args=([_cfg(L)], model_cfg), threads=1, timeout_s=60)
    for rank in range(2):
        kind, losses = chained[rank][CHAIN.index(L)]
        assert kind == "ok"
        assert losses == alone[rank][0][1]  # bit for bit


def test_the_replanner_never_ranks_a_layout_the_executor_refuses():
    """``--parallel.plan auto`` rebuilds in the same processes whatever ``rank_layouts``
    ranks; with selective checkpointing fixed by the user, the split-backward schedules
    (the fastest here otherwise) must not be among its candidates."""
    from shardwise.planner.hardware import get_hardware
    from shardwise.train.pipeline import SPLIT_BACKWARD

    def ranked(**over):
        cfg = resolve_world(load_config(None, {**TINY, "parallel.plan": "auto",
                                               "parallel.pp": "2", **over}), 2)
        return [e.layout for e in plan_layout.rank_layouts(cfg, build_model_config(cfg), 2,
                                                           get_hardware("h100"))]

    assert ranked()[0].pp_schedule in SPLIT_BACKWARD
    chosen = ranked(**{"train.activation_checkpoint": "selective"})
    assert chosen and all(L.ac == "selective" and L.pp == 2 for L in chosen)
    assert not [L for L in chosen if L.pp_schedule in SPLIT_BACKWARD]
