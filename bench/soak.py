"""Soak: a long run with frequent checkpoints and random injected failures, restarted by the
launcher until it finishes, must end with exactly the weights of a clean run.

    python bench/soak.py                                   # 300 steps, 4 ranks, torchrun
    python bench/soak.py --steps 60 --faults 3 --launcher ranks --nproc 2   # a few minutes

One clean run (run_ranks, no faults) gives the reference. The soak run draws ``--faults``
faults from ``--seed`` (kill -9 as a step begins, in forward, in backward, while writing a
checkpoint or inside the commit; an exception; a real allocation failure; an exit without a
traceback; a hang the watchdog must end), each at a later step than the previous one and on a
random rank, and sets them all in ``SHARDWISE_FAULT`` with ``attempt=i``, so attempt i hits
fault i. The job runs under ``torchrun --max-restarts`` (``--launcher torchrun``) or is
relaunched by this script (``--launcher ranks``, faster), with ``--checkpoint.resume auto``.
At the end: the final checkpoint's weights and optimizer state must equal the clean run's bit
for bit, every committed checkpoint must verify, and the report lists each fault, whether it
fired, how the failing attempt ended and how long the restarts took.

Results: ``bench/results/soak.json`` and ``soak.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "2", "train.eval_batches": "2",
        "data.max_bytes": "400000", "log.progress": "false", "log.plot": "false",
        "train.eval_interval": "0", "checkpoint.keep_last": "3",
        "checkpoint.resume": "auto"}
# (action, phase, weight): what can go wrong, and where.
KINDS = [("kill", "start", 2), ("kill", "forward", 2), ("kill", "backward", 2),
         ("kill", "checkpoint", 2), ("kill", "commit", 1), ("raise", "optimizer", 1),
         ("oom", "backward", 1), ("exit", "forward", 1), ("hang", "backward", 1)]


@dataclass
class SoakConfig:
    steps: int = 300
    nproc: int = 4
    interval: int = 10
    faults: int = 6
    seed: int = 0
    timeout_s: float = 8.0
    launcher: str = "torchrun"

    def overrides(self, log_dir: Path) -> dict[str, str]:
        return {**TINY, "train.steps": str(self.steps), "checkpoint.interval": str(self.interval),
                "parallel.timeout_s": str(self.timeout_s), "log.dir": str(log_dir)}


@dataclass
class Outcome:
    faults: list[str]
    attempts: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    equal: bool = False
    verified: list[str] = field(default_factory=list)


def plan_faults(cfg: SoakConfig) -> list[str]:
    """``cfg.faults`` faults at increasing steps, attempt i for fault i (see the docstring)."""
    rng = random.Random(cfg.seed)
    kinds = [k for k in KINDS for _ in range(k[2])]
    spacing = max(2, (cfg.steps - 2) // (cfg.faults + 1))
    faults, step = [], 1
    for _ in range(cfg.faults):
        action, phase, _ = rng.choice(kinds)
        step += rng.randint(max(1, spacing // 2), spacing)
        if phase in ("checkpoint", "commit"):  # only a step that saves has a write to hit
            step = -(-step // cfg.interval) * cfg.interval
        if step >= cfg.steps:
            break  # each fault must come later than the one before: no room for more
        rank = 0 if phase == "commit" else rng.randrange(cfg.nproc)
        faults.append(f"{action}:rank={rank}:step={step}:phase={phase}:attempt={len(faults)}")
    return faults


def _load_config(cfg: SoakConfig, log_dir: Path):
    from shardwise.train.config import load_config
    from shardwise.train.preflight import preflight

    return preflight(load_config(None, cfg.overrides(log_dir)), world_size=cfg.nproc)


def _train(config, data):
    from shardwise.train.trainer import build_env, train

    train(config, data, build_env(config))


def run_clean(cfg: SoakConfig, log_dir: Path) -> None:
    from shardwise.testing.dist import run_ranks

    config, data = _load_config(cfg, log_dir)
    run_ranks(_train, cfg.nproc, args=(config, data), timeout_s=3600)


def _run_ranks_attempts(cfg: SoakConfig, log_dir: Path, spec: str, outcome: Outcome) -> None:
    from shardwise.testing.dist import RankFailure, run_ranks

    for attempt in range(len(spec.split(";")) + 1):
        start = time.monotonic()
        config, data = _load_config(cfg, log_dir)
        env = {"SHARDWISE_FAULT": spec, "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        try:
            run_ranks(_train, cfg.nproc, args=(config, data), env=env, timeout_s=3600,
                      grace_s=cfg.timeout_s + 10)
            outcome.attempts.append({"attempt": attempt, "ended": "finished",
                                     "seconds": time.monotonic() - start})
            return
        except RankFailure as exc:
            first = str(exc).splitlines()[0]
            outcome.attempts.append({"attempt": attempt, "ended": first,
                                     "report": _report_head(str(exc)),
                                     "seconds": time.monotonic() - start})
    raise RuntimeError(f"the job did not finish after {len(outcome.attempts)} attempts")


def _report_head(text: str) -> str | None:
    m = re.search(r"shardwise watchdog: [^\n]*", text)
    return m.group(0) if m else None


def _run_torchrun(cfg: SoakConfig, log_dir: Path, spec: str, outcome: Outcome) -> None:
    args = [f"--{k}={v}" for k, v in cfg.overrides(log_dir).items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(cfg.nproc), "--max-restarts", str(cfg.faults), "--monitor-interval", "0.1",
           "-m", "shardwise.train.cli", "train", *args]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["SHARDWISE_FAULT"] = spec
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    total = time.monotonic() - start
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "torchrun.stderr.txt").write_text(proc.stderr)
    # The agent logs each failed attempt: "E1130 04:27:05.677000 ... failed (exitcode: -9)
    # local_rank: 1"; what the ranks printed before it belongs to that attempt.
    pattern = re.compile(r"^E\d{4} (\d+):(\d+):([\d.]+) .*failed \(exitcode: (-?\d+)\) "
                         r"local_rank: (\d+)", re.M)
    last_end, last_t = 0, None
    for i, m in enumerate(pattern.finditer(proc.stderr)):
        t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        chunk = proc.stderr[last_end:m.start()]
        attempt = {"attempt": i, "ended": f"local rank {m.group(5)} exit code {m.group(4)}",
                   "report": _report_head(chunk)}
        if last_t is not None:
            attempt["seconds"] = t - last_t
        outcome.attempts.append(attempt)
        last_end, last_t = m.end(), t
    outcome.attempts.append({"attempt": len(outcome.attempts), "ended": "finished" if
                             proc.returncode == 0 else f"torchrun exit {proc.returncode}"})
    outcome.wall_s = total
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def final_state(cfg: SoakConfig, log_dir: Path) -> tuple[dict, dict]:
    """The last checkpoint of a run, read whole in this process."""
    from shardwise import checkpoint
    from shardwise.models import build_model
    from shardwise.train.preflight import build_model_config
    from shardwise.train.trainer import build_optimizer

    config, data = _load_config(cfg, log_dir / "read")
    model = build_model(build_model_config(config, data.vocab_size), seed=1)
    opt = build_optimizer(model, config.optim)
    checkpoint.load(log_dir / "checkpoints" / f"step_{cfg.steps:08d}", model, opt)
    return model.state_dict(), opt.state_dict()["state"]


def same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (wa, oa), (wb, ob) = a, b
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]))


def soak(cfg: SoakConfig, work: Path) -> Outcome:
    """Clean run, faulty run with restarts, comparison (see the module docstring)."""
    from shardwise import checkpoint

    work.mkdir(parents=True, exist_ok=True)
    run_clean(cfg, work / "clean")
    faults = plan_faults(cfg)
    outcome = Outcome(faults)
    spec = ";".join(faults)
    start = time.monotonic()
    if cfg.launcher == "torchrun":
        _run_torchrun(cfg, work / "soak", spec, outcome)
    else:
        _run_ranks_attempts(cfg, work / "soak", spec, outcome)
    outcome.wall_s = time.monotonic() - start
    outcome.equal = same_state(final_state(cfg, work / "clean"), final_state(cfg, work / "soak"))
    for _, path in checkpoint.list_checkpoints(work / "soak" / "checkpoints"):
        checkpoint.verify(path)
        outcome.verified.append(path.name)
    return outcome


def _collectives(mode: str, n: int) -> float:
    """Seconds per small all-reduce on this group with the watchdog in ``mode``."""
    from shardwise.distributed import comm
    from shardwise.distributed import watchdog

    if mode != "off":
        watchdog.start(watchdog.WatchdogConfig(timeout_s=60, mode=mode))
    x = torch.ones(4)
    for _ in range(50):
        comm.all_reduce(x, label="warmup")
    start = time.perf_counter()
    for _ in range(n):
        comm.all_reduce(x, label="bench.small")
    seconds = (time.perf_counter() - start) / n
    watchdog.stop()
    return seconds


def measure_overhead(n: int = 2000, rounds: int = 3) -> dict[str, float]:
    """Per-collective cost of the watchdog: the bookkeeping alone (a no-op collective in one
    process) and a 16-byte Gloo all-reduce on 2 ranks, watchdog off / on / debug (median of
    ``rounds``), in microseconds."""
    import statistics

    import torch.distributed as dist

    from shardwise.distributed import comm
    from shardwise.distributed.optrack import OpTracker
    from shardwise.testing.dist import run_ranks

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    x, tracker = torch.ones(4), OpTracker(lambda op, exc: exc)
    out: dict[str, float] = {}
    for name, tracked in (("noop_untracked_us", None), ("noop_tracked_us", tracker)):
        comm.set_tracker(tracked)
        start = time.perf_counter()
        for _ in range(20 * n):
            comm._issue("all_reduce", None, "unit3.all_gather", x, False, lambda *a, **k: None,
                        x, group=None)
        out[name] = (time.perf_counter() - start) / (20 * n) * 1e6
    comm.set_tracker(None)
    for mode in ("off", "on", "debug"):
        times = [run_ranks(_collectives, 2, args=(mode, n if mode != "debug" else n // 10),
                           timeout_s=600)[0] for _ in range(rounds)]
        out[f"gloo_all_reduce_{mode}_us"] = statistics.median(times) * 1e6
    return out


def _markdown(cfg: SoakConfig, out: Outcome) -> str:
    lines = [f"# Soak: {cfg.steps} steps, {cfg.nproc} ranks, checkpoint every {cfg.interval} "
             f"steps, {len(out.faults)} injected faults ({cfg.launcher})", "",
             "| attempt | fault injected | how the attempt ended | seconds | the watchdog's "
             "report (first line) |", "|---|---|---|---|---|"]
    for a in out.attempts:
        fault = out.faults[a["attempt"]] if a["attempt"] < len(out.faults) else "-"
        seconds = f"{a['seconds']:.1f}" if "seconds" in a else "-"
        report = (a.get("report") or "-").removeprefix("shardwise watchdog: ")
        lines.append(f"| {a['attempt']} | `{fault}` | {a['ended']} | {seconds} | {report} |")
    lines += ["", f"- restarts: {len(out.attempts) - 1}; wall time with restarts "
              f"{out.wall_s:.0f} s", f"- final weights and optimizer state equal to the clean "
              f"run: **{out.equal}**", f"- committed checkpoints verified: "
              f"{', '.join(out.verified)}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--faults", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=8.0)
    p.add_argument("--launcher", choices=("torchrun", "ranks"), default="torchrun")
    p.add_argument("--work", default="/tmp/shardwise-soak")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"))
    p.add_argument("--overhead", action="store_true",
                   help="only measure the watchdog's cost per collective")
    a = p.parse_args(argv)
    if a.overhead:
        print(json.dumps(measure_overhead(), indent=2))
        return 0
    cfg = SoakConfig(a.steps, a.nproc, a.interval, a.faults, a.seed, a.timeout_s, a.launcher)
    outcome = soak(cfg, Path(a.work))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"config": vars(cfg), **vars(outcome)},
                                                indent=2) + "\n")
    Path(a.out + ".md").write_text(_markdown(cfg, outcome))
    print(_markdown(cfg, outcome))
    return 0 if outcome.equal else 1


if __name__ == "__main__":
    sys.exit(main())
