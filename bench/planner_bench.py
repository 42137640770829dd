"""The planner's predictions against the trainer on this machine's CPU ranks.

    python bench/planner_bench.py                 # calibrate, then 2 rounds of the grid
    python bench/planner_bench.py --rounds 3 --calibration my.toml   # reuse a calibration
    python bench/planner_bench.py --only "debug x2" --steps 2        # a quick look

First ``shardwise plan --hardware local --calibrate``'s micro-benchmarks run (matmul
throughput by size, copy bandwidth, the trainer's eager kernels and optimizer update on one
thread, the engine's Gloo collectives per kind on 2 and 4 ranks: [Note: CPU kernels] in
shardwise/planner/devices/cpu/costs.py) and are written as the ``local`` device, with the cores
this process may use (unless ``--calibration`` names an existing file). Then,
for each case of the grid (the debug and small models at 1, 2 and 4 ranks, ZeRO stages 0-3,
tensor parallelism 2, a 2-stage 1F1B pipeline; and context parallelism, ring and Ulysses
at cp 2 and hybrid at cp 4, on sequences of 1024 tokens: ``--only cp`` runs those alone,
``--out`` elsewhere to keep the committed grid), every round launches the ranks (one thread
each), builds the model exactly as ``shardwise train`` does (``build_parallel_model``) and
measures:

* **step time**: the median of ``trainer.train_step`` over the timed steps after the first
  (warm-up) step (the slowest rank's), and the best (fastest) step, which filters out the
  moments a neighbour slows the machine, as the calibration's micro-benchmarks do, and the
  CPU time the slowest rank's process used per step (one thread: what its compute and its
  share of communication cost, whatever other jobs do to the wall clock); the median
  against ``CostModel.estimate(layout, exact=True).step_time`` for the layout the config
  describes (``plan_layout.layout_of``, the mapping ``--parallel.plan auto`` uses), the
  best step against the same estimate with the layers priced at the calibration blocks'
  fastest calls (``CpuCosts.undisturbed``, [Note: undisturbed steps] in
  shardwise/planner/devices/cpu/costs.py);
* **memory**: per rank, the engine's own accounting in the first step (``memory_report``
  after the update, before gradients are freed: parameters, gradients, optimizer state,
  the peak of gathered parameters and communication buffers, and tensor parallelism's
  gathered inputs), the whole gradients autograd holds on the engine's full parameters
  when they are packed (stage 1, accumulation: planner_measure.WholeGrads), and the
  activations saved for backward (the most bytes of unique storages packed by an outer
  ``saved_tensors_hooks`` alive at once, parameter storages -- a linear saves its
  transposed weight -- and a pipeline stage's received activations left out), the
  largest rank; against the planner's memory of the same kinds (its reserved and
  fragmentation allowances, and the loss's working buffers, left out: they are not
  bytes the engine holds or autograd saves).

The load average (``os.getloadavg()``) and the share of the machine's CPU time the
hypervisor gave other guests while the case ran (steal, from ``/proc/stat``) are recorded
with every case of every round.

Random tokens of the model's vocabulary feed both (the numbers do not depend on the
text). With 2 cores, 4 ranks time-share them ([Note: CPU ranks share the cores] in
shardwise/planner/devices/cpu/step.py); other jobs disturb every timing, so the table is only
meaningful from a quiet machine (load average below ~1.5). Writes
``bench/results/planner_bench.{md,json}`` (``--out`` elsewhere). A target is met only when
every round holds it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_measure import SavedPeak, WholeGrads, parameter_storages  # noqa: E402
from bench.planner_report import OUT, write_results  # noqa: E402

_MIB = 2 ** 20
_CP = {"parallel.stage": "2", "data.seq_len": "1024", "model.max_seq_len": "1024",
       "train.batch_size": "2"}
"""The context-parallel rows' job: the debug model on sequences of 1024 tokens."""
# (model, ranks, overrides): the grid; tp = tensor parallelism inside the ranks, cp =
# context parallelism (every rank of a cp group holds a part of each sequence).
GRID = [("debug", 1, {"parallel.stage": "0"}),
        ("debug", 2, {"parallel.stage": "0"}), ("debug", 2, {"parallel.stage": "1"}),
        ("debug", 2, {"parallel.stage": "2"}), ("debug", 2, {"parallel.stage": "3"}),
        ("debug", 2, {"parallel.tp": "2", "parallel.stage": "2", "train.batch_size": "8"}),
        ("debug", 2, {"parallel.pp": "2", "parallel.pp_microbatches": "2",
                      "parallel.stage": "2", "train.batch_size": "8"}),
        ("debug", 4, {"parallel.stage": "3"}),
        ("debug", 4, {"parallel.tp": "2", "parallel.stage": "3"}),
        ("debug", 4, {"parallel.pp": "2", "parallel.pp_microbatches": "2",
                      "parallel.stage": "3"}),
        ("small", 1, {"parallel.stage": "0"}), ("small", 2, {"parallel.stage": "0"}),
        ("small", 2, {"parallel.stage": "3"}),
        ("small", 2, {"parallel.tp": "2", "parallel.stage": "2", "train.batch_size": "8"}),
        ("small", 2, {"parallel.pp": "2", "parallel.pp_microbatches": "2",
                      "parallel.stage": "2", "train.batch_size": "8"}),
        ("small", 4, {"parallel.stage": "3"}),
        # context parallelism (issue 32): sequences 8x the grid's, so attention and the
        # exchanges weigh; 2 sequences a step
        ("debug", 2, {**_CP, "parallel.cp": "2", "parallel.cp_impl": "ring"}),
        ("debug", 2, {**_CP, "parallel.cp": "2", "parallel.cp_impl": "ulysses"}),
        ("debug", 4, {**_CP, "parallel.cp": "4", "parallel.cp_impl": "hybrid"})]
STEPS = {"debug": 16, "small": 8}  # timed steps (after the first, memory-tracked step)
KINDS = ("params", "grads", "optimizer", "whole_grads", "transient", "activations")


def _config(model: str, ranks: int, over: dict[str, str], seq: int, batch: int):
    from shardwise.train.config import load_config, resolve_world

    base = {"model.name": model, "data.seq_len": str(seq), "train.batch_size": str(batch),
            "log.progress": "false", "parallel.watchdog": "off"}
    return resolve_world(load_config(None, {**base, **over}), ranks)


def _rank(cfg, model_cfg, steps: int) -> dict[str, float]:
    """One rank: a memory-tracked first step (also the warm-up), then ``steps`` timed steps."""
    import shardwise
    from shardwise import LossScaler
    from shardwise.distributed import env as dist_env
    from shardwise.train.parallelize import build_parallel_model, data_rank, wrap_optimizer
    from shardwise.train.trainer import build_optimizer, train_step

    env = dist_env.init(backend="gloo", watchdog="off")  # the group run_ranks made
    model = build_parallel_model(cfg, model_cfg, env)
    opt = wrap_optimizer(build_optimizer(model, cfg.optim), model)
    rank, _ = data_rank(cfg, env)
    gen = torch.Generator().manual_seed(rank)
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)

    class Loader:  # random tokens: the numbers do not depend on the text
        def next_batch(self):
            t = torch.randint(0, model_cfg.vocab_size, shape, generator=gen)
            return t[:, :-1], t[:, 1:]

    got: dict[str, float] = {}
    zero_grad = opt.zero_grad

    def report_then_zero(*args, **kwargs):  # after the update, before gradients are freed
        rep = shardwise.memory_report(model, opt)
        got.update(params=rep.param_bytes, grads=rep.grad_bytes,
                   optimizer=rep.optimizer_bytes,
                   transient=rep.peak_transient_bytes + rep.peak_tp_comm_bytes)
        return zero_grad(*args, **kwargs)

    saved, scaler, times = SavedPeak(parameter_storages(model)), LossScaler(enabled=False), []
    opt.zero_grad = report_then_zero
    with WholeGrads(model) as whole, \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        train_step(model, opt, Loader(), cfg, env, 1, scaler)
    opt.zero_grad = zero_grad
    cpu = []
    for step in range(steps):
        c0 = time.process_time()
        times.append(train_step(model, opt, Loader(), cfg, env, step + 2, scaler)["step_time_s"])
        cpu.append(time.process_time() - c0)
    if not times:
        times = cpu = [math.nan]
    return {"step_time": statistics.median(times), "best_step_time": min(times),
            "cpu_step_time": statistics.median(cpu), "activations": saved.peak,
            "whole_grads": whole.peak, **got}


def _predict(cfg, model_cfg, hw) -> dict[str, float]:
    from shardwise.planner.cost_model import CostModel
    from shardwise.train import plan_layout

    spec, hw, wl = plan_layout.planner_inputs(cfg, model_cfg, hw)
    layout = plan_layout.layout_of(cfg)
    # exact: the given layout's pipeline simulated with each rank's own costs (a last
    # stage with the head is slower than the first), as the search prices its best
    est = CostModel(spec, hw, wl).estimate(layout, exact=True)
    quiet = hw.replace(cpu=hw.cpu.undisturbed()) if hw.cpu is not None else hw
    m = est.memory
    kinds = {"states": m.params + m.grads + m.optimizer, "whole_grads": m.full_grads,
             "transient": m.unsharded + m.comm, "activations": m.activations}
    return {"step_time": est.step_time, "layout": plan_layout.describe(est.layout),
            "memory": sum(kinds.values()), "kinds": kinds, "bottleneck": est.bottleneck,
            # [Note: undisturbed steps]: against the trainer's fastest step
            "best_step_time": CostModel(spec, quiet, wl).estimate(layout, exact=True).step_time}


def run_case(model: str, ranks: int, over: dict[str, str], seq: int, batch: int,
             steps: int | None = None) -> dict[str, Any]:
    """Launch ``ranks`` ranks on one case; the slowest rank's time, the largest memory."""
    from shardwise.testing.dist import run_ranks
    from shardwise.train.preflight import build_model_config

    cfg = _config(model, ranks, over, seq, batch)
    model_cfg = build_model_config(cfg)
    load, before = os.getloadavg()[0], _cpu_jiffies()
    steps = STEPS[model] if steps is None else steps
    rows = run_ranks(_rank, ranks, args=(cfg, model_cfg, steps), threads=1,
                     env={"OMP_NUM_THREADS": "1"}, timeout_s=900)
    after = _cpu_jiffies()
    mem = [sum(r[k] for k in KINDS) for r in rows]
    big = rows[mem.index(max(mem))]
    return {"step_time": max(r["step_time"] for r in rows),
            "best_step_time": max(r["best_step_time"] for r in rows),
            "cpu_step_time": max(r["cpu_step_time"] for r in rows), "memory": max(mem),
            "breakdown": {k: big[k] for k in KINDS},
            "load": [load, os.getloadavg()[0]],
            "steal": (after[1] - before[1]) / max(1, after[0] - before[0])
            if before and after else None}


def _cpu_jiffies() -> tuple[int, int] | None:
    """(all, stolen) CPU time of the machine so far from ``/proc/stat`` (Linux), or None:
    the share the hypervisor gave other guests while a case ran."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def _calibrate(path: str | None) -> tuple[Path, float]:
    from shardwise.planner.calibrate import measure_local, write_calibration

    if path and Path(path).exists():
        return Path(path), 0.0
    start = time.perf_counter()
    out = Path(path) if path else Path(tempfile.mkdtemp()) / "calibration.toml"
    write_calibration(measure_local(budget_s=30.0, ranks=4), out)
    return out, time.perf_counter() - start


def _factors(hw) -> dict[str, Any]:
    """The calibration's factors the two predictions differ by ([Note: undisturbed
    steps]): the median calls' and the fastest calls'."""
    c = hw.cpu
    return {"compose": c.compose, "compose_best": c.compose_best,
            "compose_kernels": c.compose_kernels, "compose_kernels_best": c.compose_kernels_best,
            "collective_overhead": c.collective_overhead,
            "collective_overhead_best": c.collective_overhead_best,
            "busy": c.busy, "busy_best": c.busy_best}


def _name(model: str, ranks: int, over: dict[str, str]) -> str:
    keys = {"parallel.stage": "stage", "parallel.tp": "tp", "parallel.pp": "pp",
            "parallel.pp_microbatches": "microbatches", "train.batch_size": "batch",
            "parallel.cp": "cp", "parallel.cp_impl": "impl", "data.seq_len": "seq"}
    first = ["parallel.cp", "parallel.cp_impl"]  # the cp rows read "cp 2,impl ring,..."
    order = [k for k in first if k in over] + [k for k in over if k not in first]
    return f"{model} x{ranks} " + ",".join(f"{keys[k]} {over[k]}" for k in order
                                           if k in keys)


def _inputs(rows: list[dict[str, Any]], seq: int, batch: int, hw) -> list[tuple]:
    """(ModelSpec, Workload, Layout) of every row, as ``--parallel.plan auto`` prices it."""
    from shardwise.train import plan_layout
    from shardwise.train.preflight import build_model_config

    by_name = {_name(*g): g for g in GRID}
    out = []
    for r in rows:
        cfg = _config(*by_name[r["case"]], seq, batch)
        spec, _, wl = plan_layout.planner_inputs(cfg, build_model_config(cfg), hw)
        out.append((spec, wl, plan_layout.layout_of(cfg)))
    return out


def _measure_round(rows, grid, args, hw, rnd: int) -> None:
    from shardwise.train.preflight import build_model_config

    for row, (model, ranks, over) in zip(rows, grid, strict=True):
        cfg = _config(model, ranks, over, args.seq, args.batch)
        row["pred"] = _predict(cfg, build_model_config(cfg), hw)
        got = run_case(model, ranks, over, args.seq, args.batch, args.steps)
        for key, name in (("step", "step_time"), ("best", "best_step_time"),
                          ("cpu", "cpu_step_time"), ("mem", "memory"),
                          ("breakdown", "breakdown"), ("load", "load"), ("steal", "steal")):
            row[key].append(got[name])
        print(f"round {rnd + 1}: {row['case']}: step {got['step_time']:.3f} s "
              f"(predicted {row['pred']['step_time']:.3f}, CPU {got['cpu_step_time']:.3f}), "
              f"memory {got['memory'] / _MIB:.1f} MiB (predicted "
              f"{row['pred']['memory'] / _MIB:.1f}), load {got['load'][0]:.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Calibrate, run the grid ``--rounds`` times, write the table and the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per case (default: 16 for debug, 8 for small)")
    p.add_argument("--calibration", help="an existing calibration file to reuse, or where "
                   "to write the new one")
    p.add_argument("--only", default="", help="run cases whose name contains this")
    p.add_argument("--out", default=str(OUT), help="where the .md and .json go")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the tables from the committed JSON, measure nothing")
    p.add_argument("--repredict", action="store_true",
                   help="with --report-only: predict every row again with this planner, "
                        "from the run's own calibration")
    args = p.parse_args(argv)
    if args.report_only:
        report_only(Path(args.out), args.repredict)
        return
    from shardwise.planner.calibrate import usable_cores
    from shardwise.planner.hardware import get_hardware

    start = time.perf_counter()
    path, secs = _calibrate(args.calibration)
    hw = get_hardware("local", calibration=path)
    grid = [g for g in GRID if args.only in _name(*g)]
    rows = [{"case": _name(*g), "pred": None, "step": [], "best": [], "cpu": [], "mem": [],
             "breakdown": [], "load": [], "steal": []} for g in grid]
    for rnd in range(args.rounds):
        _measure_round(rows, grid, args, hw, rnd)
    meta = {"rounds": args.rounds, "seq": args.seq, "batch": args.batch,
            "cores": usable_cores(), "calibration_s": secs,
            "calibration": Path(path).read_text(), "steps": args.steps,
            "steps_per_model": STEPS, **_factors(hw),
            "duration_s": time.perf_counter() - start}
    inputs = _inputs(rows, args.seq, args.batch, hw)
    print(write_results(rows, meta, hw, inputs, Path(args.out)))


def _recomposed(hw):
    """``hw`` with its calibration's factors ([Note: composed blocks]) computed again by
    this planner from the blocks the calibration stored, as ``--calibrate`` would now
    compute them (a calibration written by an earlier planner may lack a factor or
    store it under an older name)."""
    import dataclasses

    from shardwise.planner.calibrate.blocks import composed_costs

    c = hw.cpu
    if c is None or not (c.blocks or c.tp_blocks):
        return hw
    bare = dataclasses.replace(c, compose=1.0, compose_best=0.0, compose_kernels=0.0,
                               compose_kernels_best=0.0, collective_overhead=0.0,
                               collective_overhead_best=None)
    return hw.replace(cpu=composed_costs(hw.replace(cpu=bare), bare))


def report_only(out: Path = OUT, repredict: bool = False) -> None:
    """Rewrite the markdown (and the refit) from ``out``/planner_bench.json; with
    ``repredict``, every row's prediction is made again by this planner from the run's
    own calibration (the measurements are the run's)."""
    import json

    from shardwise.compat import tomllib
    from shardwise.planner.hardware import get_hardware
    from shardwise.train.preflight import build_model_config

    data = json.loads((out / "planner_bench.json").read_text())
    meta = data["meta"]
    hw = get_hardware("local", extra_tables=[tomllib.loads(meta["calibration"])])
    if repredict:
        hw = _recomposed(hw)
        by_name = {_name(*g): g for g in GRID}
        for r in data["rows"]:
            cfg = _config(*by_name[r["case"]], meta["seq"], meta["batch"])
            r["pred"] = _predict(cfg, build_model_config(cfg), hw)
        meta["repredicted"] = True
    meta.update(_factors(hw))
    inputs = _inputs(data["rows"], meta["seq"], meta["batch"], hw)
    print(write_results(data["rows"], meta, hw, inputs, out))


if __name__ == "__main__":
    main()
