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

* **step time**: the median of ``trainer.train_step`` over the timed steps after a warm-up
  step (the slowest rank's), against ``CostModel.estimate(layout).step_time`` for the
  layout the config describes (``plan_layout.layout_of``, the mapping ``--parallel.plan
  auto`` uses);
* **memory**: per rank, the engine's own accounting (``memory_report``: parameters,
  gradients after backward, optimizer state after the step, the peak of gathered
  parameters and communication buffers) plus the activations saved for backward (unique
  storages an outer ``saved_tensors_hooks`` saw packed during forward and still alive at
  its end; parameters excluded), the largest rank; against the planner's memory of the
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
        ("debug", 2, {"parallel.pp": "2", "parallel.stage": "2", "train.batch_size": "8"}),
        ("debug", 4, {"parallel.stage": "3"}),
        ("debug", 4, {"parallel.tp": "2", "parallel.stage": "3"}),
        ("debug", 4, {"parallel.pp": "2", "parallel.stage": "3"}),
        ("small", 1, {"parallel.stage": "0"}), ("small", 2, {"parallel.stage": "0"}),
        ("small", 2, {"parallel.stage": "3"}),
        ("small", 2, {"parallel.tp": "2", "parallel.stage": "2", "train.batch_size": "8"}),
        ("small", 2, {"parallel.pp": "2", "parallel.stage": "2", "train.batch_size": "8"}),
        ("small", 4, {"parallel.stage": "3"})]
STEPS = {"debug": 5, "small": 3}  # timed steps (after one warm-up step)


def _config(model: str, ranks: int, over: dict[str, str], seq: int, batch: int):
    from shardwise.train.config import load_config, resolve_world

    base = {"model.name": model, "data.seq_len": str(seq), "train.batch_size": str(batch),
            "log.progress": "false", "parallel.watchdog": "off"}
    return resolve_world(load_config(None, {**base, **over}), ranks)


def _saved_activations(model, cfg, env, tokens) -> tuple[int, Any]:
    """Bytes saved for backward by one forward (unique storages alive at its end), and
    the loss."""
    from shardwise.train.parallelize import cross_entropy

    packed: dict[int, tuple[Any, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.requires_grad and t.grad_fn is None):  # parameters are not activations
            st = t.untyped_storage()
            packed.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model, model(tokens[:, :-1]), tokens[:, 1:])
    return sum(n for ref, n in packed.values() if not ref.expired()), loss


def _rank(cfg, model_cfg, steps: int) -> dict[str, float]:
    """One rank: a memory-tracked step, a warm-up step, then ``steps`` timed steps."""
    import shardwise
    from shardwise import LossScaler
    from shardwise.distributed import env as dist_env
    from shardwise.train.parallelize import build_parallel_model, data_rank, wrap_optimizer
    from shardwise.train.trainer import build_optimizer, train_step

    env = dist_env.init(backend="gloo", watchdog="off")  # the group run_ranks made
    model = build_parallel_model(cfg, model_cfg, env)
    opt = wrap_optimizer(build_optimizer(model, cfg.optim), model)
    rank, ranks = data_rank(cfg, env)
    gen = torch.Generator().manual_seed(rank)
    shape = (cfg.train.batch_size, cfg.data.seq_len + 1)

    class Loader:  # random tokens: the numbers do not depend on the text
        def next_batch(self):
            t = torch.randint(0, model_cfg.vocab_size, shape, generator=gen)
            return t[:, :-1], t[:, 1:]

    saved, loss = _saved_activations(model, cfg, env,
                                     torch.randint(0, model_cfg.vocab_size, shape, generator=gen))
    loss.backward()
    grads = shardwise.memory_report(model, opt).grad_bytes
    opt.step()
    opt.zero_grad(set_to_none=True)
    rep = shardwise.memory_report(model, opt)
    scaler, times = LossScaler(enabled=False), []
    for step in range(steps + 1):
        rec = train_step(model, opt, Loader(), cfg, env, step + 1, scaler)
        times.append(rec["step_time_s"])
    return {"step_time": statistics.median(times[1:]), "params": rep.param_bytes,
            "grads": grads, "optimizer": rep.optimizer_bytes,
            "transient": rep.peak_transient_bytes, "activations": saved}


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
    return {"step_time": max(r["step_time"] for r in rows), "memory": max(mem),
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
            "train.batch_size": "batch"}
    return f"{model} x{ranks} " + ",".join(f"{keys[k]} {v}" for k, v in over.items())


def _err(pred: float, meas: list[float]) -> list[float]:
    return [pred / m - 1 for m in meas]


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
        "memory predicted MiB | measured MiB | error | states / transient / activations "
        "MiB, predicted : measured (round 1) | within |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        et, em = _err(r["pred"]["step_time"], r["step"]), _err(r["pred"]["memory"], r["mem"])
        ok_t = all(abs(e) <= 0.15 for e in et)
        ok_m = all(abs(e) <= 0.10 for e in em)
        lines.append(
            f"| {r['case']} | {r['pred']['layout']} | {r['pred']['bottleneck']} | "
            f"{r['pred']['step_time']:.3f} | {min(r['step']):.3f}-{max(r['step']):.3f} | "
            f"{min(et):+.0%}..{max(et):+.0%} | {r['pred']['memory'] / _MIB:.1f} | "
            f"{min(r['mem']) / _MIB:.1f}-{max(r['mem']) / _MIB:.1f} | "
            f"{min(em):+.1%}..{max(em):+.1%} | {_kinds(r)} | "
            f"{'time' if ok_t else 'TIME MISS'}, {'mem' if ok_m else 'MEM MISS'} |")
    t_ok = sum(all(abs(e) <= 0.15 for e in _err(r["pred"]["step_time"], r["step"]))
               for r in rows)
    m_ok = sum(all(abs(e) <= 0.10 for e in _err(r["pred"]["memory"], r["mem"])) for r in rows)
    lines += ["", f"Within target in every round: step time {t_ok} of {len(rows)} cases, "
              f"memory {m_ok} of {len(rows)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Calibrate, run the grid ``--rounds`` times, write the table and the JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--calibration", help="an existing calibration file to reuse, or where "
                   "to write the new one")
    p.add_argument("--only", default="", help="run cases whose name contains this")
    args = p.parse_args(argv)
    from shardwise.planner.hardware import get_hardware
    from shardwise.train.preflight import build_model_config

    path, secs = _calibrate(args.calibration)
    hw = get_hardware("local", calibration=path)
    grid = [g for g in GRID if args.only in _name(*g)]
    rows = [{"case": _name(*g), "pred": None, "step": [], "mem": [], "breakdown": []}
            for g in grid]
    for rnd in range(args.rounds):
        for row, (model, ranks, over) in zip(rows, grid):
            cfg = _config(model, ranks, over, args.seq, args.batch)
            row["pred"] = _predict(cfg, build_model_config(cfg), hw)
            got = run_case(model, ranks, over, args.seq, args.batch)
            row["step"].append(got["step_time"])
            row["mem"].append(got["memory"])
            row["breakdown"].append(got["breakdown"])
            print(f"round {rnd + 1}: {row['case']}: step {got['step_time']:.3f} s "
                  f"(predicted {row['pred']['step_time']:.3f}), memory "
                  f"{got['memory'] / _MIB:.1f} MiB (predicted "
                  f"{row['pred']['memory'] / _MIB:.1f})", flush=True)
    meta = {"rounds": args.rounds, "seq": args.seq, "batch": args.batch,
            "cores": os.cpu_count(), "calibration_s": secs,
            "calibration": Path(path).read_text()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planner_bench.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                       indent=1) + "\n")
    (OUT / "planner_bench.md").write_text(report(rows, meta))
    print(report(rows, meta))


if __name__ == "__main__":
    main()
