"""Where one rank's training step spends its time, per framework.

    python bench/profile_step.py --only sw3,fsdp2,ds3 --regime overhead --world 2
    python bench/profile_step.py --only sw0,ddp --regime compute --world 2 --steps 1

Each framework runs as a fresh job on N Gloo ranks (the same model, data and optimizer as
bench/zero_bench.py). After warm-up, rank 0 profiles ``--steps`` steps with torch.profiler
(top ops by self CPU time, and that time grouped into compute / copies / collectives /
optimizer) and then the same number of steps with cProfile (Python time grouped by package,
top functions by own time): the first says which kernels and waits the step pays for, the
second how much of it is framework Python (hooks, bookkeeping). Reports go to
bench/results/profiles/<framework>_<regime>_w<N>.txt and are echoed to stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch.distributed as dist  # noqa: E402

from bench.frameworks import FRAMEWORKS, LABELS  # noqa: E402
from bench.worker import REGIMES, setup  # noqa: E402

# Self CPU time of ops whose name contains one of these goes to the category (first match).
CATEGORIES = [
    ("collectives and waits", ("gloo", "c10d", "all_gather", "allgather", "reduce_scatter",
                               "allreduce", "all_reduce", "all_to_all", "alltoall", "broadcast",
                               "barrier", "wait")),
    ("copies, cat, fill", ("copy_", "aten::cat", "_to_copy", "clone", "contiguous", "fill_",
                           "zero_", "narrow_copy", "index_put", "set_", "resize_", "empty",
                           "as_strided", "view", "split", "chunk", "slice", "select")),
    ("matmul", ("mm", "matmul", "linear", "bmm", "addmm", "dot", "scaled_dot_product",
                "flash_attention", "_efficient_attention")),
    ("optimizer math", ("_foreach", "lerp", "addcmul", "addcdiv", "sqrt", "mul_", "add_",
                        "div_")),
]
# cProfile own time is grouped by the file's package (first match wins).
PACKAGES = [("model (shardwise.models)", "shardwise/models/"), ("shardwise engine", "shardwise/"),
            ("FSDP2", "torch/distributed/fsdp"),
            ("DeepSpeed", "deepspeed/"), ("DDP", "torch/nn/parallel"),
            ("torch.distributed (c10d Python)", "torch/distributed/"),
            ("torch.optim", "torch/optim/"), ("torch.autograd", "torch/autograd/"),
            ("torch.nn modules", "torch/nn/"), ("bench harness", "bench/")]


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other ops"


def _torch_profile(runner, batches, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            runner.fwd_bwd(x, y)
            runner.opt_step()
    wall = (time.perf_counter() - t0) / len(batches)
    events = prof.key_averages()
    by_cat: dict[str, float] = {}
    for e in events:
        by_cat[_category(e.key)] = by_cat.get(_category(e.key), 0.0) + e.self_cpu_time_total
    total = sum(by_cat.values()) or 1.0
    out = [f"torch.profiler: {wall * 1e3:.1f} ms per step under the profiler; self CPU time "
           f"per step by category (all threads):"]
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        out.append(f"  {cat:26s} {us / 1e3 / len(batches):9.1f} ms  {100 * us / total:5.1f}%")
    opt = [e for e in events if e.key.startswith("Optimizer.step")]
    if opt:
        out.append(f"  (optimizer step, inclusive: "
                   f"{sum(e.cpu_time_total for e in opt) / 1e3 / len(batches):.1f} ms/step)")
    out += ["", events.table(sort_by="self_cpu_time_total", row_limit=top,
                             max_name_column_width=60)]
    return "\n".join(out)


def _cprofile(runner, batches, top: int) -> str:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for x, y in batches:
        runner.fwd_bwd(x, y)
        runner.opt_step()
    prof.disable()
    wall = (time.perf_counter() - t0) / len(batches)
    stats = pstats.Stats(prof)
    by_pkg: dict[str, float] = {}
    for (path, _, func), (_, _, tottime, _, _) in stats.stats.items():
        pkg = next((name for name, key in PACKAGES if key in path), None)
        if pkg is None:
            pkg = "C/builtin calls" if path == "~" else "other Python"
        if "wait" in func and path == "~":
            pkg = "waits on collectives (C)"
        by_pkg[pkg] = by_pkg.get(pkg, 0.0) + tottime
    out = [f"cProfile: {wall * 1e3:.1f} ms per step under cProfile; own time per step by "
           f"package (main thread; C++ autograd and kernels appear under the calling line):"]
    for pkg, s in sorted(by_pkg.items(), key=lambda kv: -kv[1]):
        out.append(f"  {pkg:34s} {s * 1e3 / len(batches):9.1f} ms")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    return "\n".join(out) + "\n\n" + text[text.find("   ncalls"):]


def profile_rank(spec: dict) -> str | None:
    """Warm up, then profile ``spec['steps']`` steps twice on rank 0 (others just run)."""
    runner, batches, _ = setup(spec)
    w, k = spec["warmup"], spec["profile_steps"]
    for x, y in batches[:w]:
        runner.fwd_bwd(x, y)
        runner.opt_step()
    rank0 = dist.get_rank() == 0
    parts = []
    for i, prof in enumerate((_torch_profile, _cprofile)):
        chunk = batches[w + i * k:w + (i + 1) * k]
        dist.barrier()
        if rank0:
            parts.append(prof(runner, chunk, spec["top"]))
        else:
            for x, y in chunk:
                runner.fwd_bwd(x, y)
                runner.opt_step()
    return "\n\n".join(parts) if rank0 else None


def main(argv=None) -> int:
    from bench.launch import run_job, use_engine_rev
    from bench.profile_step import profile_rank as fn  # importable by the ranks
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="sw3,fsdp2,ds3", help="comma-separated frameworks")
    p.add_argument("--regime", default="overhead", choices=list(REGIMES))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per profiler")
    p.add_argument("--top", type=int, default=25, help="rows of each table")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "bench", "results", "profiles"))
    p.add_argument("--engine-rev", default=None, metavar="REV",
                   help="profile shardwise as committed at git REV instead of the working tree")
    args = p.parse_args(argv)
    engine = use_engine_rev(args.engine_rev, ROOT) if args.engine_rev else None
    fws = args.only.split(",")
    bad = [f for f in fws if f not in FRAMEWORKS]
    if bad:
        p.error(f"--only: unknown framework(s) {bad}; choose from {FRAMEWORKS}")
    os.makedirs(args.out_dir, exist_ok=True)
    for fw in fws:
        spec = {"framework": fw, "regime": args.regime, "warmup": args.warmup,
                "steps": 2 * args.steps, "profile_steps": args.steps, "top": args.top,
                "opt": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                        "foreach": None}}
        report = run_job(fn, args.world, (spec,),
                         with_deepspeed=any(f.startswith("ds") for f in fws))[0]
        head = (f"# {LABELS[fw]}, {args.regime}-bound, {args.world} ranks, rank 0; load "
                f"average {os.getloadavg()[0]:.2f}; shardwise from "
                f"{'git ' + engine if engine else 'the working tree'}\n\n")
        path = os.path.join(args.out_dir, f"{fw}_{args.regime}_w{args.world}.txt")
        with open(path, "w") as f:
            f.write(head + report + "\n")
        print(head + report + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
