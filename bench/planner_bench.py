"""The planner's predictions against the trainer on this machine's CPU ranks.

    python bench/planner_bench.py                 # calibrate, then 2 rounds of the grid
    python bench/planner_bench.py --rounds 3 --calibration my.toml   # reuse a calibration

First ``shardwise plan --hardware local --calibrate``'s micro-benchmarks run (matmul
throughput by size, copy bandwidth, Gloo all-reduce / all-gather on 2 and 4 ranks) and are
written as the ``local`` device (unless ``--calibration`` names an existing file). Then,
for each case of the grid (the debug and small models at 1, 2 and 4 ranks, ZeRO stages 0-3,
tensor parallelism 2, a 2-stage 1F1B pipeline), every round launches the ranks (one thread
each), builds the model exactly as ``shardwise train`` does (``build_parallel_model``) and
measures:

* **step time**: the median of ``trainer.train_step`` over the timed steps after the first
  (warm-up) step (the slowest rank's), and the best (fastest) step, which filters out time
  slices other processes take, as the calibration's micro-benchmarks do, and the CPU time
  the slowest rank's process used per step (one thread: what its compute and its share of
  communication cost, whatever other jobs do to the wall clock); against
  ``CostModel.estimate(layout).step_time`` for the layout the config describes
  (``plan_layout.layout_of``, the mapping ``--parallel.plan auto`` uses);
* **memory**: per rank, the engine's own accounting in the first step (``memory_report``
  after the update, before gradients are freed: parameters, gradients, optimizer state, the
  peak of gathered parameters and communication buffers) plus the activations saved for
  backward (the most bytes of unique storages packed by an outer ``saved_tensors_hooks``
  alive at once; leaf tensors requiring grad -- parameters, and a pipeline stage's received
  activations -- excluded), the largest rank; against the planner's memory of the
  same kinds (its reserved and fragmentation allowances left out: they are not bytes the
  engine holds).

Random tokens of the model's vocabulary feed both (the numbers do not depend on the
text). The machine is shared and has 2 cores: 4 ranks time-share them, and other jobs
disturb every timing; the rounds' ranges show how much. Writes
``bench/results/planner_bench.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results"
_MIB = 2 ** 20
# (model, ranks, overrides): the grid; tp = tensor parallelism inside the ranks.
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
        ("small", 4, {"parallel.stage": "3"})]
STEPS = {"debug": 5, "small": 3}  # timed steps (after the first, memory-tracked step)


def _config(model: str, ranks: int, over: dict[str, str], seq: int, batch: int):
    from shardwise.train.config import load_config, resolve_world

    base = {"model.name": model, "data.seq_len": str(seq), "train.batch_size": str(batch),
            "log.progress": "false", "parallel.watchdog": "off"}
    return resolve_world(load_config(None, {**base, **over}), ranks)


class SavedPeak:
    """The most bytes saved for backward alive at once (unique storages packed by
    ``saved_tensors_hooks``; leaf tensors that require grad -- parameters, gathered or
    not -- excluded)."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[Any, int]] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is None):
            st = t.untyped_storage()
            self.live.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return t


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
                   optimizer=rep.optimizer_bytes, transient=rep.peak_transient_bytes)
        return zero_grad(*args, **kwargs)

    saved, scaler, times = SavedPeak(), LossScaler(enabled=False), []
    opt.zero_grad = report_then_zero
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        train_step(model, opt, Loader(), cfg, env, 1, scaler)
    opt.zero_grad = zero_grad
    cpu = []
    for step in range(steps):
        c0 = time.process_time()
        times.append(train_step(model, opt, Loader(), cfg, env, step + 2, scaler)["step_time_s"])
        cpu.append(time.process_time() - c0)
    return {"step_time": statistics.median(times), "best_step_time": min(times),
            "cpu_step_time": statistics.median(cpu), "activations": saved.peak, **got}


def _predict(cfg, model_cfg, hw) -> dict[str, float]:
    from shardwise.planner.cost_model import CostModel
    from shardwise.train import plan_layout

    spec, hw, wl = plan_layout.planner_inputs(cfg, model_cfg, hw)
    est = CostModel(spec, hw, wl).estimate(plan_layout.layout_of(cfg))
    m = est.memory
    kinds = {"states": m.params + m.grads + m.optimizer + m.full_grads,
             "transient": m.unsharded + m.comm, "activations": m.activations + m.logits}
    return {"step_time": est.step_time, "layout": plan_layout.describe(est.layout),
            "memory": sum(kinds.values()), "kinds": kinds, "bottleneck": est.bottleneck}


def run_case(model: str, ranks: int, over: dict[str, str], seq: int, batch: int
             ) -> dict[str, Any]:
    """Launch ``ranks`` ranks on one case; the slowest rank's time, the largest memory."""
    from shardwise.testing.dist import run_ranks
    from shardwise.train.preflight import build_model_config

    cfg = _config(model, ranks, over, seq, batch)
    model_cfg = build_model_config(cfg)
    rows = run_ranks(_rank, ranks, args=(cfg, model_cfg, STEPS[model]), threads=1,
                     env={"OMP_NUM_THREADS": "1"}, timeout_s=600)
    mem = [r["params"] + r["grads"] + r["optimizer"] + r["transient"] + r["activations"]
           for r in rows]
    big = rows[mem.index(max(mem))]
    return {"step_time": max(r["step_time"] for r in rows),
            "best_step_time": max(r["best_step_time"] for r in rows),
            "cpu_step_time": max(r["cpu_step_time"] for r in rows), "memory": max(mem),
            "breakdown": {k: big[k] for k in ("params", "grads", "optimizer", "transient",
                                               "activations")}}


def _calibrate(path: str | None) -> tuple[Path, float]:
    from shardwise.planner.calibrate import measure_local, write_calibration

    if path and Path(path).exists():
        return Path(path), 0.0
    start = time.perf_counter()
    out = Path(path) if path else Path(tempfile.mkdtemp()) / "calibration.toml"
    write_calibration(measure_local(budget_s=30.0, ranks=4), out)
    return out, time.perf_counter() - start


def _name(model: str, ranks: int, over: dict[str, str]) -> str:
    keys = {"parallel.stage": "stage", "parallel.tp": "tp", "parallel.pp": "pp",
            "parallel.pp_microbatches": "microbatches", "train.batch_size": "batch"}
    return f"{model} x{ranks} " + ",".join(f"{keys[k]} {v}" for k, v in over.items())


def _err(pred: float, meas: list[float]) -> list[float]:
    return [pred / m - 1 for m in meas]


def _range(values: list[float] | None) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if values else "-"


def _kinds(r: dict[str, Any]) -> str:
    b, k = r["breakdown"][0], r["pred"]["kinds"]
    meas = {"states": b["params"] + b["grads"] + b["optimizer"], "transient": b["transient"],
            "activations": b["activations"]}
    return " / ".join(f"{k[x] / _MIB:.1f} : {meas[x] / _MIB:.1f}" for x in meas)


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table: prediction, measured per round (range), error per round."""
    lines = [
        "# Planner predictions against the trainer on CPU ranks",
        "",
        f"`python bench/planner_bench.py` ({meta['rounds']} rounds, seq {meta['seq']}, "
        f"batch {meta['batch']} sequences per data rank, one thread per rank, "
        f"{meta['cores']} cores shared with other jobs; calibration "
        f"{meta['calibration_s']:.0f} s). Error = predicted / measured - 1, per round; "
        f"targets: step time within +-15%, memory within +-10%.",
        "",
        "| case | layout | bottleneck | step predicted s | measured s (rounds) | error | "
        "best step s | error | CPU s/step | error | "
        "memory predicted MiB | measured MiB | error | states / transient / activations "
        "MiB, predicted : measured (round 1) | within |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
        "--- |"]
    for r in rows:
        et, em = _err(r["pred"]["step_time"], r["step"]), _err(r["pred"]["memory"], r["mem"])
        eb = _err(r["pred"]["step_time"], r["best"])
        ec = _err(r["pred"]["step_time"], r.get("cpu") or r["best"])
        ok_t = all(abs(e) <= 0.15 for e in et)
        ok_m = all(abs(e) <= 0.10 for e in em)
        lines.append(
            f"| {r['case']} | {r['pred']['layout']} | {r['pred']['bottleneck']} | "
            f"{r['pred']['step_time']:.3f} | {min(r['step']):.3f}-{max(r['step']):.3f} | "
            f"{min(et):+.0%}..{max(et):+.0%} | {min(r['best']):.3f}-{max(r['best']):.3f} | "
            f"{min(eb):+.0%}..{max(eb):+.0%} | {_range(r.get('cpu'))} | "
            f"{min(ec):+.0%}..{max(ec):+.0%} | {r['pred']['memory'] / _MIB:.1f} | "
            f"{min(r['mem']) / _MIB:.1f}-{max(r['mem']) / _MIB:.1f} | "
            f"{min(em):+.1%}..{max(em):+.1%} | {_kinds(r)} | "
            f"{'time' if ok_t else 'TIME MISS'}, {'mem' if ok_m else 'MEM MISS'} |")
    t_ok = sum(all(abs(e) <= 0.15 for e in _err(r["pred"]["step_time"], r["step"]))
               for r in rows)
    b_ok = sum(all(abs(e) <= 0.15 for e in _err(r["pred"]["step_time"], r["best"]))
               for r in rows)
    c_ok = sum(all(abs(e) <= 0.15 for e in _err(r["pred"]["step_time"], r["cpu"]))
               for r in rows if r.get("cpu"))
    m_ok = sum(all(abs(e) <= 0.10 for e in _err(r["pred"]["memory"], r["mem"])) for r in rows)
    lines += ["", f"Within target in every round: step time (median) {t_ok} of {len(rows)} "
              f"cases, best step time {b_ok}, CPU time per step {c_ok}, memory {m_ok} of "
              f"{len(rows)}.",
              ""]
    return "\n".join(lines)


FIT_CASES = ("debug x1 stage 0", "small x1 stage 0")
"""Rows the refit of the second table learns from (one rank: compute alone); the other
rows are judged with the refitted constants."""


def refit(rows: list[dict[str, Any]], hw, seq: int, batch: int) -> tuple[Any, list[float]]:
    """What ``--parallel.plan auto`` does with measurements: refit ``matmul_max`` and
    ``memory_efficiency`` to the FIT_CASES' measured step times (median over rounds), then
    predict every row again. Returns (the device, the predictions in row order)."""
    from shardwise.planner.calibrate import StepMeasurement, calibrate
    from shardwise.train import plan_layout
    from shardwise.train.preflight import build_model_config

    by_name = {_name(*g): g for g in GRID}
    inputs = []
    for r in rows:
        cfg = _config(*by_name[r["case"]], seq, batch)
        spec, _, wl = plan_layout.planner_inputs(cfg, build_model_config(cfg), hw)
        inputs.append((spec, wl, plan_layout.layout_of(cfg)))
    ms = [StepMeasurement(*inputs[i], statistics.median(r["step"]))
          for i, r in enumerate(rows) if r["case"] in FIT_CASES]
    if not ms:
        return hw, [r["pred"]["step_time"] for r in rows]
    fitted, _ = calibrate(ms, hw, params=("matmul_max", "memory_efficiency"))
    from shardwise.planner.cost_model import CostModel
    return fitted, [CostModel(spec, fitted, wl).estimate(L).step_time for spec, wl, L in inputs]


def refit_report(rows: list[dict[str, Any]], fitted, preds: list[float]) -> str:
    """The second table: step times predicted after the refit, against the medians."""
    lines = ["## After refitting to measured steps", "",
             f"`matmul_max` and `memory_efficiency` refit (planner.calibrate, as "
             f"`--parallel.plan auto` does) to the median step times of "
             f"{' and '.join(FIT_CASES)}: matmul_max {fitted.matmul_max:.3g}, "
             f"memory_efficiency {fitted.memory_efficiency:.3g}. The other rows are held out.",
             "", "| case | fit on | step predicted s | measured s (rounds) | error | within |",
             "| --- | --- | --- | --- | --- | --- |"]
    ok = n = 0
    for r, p in zip(rows, preds):
        e = _err(p, r["step"])
        good = all(abs(x) <= 0.15 for x in e)
        held = r["case"] not in FIT_CASES
        ok, n = ok + (good and held), n + held
        lines.append(f"| {r['case']} | {'no' if held else 'yes'} | {p:.3f} | "
                     f"{min(r['step']):.3f}-{max(r['step']):.3f} | {min(e):+.0%}..{max(e):+.0%}"
                     f" | {'yes' if good else 'MISS'} |")
    lines += ["", f"Held-out rows within +-15% in every round: {ok} of {n}.", ""]
    return "\n".join(lines)


def _write(rows: list[dict[str, Any]], meta: dict[str, Any], hw) -> str:
    fitted, preds = refit(rows, hw, meta["seq"], meta["batch"])
    for r, p in zip(rows, preds):
        r["refit_step_time"] = p
    meta["refit"] = {"cases": list(FIT_CASES), "matmul_max": fitted.matmul_max,
                     "memory_efficiency": fitted.memory_efficiency}
    text = report(rows, meta) + "\n" + refit_report(rows, fitted, preds)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planner_bench.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                       indent=1) + "\n")
    (OUT / "planner_bench.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    """Calibrate, run the grid ``--rounds`` times, write the table and the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--calibration", help="an existing calibration file to reuse, or where "
                   "to write the new one")
    p.add_argument("--only", default="", help="run cases whose name contains this")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the tables from the committed JSON, measure nothing")
    args = p.parse_args(argv)
    if args.report_only:
        report_only()
        return
    from shardwise.planner.hardware import get_hardware
    from shardwise.train.preflight import build_model_config

    path, secs = _calibrate(args.calibration)
    hw = get_hardware("local", calibration=path)
    grid = [g for g in GRID if args.only in _name(*g)]
    rows = [{"case": _name(*g), "pred": None, "step": [], "best": [], "cpu": [], "mem": [],
             "breakdown": []} for g in grid]
    for rnd in range(args.rounds):
        for row, (model, ranks, over) in zip(rows, grid):
            cfg = _config(model, ranks, over, args.seq, args.batch)
            row["pred"] = _predict(cfg, build_model_config(cfg), hw)
            got = run_case(model, ranks, over, args.seq, args.batch)
            row["step"].append(got["step_time"])
            row["best"].append(got["best_step_time"])
            row["cpu"].append(got["cpu_step_time"])
            row["mem"].append(got["memory"])
            row["breakdown"].append(got["breakdown"])
            print(f"round {rnd + 1}: {row['case']}: step {got['step_time']:.3f} s "
                  f"(predicted {row['pred']['step_time']:.3f}), memory "
                  f"{got['memory'] / _MIB:.1f} MiB (predicted "
                  f"{row['pred']['memory'] / _MIB:.1f})", flush=True)
    meta = {"rounds": args.rounds, "seq": args.seq, "batch": args.batch,
            "cores": os.cpu_count(), "calibration_s": secs,
            "calibration": Path(path).read_text()}
    print(_write(rows, meta, hw))


def report_only() -> None:
    """Rewrite the markdown (and the refit) from bench/results/planner_bench.json."""
    import tomllib

    from shardwise.planner.hardware import get_hardware

    data = json.loads((OUT / "planner_bench.json").read_text())
    hw = get_hardware("local", extra_tables=[tomllib.loads(data["meta"]["calibration"])])
    print(_write(data["rows"], data["meta"], hw))


if __name__ == "__main__":
    main()
