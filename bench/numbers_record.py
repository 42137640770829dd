"""The numbers a refactor must not move: losses of a fixed set of CLI runs and the planner's
validation table and CPU predictions, recorded once and compared bit for bit after every
change (issue 31).

    python bench/numbers_record.py --write      # record bench/results/numbers_record.json
    python bench/numbers_record.py --check      # rerun, compare bit for bit, exit 1 on a change
    python bench/numbers_record.py --check --only stage3,pp_zbv

Each run is ``shardwise train`` on the debug model, 8 steps, launched the way a user
launches it (local ranks, one intra-op thread each, so the sums run in the same order every
time on the same machine); the record keeps every step's loss and gradient norm and the
validation loss as the JSON floats ``metrics.jsonl`` wrote (exact). The planner part is the
text ``python -m shardwise.planner.validation`` prints (every prediction, every error), and
the committed CPU bench re-predicted (``planner_bench.py --report-only --repredict``).
Numbers are compared on the machine and torch build that recorded them: a CPU of another
vector width may round the same program differently.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "numbers_record.json"

COMMON = ["--train.steps", "8", "--data.seq_len", "64", "--data.max_bytes", "400000",
          "--train.eval_interval", "0", "--train.eval_batches", "2", "--log.progress", "false",
          "--log.plot", "false", "--optim.warmup_steps", "2"]

RUNS: dict[str, list[str]] = {
    "stage0": ["--parallel.stage", "0"],
    "stage1": ["--parallel.stage", "1"],
    "stage2": ["--parallel.stage", "2"],
    "stage3": ["--parallel.stage", "3"],
    "stage3_prefetch0_keep": ["--parallel.stage", "3", "--parallel.prefetch", "0",
                              "--parallel.reshard_after_forward", "false"],
    "hybrid": ["--nproc", "4", "--parallel.dp_replicate", "2", "--parallel.stage", "3"],
    "tp2": ["--parallel.tp", "2", "--parallel.stage", "2"],
    "pp_1f1b": ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"],
    "pp_zbv": ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv"],
    "ep2": ["--model.name", "debug-moe", "--parallel.ep", "2"],
    "offload_cpu": ["--offload.device", "cpu"],
    "quantised": ["--comm.weights", "int8", "--comm.grads", "int4"],
    "bf16_accum": ["--precision.param_dtype", "bf16", "--precision.reduce_dtype", "bf16",
                   "--train.grad_accum", "2", "--train.batch_size", "2"],
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC",
                                "SLURM_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def run_one(name: str, tmp: Path) -> dict[str, list[float]]:
    """Train one recorded run; its per-step numbers."""
    log = tmp / name
    cmd = [sys.executable, "-m", "shardwise.train.cli", "train", *COMMON, *RUNS[name],
           "--log.dir", str(log)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp,
                          timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in records if "loss" in r],
            "grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
            "val_loss": [r["val_loss"] for r in records if "val_loss" in r]}


def planner_table() -> str:
    """What ``python -m shardwise.planner.validation`` prints."""
    done = subprocess.run([sys.executable, "-m", "shardwise.planner.validation"],
                          capture_output=True, text=True, env=_env(), timeout=600, check=True)
    return done.stdout


def cpu_predictions() -> dict:
    """The committed CPU bench (bench/results/planner_bench.json) predicted again by this
    planner from its own calibration: every row's predicted step, best step and memory."""
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "bench" / "results" / "planner_bench.json", tmp)
        subprocess.run([sys.executable, str(ROOT / "bench" / "planner_bench.py"),
                        "--report-only", "--repredict", "--out", tmp], capture_output=True,
                       text=True, env=_env(), timeout=900, check=True, cwd=ROOT)
        rows = json.loads((Path(tmp) / "planner_bench.json").read_text())["rows"]
    return {r["case"]: r["pred"] for r in rows}


def record(names: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in names:
            runs[name] = run_one(name, Path(tmp))
            print(f"{name}: loss {runs[name]['loss'][0]:.6f} -> {runs[name]['loss'][-1]:.6f}",
                  flush=True)
    return {"runs": runs, "planner_validation": planner_table(),
            "planner_cpu_predictions": cpu_predictions()}


def compare(saved: dict, now: dict) -> list[str]:
    """Every difference, as lines (empty: bit for bit)."""
    out = []
    for name, numbers in now["runs"].items():
        for key, values in numbers.items():
            before = saved["runs"].get(name, {}).get(key)
            if before != values:
                out.append(f"{name}.{key}: recorded {before}, now {values}")
    if saved.get("planner_validation") != now["planner_validation"]:
        old = saved.get("planner_validation", "").splitlines()
        new = now["planner_validation"].splitlines()
        changed = [f"  - {a}\n  + {b}" for a, b in zip(old, new) if a != b]
        out.append("planner validation table differs:\n" + "\n".join(changed[:20]))
    for case, pred in now["planner_cpu_predictions"].items():
        before = saved.get("planner_cpu_predictions", {}).get(case)
        if before != pred:
            out.append(f"planner CPU prediction {case}: recorded {before}, now {pred}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"record into {RECORD}")
    mode.add_argument("--check", action="store_true", help="rerun and compare bit for bit")
    parser.add_argument("--only", default="", help="comma-separated run names (--check)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(RUNS)}")
    now = record(names)
    if args.write:
        RECORD.write_text(json.dumps(now, indent=1) + "\n")
        print(f"recorded {len(names)} runs and the planner table in {RECORD}")
        return 0
    diffs = compare(json.loads(RECORD.read_text()), now)
    print("\n".join(diffs) if diffs else f"bit for bit: {len(names)} runs and the planner "
                                          f"table equal the record")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
