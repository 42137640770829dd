"""Side-by-side ZeRO benchmark: shardwise stages 0-3 against PyTorch DDP, FSDP2 and
DeepSpeed ZeRO-1/2/3, on 2 and 4 CPU ranks (Gloo, one intra-op thread per rank).

Run from the repository root (see bench/README.md for installing DeepSpeed)::

    python bench/zero_bench.py                      # full run (~40 min on 2 cores)
    python bench/zero_bench.py --quick              # 1 round, fewer steps (~10 min)
    python bench/zero_bench.py --regime overhead --world 2 --only ddp,fsdp2,sw3

Writes bench/results/zero_bench.md and zero_bench.json (``--out`` to change the stem).

Noise control: every framework's job is a fresh set of rank processes, and the jobs are
interleaved in rounds (regime, world size, then each framework in an order rotated every
round), so that ratios within one run compare jobs run minutes apart, not a framework
measured while the machine was quiet against one measured while it was busy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.frameworks import FRAMEWORKS, LABELS, describe  # noqa: E402
from bench.launch import JobFailure, run_job, use_engine_rev  # noqa: E402
from bench.report import aggregate, write_markdown  # noqa: E402
from bench.worker import REGIMES, run_rank  # noqa: E402

_NETNS_ENV = "ZERO_BENCH_NETNS"
OPTIMIZER = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
             "foreach": None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 round, 1 warm-up + 2 timed steps (compute), 2 + 5 (overhead)")
    p.add_argument("--regime", default="all", choices=["all", *REGIMES],
                   help="which regime(s) to run (default all)")
    p.add_argument("--world", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--only", default=",".join(FRAMEWORKS),
                   help=f"comma-separated frameworks (default all: {','.join(FRAMEWORKS)})")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument("--steps", default=None,
                   help="timed steps per job as compute,overhead (default 2,10; quick 2,5)")
    p.add_argument("--warmup", default=None,
                   help="warm-up steps per job as compute,overhead (default 1,3; quick 1,2)")
    p.add_argument("--foreach", choices=["default", "on", "off"], default="default",
                   help="AdamW foreach implementation for every framework (default: torch's)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "zero_bench"),
                   help="output path without extension (default bench/results/zero_bench)")
    p.add_argument("--wait-load", type=float, default=0.0, metavar="MIN",
                   help="wait up to MIN minutes for the 1-minute load average to drop "
                        "below --load-below before starting (default 0: do not wait)")
    p.add_argument("--load-below", type=float, default=1.0)
    p.add_argument("--no-netns", action="store_true",
                   help="do not re-run inside a private network namespace (then loopback "
                        "byte counts include every other process's loopback traffic)")
    p.add_argument("--job-timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--max-minutes", type=float, default=None, metavar="MIN",
                   help="start no further round once the next one would end past MIN minutes "
                        "(results are written after every round either way)")
    p.add_argument("--engine-rev", default=None, metavar="REV",
                   help="benchmark shardwise as committed at git REV (e.g. HEAD) instead of "
                        "the working tree, so uncommitted edits in progress are not measured")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(FRAMEWORKS)
    if unknown:
        p.error(f"--only: unknown framework(s) {sorted(unknown)}; choose from {FRAMEWORKS}")
    return args


def enter_private_netns(argv: list[str]) -> None:
    """Re-run this script under ``unshare -n`` (a network namespace of its own, loopback
    up) so the loopback counters see only the benchmark's traffic; no-op when refused."""
    if os.environ.get(_NETNS_ENV):
        subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
        return
    if not (shutil.which("unshare") and shutil.which("ip")):
        return
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True)
    if probe.returncode != 0:
        return
    os.environ[_NETNS_ENV] = "1"
    os.execvp("unshare", ["unshare", "-n", "--", sys.executable, os.path.abspath(__file__),
                          *argv])


def netns_state() -> str:
    return "private" if os.environ.get(_NETNS_ENV) else "shared"


def wait_for_quiet(minutes: float, below: float) -> list[float]:
    """Sleep until the 1-minute load average is below ``below`` (or ``minutes`` pass)."""
    deadline = time.monotonic() + 60 * minutes
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.2f} >= {below}; waiting", flush=True)
        time.sleep(30)
    return list(os.getloadavg())


def prebuild_deepspeed() -> str | None:
    """DeepSpeed JIT-compiles a shared-memory comm op on first init (minutes on 2 cores);
    build it once here so no job pays it. Returns DeepSpeed's version or None."""
    try:
        import deepspeed
        from deepspeed.comm.torch import build_shm_op
    except ImportError:
        return None
    build_shm_op()
    return deepspeed.__version__


def optimizer_settings(args) -> dict:
    return {**OPTIMIZER, "foreach": {"default": None, "on": True, "off": False}[args.foreach]}


def plan_jobs(args) -> list[dict]:
    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    steps = [int(x) for x in (args.steps or ("2,5" if quick else "2,10")).split(",")]
    warm = [int(x) for x in (args.warmup or ("1,2" if quick else "1,3")).split(",")]
    regimes = list(REGIMES) if args.regime == "all" else [args.regime]
    worlds = [int(w) for w in args.world.split(",")]
    fws = [f for f in FRAMEWORKS if f in args.only.split(",")]
    opt = optimizer_settings(args)
    jobs = []
    for rnd in range(rounds):
        for regime in regimes:
            i = list(REGIMES).index(regime)
            for world in worlds:
                k = rnd % len(fws)
                for fw in fws[k:] + fws[:k]:
                    jobs.append({"round": rnd, "regime": regime, "world": world,
                                 "framework": fw, "steps": steps[i], "warmup": warm[i],
                                 "opt": opt})
    return jobs


def run_jobs(jobs: list[dict], timeout_s: float, with_ds: bool) -> list[dict]:
    done = []
    t_start = time.monotonic()
    for n, job in enumerate(jobs, 1):
        spec = {k: job[k] for k in ("framework", "regime", "steps", "warmup", "opt")}
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        try:
            ranks = run_job(run_rank, job["world"], (spec,), timeout_s=timeout_s,
                            with_deepspeed=with_ds)
            rec = {**job, "ranks": ranks, "error": None}
            med = sorted(max(s) for s in zip(*[r["step_s"] for r in ranks]))
            note = f"median step {1e3 * med[len(med) // 2]:.0f} ms"
        except JobFailure as e:
            rec = {**job, "ranks": [], "error": str(e)}
            note = "FAILED: " + str(e).splitlines()[0]
        rec.update(load_before=load, job_s=time.monotonic() - t0)
        done.append(rec)
        print(f"[{n}/{len(jobs)} {time.monotonic() - t_start:6.0f}s] round {job['round']} "
              f"{job['regime']} N={job['world']} {LABELS[job['framework']]}: {note} "
              f"(job {rec['job_s']:.0f}s, load {load:.2f})", flush=True)
    return done


def environment(ds_version: str | None, load_start, load_end) -> dict:
    import torch
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "deepspeed": ds_version, "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(), "mem_total_gib": _mem_total_gib(),
        "threads_per_rank": 1, "backend": "gloo", "netns": netns_state(),
        "loadavg_start": load_start, "loadavg_end": load_end,
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        **_git_state(),
    }


def _git_state() -> dict:
    def git(*a):
        r = subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    dirty = git("status", "--porcelain", "--", "shardwise")
    return {"git_commit": git("rev-parse", "HEAD"),
            "engine_uncommitted_changes": bool(dirty) if dirty is not None else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def write_results(args, env: dict, records: list[dict]) -> None:
    payload = {"environment": env, "setup": describe(optimizer_settings(args)),
               "regimes": REGIMES, "args": vars(args), **aggregate(records), "jobs": records}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    write_markdown(payload, args.out + ".md")
    print(f"wrote {args.out}.md and {args.out}.json ({env['rounds_done']} of "
          f"{env['rounds_planned']} rounds)", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.no_netns:
        enter_private_netns(argv)
    engine = use_engine_rev(args.engine_rev, ROOT) if args.engine_rev else None
    jobs = plan_jobs(args)
    with_ds = any(j["framework"].startswith("ds") for j in jobs)
    ds_version = prebuild_deepspeed() if with_ds else None
    if with_ds and ds_version is None:
        print("deepspeed is not installed: DeepSpeed rows are skipped "
              "(DS_BUILD_OPS=0 pip install -e '.[bench]')", flush=True)
        jobs = [j for j in jobs if not j["framework"].startswith("ds")]
        with_ds = False
    load_start = wait_for_quiet(args.wait_load, args.load_below) if args.wait_load else \
        list(os.getloadavg())
    print(f"{len(jobs)} jobs; network namespace: {netns_state()}; load {load_start}",
          flush=True)
    records: list[dict] = []
    t_run = time.monotonic()
    rounds = sorted({j["round"] for j in jobs})
    for rnd in rounds:
        t_round = time.monotonic()
        records += run_jobs([j for j in jobs if j["round"] == rnd], args.job_timeout, with_ds)
        env = environment(ds_version, load_start, list(os.getloadavg()))
        env.update(engine_source=f"git archive {engine}" if engine else "working tree",
                   rounds_done=rnd + 1, rounds_planned=len(rounds))
        write_results(args, env, records)
        spent, last = time.monotonic() - t_run, time.monotonic() - t_round
        if args.max_minutes and rnd != rounds[-1] and spent + last > 60 * args.max_minutes:
            print(f"stopping after round {rnd + 1} of {len(rounds)}: another would end past "
                  f"--max-minutes {args.max_minutes}", flush=True)
            break
    return 0 if all(r["error"] is None for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
