"""The collectives a CPU rank's step meets between a block's operators, counted against
the trainer's own (comm_stats of real 2-rank steps: tensor parallelism, the engine's
stages 0-3, a pipeline), and ``collective_overhead`` charged on each ([Note: collectives
between operators] in shardwise/planner/calibrate/blocks.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardwise.planner.cost_model import CostModel
from shardwise.planner.devices.cpu.costs import CpuCosts
from shardwise.planner.devices.cpu.fits import Fit
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.workload import Workload
from tests.planner_helpers import estimate_debug, local_cpu, train_config


_CALL_CASES = {  # name -> overrides of a 2-layer debug model on 2 ranks
    "tp sp": {"parallel.tp": "2", "parallel.sequence_parallel": "true"},
    "tp": {"parallel.tp": "2", "parallel.sequence_parallel": "false"},
    **{f"stage {z}": {"parallel.stage": str(z)} for z in range(4)},
    "pp": {"parallel.pp": "2", "parallel.pp_microbatches": "2", "train.batch_size": "4"},
}


def _config(over: dict[str, str]):
    return train_config(2, **{
        "model.name": "debug", "model.n_layers": "2", "data.seq_len": "16",
        "train.batch_size": "2", "parallel.stage": "2", "log.progress": "false",
        "parallel.watchdog": "off", **over})


def _step_calls() -> dict[str, dict[str, int]]:
    """Per case of ``_CALL_CASES``: one training step's collective calls by the label's
    last part (comm_stats), this rank's."""
    import re

    import shardwise
    from shardwise import LossScaler
    from shardwise.distributed import env as dist_env
    from shardwise.train.parallelize import build_parallel_model, wrap_optimizer
    from shardwise.train.preflight import build_model_config
    from shardwise.train.step import train_step
    from shardwise.train.trainer import build_optimizer

    env = dist_env.init(backend="gloo", watchdog="off")
    out = {}
    for name, over in _CALL_CASES.items():
        cfg = _config(over)
        mc = build_model_config(cfg)
        model = build_parallel_model(cfg, mc, env)
        opt = wrap_optimizer(build_optimizer(model, cfg.optim), model)
        gen = torch.Generator().manual_seed(0)

        class Loader:
            def next_batch(self, mc=mc, cfg=cfg, gen=gen):
                t = torch.randint(0, mc.vocab_size, (cfg.train.batch_size, 17), generator=gen)
                return t[:, :-1], t[:, 1:]

        shardwise.reset_comm_stats()
        train_step(model, opt, Loader(), cfg, env, 1, LossScaler(enabled=False))
        calls = {}
        for label, st in shardwise.comm_stats().by_label.items():
            key = re.sub(r".*\.", "", label)
            calls[key] = calls.get(key, 0) + st.calls
        out[name] = calls
    return out


@pytest.fixture(scope="module")
def step_calls():
    """Rank 0's calls of every case, all cases in one launch of 2 ranks."""
    from shardwise.testing import run_ranks

    return run_ranks(_step_calls, 2, timeout_s=300)[0]


@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_collectives_are_the_trainers(sp, step_calls):
    """The one list of what tensor parallelism sends (sends.py) is what apply_tp issues
    (comm_stats), sequence parallel or not: counted, and priced by the CPU device with
    every collective costing 1 s."""
    from shardwise.planner.devices.cpu.device import CpuDevice
    from shardwise.planner.sends import tp_calls_per_layer, tp_edge_calls

    calls = step_calls["tp sp" if sp else "tp"]
    got = sum(n for k, n in calls.items() if k not in ("stats", "clip_grad_norm"))
    ones = {k: {2: Fit(1.0, 0.0)} for k in ("all_gather", "reduce_scatter", "all_reduce")}
    dev = CpuDevice(local_cpu(2).replace(cpu=CpuCosts({}, Fit(0.0, 0.0), ones)))
    wl = Workload(seq_len=16, global_batch=2, compute_dtype="fp32")
    predicted = 2 * dev.tp_seconds(wl, 32, 256, 2, sp, "none", 0.0, 0.0) + \
        dev.tp_edge_seconds(wl, 32, 256, 2, sp, True, True) + (1 if sp else 0)  # + norms
    assert predicted == got, calls
    # the count collective_overhead is charged on ([Note: collectives between operators])
    counted = 2 * tp_calls_per_layer(sp, False) + tp_edge_calls(sp, True, True)
    assert counted + (1 if sp else 0) == got


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_calls_are_the_engines_gathers_and_reductions(stage, step_calls):
    """The engine's collectives per step that ``collective_overhead`` is charged on:
    stage 0 its bucketed all-reduces, stages 1-2 a gather and a reduce-scatter per unit,
    stage 3 the root gathered once and every block twice; counted by comm_stats."""
    from shardwise.planner.catalogue import from_llama_config
    from shardwise.planner.sends import engine_calls
    from shardwise.train.preflight import build_model_config

    calls = step_calls[f"stage {stage}"]
    got = sum(calls.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce"))
    spec = from_llama_config(build_model_config(_config({})), "debug-2")
    wl = Workload(seq_len=16, global_batch=4, compute_dtype="fp32")
    L = Layout(dp_shard=2, zero=stage, microbatch=2)
    units = CostModel(spec, local_cpu(2), wl).rank_units(L, [0, 1], True, True)
    assert engine_calls(spec, wl, L, units, [0, 1], True, True) == got, calls


def test_pipeline_sends_are_the_schedules(step_calls):
    """A 2-stage 1F1B step of 2 micro-batches: the first stage sends 2 activations and
    receives 2 gradients, the 2 v m calls ``collective_overhead`` is charged on."""
    calls = step_calls["pp"]
    sends = sum(n for k, n in calls.items() if "SEND" in k or "RECV" in k)
    assert sends == 2 * 1 * 2, calls


@pytest.mark.parametrize("ac,per_layer", [("none", 10), ("full", 14)])
def test_collective_overhead_is_charged_per_collective_while_ranks_keep_a_core(ac, per_layer):
    """[Note: collectives between operators]: each collective of a step costs
    ``collective_overhead`` more while the ranks keep a core each: tensor-parallel ones (ten
    a layer with sequence parallelism, fourteen when the forward is replayed, seven for the
    embedding, head and loss), the engine's gathers and reductions, the pipeline's sends;
    beyond the cores the crowded collectives price what a call meets and nothing is
    added."""
    base = local_cpu(cores=2)
    over = base.replace(cpu=replace(base.cpu, collective_overhead=1e-3))

    def extra(hw_a, hw_b, part, **layout):
        return estimate_debug(hw_a, **layout).breakdown[part] - \
            estimate_debug(hw_b, **layout).breakdown[part]

    tp = {"tp": 2, "sp": True, "ac": ac}
    assert extra(over, base, "tp_comm", **tp) == pytest.approx(1e-3 * (4 * per_layer + 7))
    assert extra(over, base, "dp_comm", **tp) == 0.0  # one data rank: no engine calls
    dp3 = {"dp_shard": 2, "zero": 3}  # debug: 4 blocks and the root
    assert extra(over, base, "dp_comm", **dp3) == pytest.approx(1e-3 * (5 + 4 + 5))
    pp = {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1f1b"}
    assert extra(over, base, "pp_comm", **pp) == pytest.approx(1e-3 * 2 * 2)
    beyond = {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3}  # 4 ranks on 2 cores
    assert estimate_debug(over, **beyond).step_time == estimate_debug(base, **beyond).step_time
    wide = over.replace(cores=8)
    assert estimate_debug(wide, **beyond).step_time > estimate_debug(base.replace(cores=8),
                                                           **beyond).step_time
    assert estimate_debug(over).step_time == estimate_debug(base).step_time  # one rank: no calls
