"""Resident memory over a long run: shardwise stages 0-3 beside PyTorch DDP and FSDP2.

Every framework trains the same 4-layer, width-256 Llama decoder (the ``debug`` shape) on 2
Gloo ranks, 4 x 128 tokens per rank per step, AdamW, one intra-op thread per rank, for
``--steps`` steps (default 2,000); each rank samples its resident set (VmRSS) every
``--every`` steps (default 50). The target (issue 17): shardwise's growth from step 100 to
the end at most 1.05 x FSDP2's growth + 5 MiB, in every round. The default trainer
(``shardwise train``) is sampled the same way from its ``metrics.jsonl`` (``rss_mib``).

    python bench/memory_soak.py                           # 2,000 steps, 1 round (~40 min)
    python bench/memory_soak.py --steps 300 --only sw1,ddp
    python bench/memory_soak.py --rounds 2 --trainer      # also the default trainer
    python bench/memory_soak.py --flight-recorder on --steps 300   # torch's default recorder

Results: ``bench/results/memory_soak.md`` (table), ``memory_soak.json`` (every sample) and
``memory_soak.png`` (RSS of the largest rank against the step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import measure  # noqa: E402
from bench.launch import run_job  # noqa: E402

MODEL = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 256}
BATCH, SEQ = 4, 128
OPT = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
FRAMEWORKS = ("ddp", "fsdp2", "sw0", "sw1", "sw2", "sw3")
RESULTS = Path(__file__).parent / "results"


def soak_rank(framework: str, steps: int, every: int) -> dict:
    """One rank of one job: train ``steps`` steps, sampling VmRSS every ``every`` steps."""
    import torch
    import torch.distributed as dist

    from bench.frameworks import build_runner
    from shardwise.models import build_model, get_model_config
    rank = dist.get_rank()
    model = build_model(get_model_config("debug", **MODEL), seed=0)
    runner = build_runner(framework, model, OPT, BATCH)
    g = torch.Generator().manual_seed(rank)
    samples, t0, cpu0 = [], time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=g)
        loss = runner.fwd_bwd(tokens[:, :-1], tokens[:, 1:])
        runner.opt_step()
        if step % every == 0 or step == 1:
            samples.append((step, measure.rss_now() / 2**20, float(loss)))
    dist.barrier()
    return {"rank": rank, "samples": samples, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0}


def growth(samples: list[tuple[int, float, float]], start: int = 100) -> float:
    """RSS at the last sample minus RSS at ``start`` (MiB)."""
    at = {s: r for s, r, _ in samples}
    first = min((s for s in at if s >= start), default=samples[0][0])
    return at[max(at)] - at[first]


def run_framework(name: str, steps: int, every: int) -> dict:
    ranks = run_job(soak_rank, 2, args=(name, steps, every), threads=1,
                    timeout_s=steps * 2 + 600)
    worst = max(ranks, key=lambda r: r["samples"][-1][1])
    return {"framework": name, "ranks": ranks, "largest_rank": worst["rank"],
            "growth_mib": max(growth(r["samples"]) for r in ranks),
            "final_mib": worst["samples"][-1][1], "wall_s": max(r["wall_s"] for r in ranks),
            "cpu_s": max(r["cpu_s"] for r in ranks)}


def run_trainer(steps: int, every: int) -> dict:
    """The default ``shardwise train`` for ``steps`` steps; RSS from its metrics.jsonl."""
    out = tempfile.mkdtemp(prefix="soak-trainer-")
    cmd = [sys.executable, "-m", "shardwise.train.cli", "train", "--train.steps", str(steps),
           "--log.dir", out, "--log.progress", "false", "--log.plot", "false",
           "--train.eval_interval", str(steps)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
    per_rank: dict[int, list] = {}
    for line in Path(out, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "rss_mib" in rec and (rec["step"] % every == 0 or rec["step"] == 1):
            for r, mib in enumerate(rec["rss_mib"]):
                per_rank.setdefault(r, []).append((rec["step"], mib, rec.get("loss", 0.0)))
    ranks = [{"rank": r, "samples": s} for r, s in sorted(per_rank.items())]
    worst = max(ranks, key=lambda r: r["samples"][-1][1])
    at100 = min((m for s, m, _ in worst["samples"] if s >= 100), default=0.0)
    return {"framework": "trainer", "ranks": ranks, "largest_rank": worst["rank"],
            "growth_mib": max(growth(r["samples"]) for r in ranks),
            "final_mib": worst["samples"][-1][1], "rss_at_100_mib": at100,
            "wall_s": time.perf_counter() - t0, "cpu_s": float("nan")}


def report(rounds: list[dict], steps: int) -> str:
    names = list(dict.fromkeys(n for r in rounds for n in r))
    lines = ["| engine | RSS at step 100 (MiB) | final RSS (MiB) | growth 100 -> end (MiB), per "
             "round | limit (1.05 x FSDP2 + 5) | met in every round | wall s / CPU s |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        ran = [r for r in rounds if name in r]  # a partial last round lacks some engines
        growths = [r[name]["growth_mib"] for r in ran]
        limits = [1.05 * r["fsdp2"]["growth_mib"] + 5 if "fsdp2" in r else None for r in ran]
        met = ""
        if name.startswith("sw") and all(v is not None for v in limits):
            met = "yes" if all(g <= lim for g, lim in zip(growths, limits)) else "**no**"
        if name == "trainer":
            flat = all(r[name]["final_mib"] <= 1.10 * r[name]["rss_at_100_mib"] for r in ran)
            met = "flat within 10%: " + ("yes" if flat else "**no**")
        last = ran[-1][name]
        at100 = [m for s, m, _ in next(r for r in last["ranks"] if r["rank"] ==
                                       last["largest_rank"])["samples"] if s >= 100][:1]
        lim = " / ".join(f"{v:.0f}" for v in limits if v is not None) if name != "fsdp2" else ""
        lines.append(f"| {name} | {at100[0] if at100 else float('nan'):.0f} | "
                     f"{last['final_mib']:.0f} | {' / '.join(f'{g:+.0f}' for g in growths)} | "
                     f"{lim if name.startswith('sw') else ''} | {met} | "
                     f"{last['wall_s']:.0f} / {last['cpu_s']:.0f} |")
    return "\n".join(lines)


def plot(rounds: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    latest = {name: res for r in rounds for name, res in r.items()}  # each engine's last run
    for name, res in latest.items():
        rank = next(r for r in res["ranks"] if r["rank"] == res["largest_rank"])
        ax.plot([s for s, _, _ in rank["samples"]], [m for _, m, _ in rank["samples"]],
                label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("RSS of the largest rank (MiB)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default=",".join(FRAMEWORKS))
    parser.add_argument("--trainer", action="store_true", help="also the default trainer")
    parser.add_argument("--flight-recorder", choices=("off", "on"), default="off",
                        help="torch's flight recorder for every framework's Gloo group: off "
                             "(default, what shardwise.distributed.init sets) or on (torch's "
                             "default when init_process_group is called directly)")
    parser.add_argument("--out", default=str(RESULTS / "memory_soak"))
    args = parser.parse_args()
    # Read when each rank creates its process group ([Note: flight recorder on Gloo]); set
    # before the first job starts the forkserver, so every framework runs under the same one.
    if args.flight_recorder == "off":
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    else:
        os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        res: dict = {}
        rounds.append(res)
        for name in args.only.split(","):
            res[name] = run_framework(name, args.steps, args.every)
            print(f"round {rnd + 1} {name}: growth {res[name]['growth_mib']:+.1f} MiB, final "
                  f"{res[name]['final_mib']:.0f} MiB", flush=True)
            write_results(rounds, args)  # after every job: a stopped soak keeps what it ran
        if args.trainer:
            res["trainer"] = run_trainer(args.steps, args.every)
            print(f"round {rnd + 1} trainer: growth {res['trainer']['growth_mib']:+.1f} MiB",
                  flush=True)
            write_results(rounds, args)
    print(report(rounds, args.steps))


def write_results(rounds: list[dict], args) -> None:
    """Table, samples and plot of the rounds so far (the last one may be partial)."""
    table = report(rounds, args.steps)
    done = sum(len(r) for r in rounds)
    planned = args.rounds * (len(args.only.split(",")) + bool(args.trainer))
    partial = "" if done == planned else (
        f"\n\n**Partial:** {done} of {planned} jobs ran; an engine with fewer rounds than "
        "the others shows only the rounds it ran.")
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"steps": args.steps, "every": args.every, "model": MODEL, "batch": BATCH, "seq": SEQ,
         "flight_recorder": args.flight_recorder,
         "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M"),
         "rounds": rounds}, indent=1))
    plot(rounds, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(
        f"# Resident memory over {args.steps} steps (issue 17)\n\n"
        f"Generated by `python bench/memory_soak.py {' '.join(sys.argv[1:])}`: 2 Gloo ranks, "
        f"debug-shaped model (4 layers, width 256), {BATCH} x {SEQ} tokens per rank, AdamW, "
        f"one intra-op thread; RSS (VmRSS) of the largest rank every {args.every} steps; "
        f"torch's Gloo flight recorder {args.flight_recorder} for every framework. "
        f"Growth = RSS at the end minus RSS at step 100, per round. Load average at the "
        f"last write: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (2 cores).{partial}"
        f"\n\n{table}\n\n![RSS against step]({out.with_suffix('.png').name})\n")


if __name__ == "__main__":
    main()
