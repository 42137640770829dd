"""Pipeline schedules on CPU ranks: measured bubble beside the simulator and the formula, and
step time beside ``torch.distributed.pipelining`` running the same stages and schedule.

    python bench/pp_bench.py                       # pp 2 (2 ranks) and pp 4 (4 ranks), ~10 min
    python bench/pp_bench.py --pp 2 --rounds 3     # only pp 2
    python bench/pp_bench.py --quick               # 1 round, 2 steps: a smoke run

For every schedule both runtimes have (gpipe, 1f1b, interleaved_1f1b, looped_bfs, zbv,
dualpipev; zb1 against torch's ScheduleInterleavedZeroBubble, which runs ZB-H1's order with
one stage per rank) the same Llama stages (``split_stages`` of one ``build_model``, no ZeRO:
torch's runtime has none) run forward and backward on the same batches, one Gloo rank per
core (``--threads`` intra-op threads each). Per round, ``--steps`` timed steps of each,
interleaved step by step (ours then torch's, then torch's then ours, ...), so that machine
load hits both alike; a step's time is the slowest rank's, between two barriers. Reported:
the median of each round and the range of the per-round ratio.

Bubble, three ways, all idle rank-time / (p x step time) as in simulate.py:

* measured: from our executor's per-action timestamps (``record_times``): each rank's compute
  time, and the step from the first compute action's start to the last one's end over all
  ranks (one host: ``time.perf_counter`` is the same clock on every rank);
* simulated: ``simulate(schedule, Costs(...))`` with the measured mean duration of F, B, I
  and W per stage and the measured one-way latency of an activation-sized message;
* formula: the published closed form (F=1, B=2, I=W=1, free messages;
  ``shardwise.parallel.pipeline.formulas``).

pp 4 runs 4 ranks on however many cores there are: on a 2-core machine that oversubscribes
the CPU (ranks share cores, so "idle" time is partly another rank computing) and its rows
are labelled so. Writes ``bench/results/pp_bench.{md,json}`` and the measured timeline of
every schedule at the first pp to ``bench/results/pp_timelines/<schedule>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.comm import objects as comm_objects
from shardwise.distributed.comm import p2p as p2p_comm
from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.pipeline import (Costs, PipelineExecutor, Simulation, TimedAction,
                                         build_schedule, cross_entropy_loss, draw_timeline,
                                         resolve_pipeline_groups, simulate, split_stages)
from shardwise.parallel.pipeline.actions import Action
from shardwise.parallel.pipeline.formulas import reference_bubble
from shardwise.parallel.pipeline.replay import replay
from shardwise.testing import run_ranks

OUT = Path(__file__).resolve().parent / "results"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb1", "zbv", "dualpipev")
CFG = LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256,
                  multiple_of=256, max_seq_len=128)
SEQ, PER_MICROBATCH = 128, 2


class _TorchStage(torch.nn.Module):
    """A stage as torch's runtime calls it, ``stage(x)``: our stages rebuild their RoPE
    tables from the micro-batch's tokens, whose shape (every micro-batch's is the same) a
    placeholder gives."""

    def __init__(self, stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x, torch.empty(x.shape[0], SEQ, dtype=torch.long))


def _torch_schedule(name: str, part, microbatches: int):
    """torch.distributed.pipelining's schedule of the same name over the same stages."""
    from torch.distributed import pipelining as tp

    stages = [tp.PipelineStage(_TorchStage(st), st.index, part.num_stages,
                               torch.device("cpu"), group=part.groups.pp) for st in part.stages]
    single = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B}
    multi = {"interleaved_1f1b": tp.ScheduleInterleaved1F1B,
             "looped_bfs": tp.ScheduleLoopedBFS, "zb1": tp.ScheduleInterleavedZeroBubble,
             "zbv": tp.ScheduleZBVZeroBubble, "dualpipev": tp.ScheduleDualPipeV}
    if name in single:
        return single[name](stages[0], microbatches, loss_fn=cross_entropy_loss)
    return multi[name](stages, microbatches, loss_fn=cross_entropy_loss)


def _batch(step: int, microbatches: int):
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, CFG.vocab_size, (microbatches * PER_MICROBATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _one_way_latency(shape) -> float:
    """Seconds for one activation-sized message between pipeline ranks 0 and 1."""
    groups = resolve_pipeline_groups()
    me, buf, reps = groups.pp_rank, torch.randn(shape), 10
    peer = groups.global_rank(1 - me) if me < 2 else None
    comm_objects.barrier(label="bench.ping")
    start = time.perf_counter()
    for _ in range(reps if peer is not None else 0):
        for sender in (0, 1):
            msg = p2p_comm.Message(buf, peer, me == sender, "bench.ping")
            for h in p2p_comm.batch_isend_irecv([msg], groups.pp):
                h.wait()
    elapsed = torch.tensor([(time.perf_counter() - start) / (2 * reps)])
    comm.all_reduce(elapsed, op=dist.ReduceOp.MAX, label="bench.ping")
    return float(elapsed)


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) of one step, the slowest rank's each."""
    comm_objects.barrier(label="bench.step")
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    t = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    comm.all_reduce(t, op=dist.ReduceOp.MAX, label="bench.step")
    return float(t[0]), float(t[1])


def _run_torch(sched, part, x, y) -> None:
    args = (x,) if 0 in [st.index for st in part.stages] else ()
    kwargs = {"target": y} if part.num_stages - 1 in [st.index for st in part.stages] else {}
    sched.step(*args, **kwargs)


def _bench_schedule(name: str, pp: int, microbatches: int, steps: int, rounds: int) -> dict:
    schedule = build_schedule(name, pp, microbatches)
    part = split_stages(build_model(CFG, seed=0), None, schedule.virtual,
                        placement=schedule.placement)
    ours = PipelineExecutor(part, schedule, record_times=True)
    theirs, error = None, None
    try:
        theirs = _torch_schedule(name, part, microbatches)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        error = f"{type(exc).__name__}: {exc}"
    x, y = _batch(0, microbatches)
    runs = {"ours": lambda: ours.step(x, y)}
    if theirs is not None:
        runs["torch"] = lambda: _run_torch(theirs, part, x, y)
    for fn in runs.values():  # warm-up: shapes agreed, allocator primed
        fn()
        part.zero_grad(set_to_none=True)
    times: dict[str, list[list[float]]] = {k: [] for k in runs}
    cpu: dict[str, list[list[float]]] = {k: [] for k in runs}
    traces = []
    for _ in range(rounds):
        per: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for i in range(steps):  # alternate which runtime goes first: load hits both alike
            for key in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                per[key].append(_timed(runs[key]))
                part.zero_grad(set_to_none=True)
                if key == "ours":
                    traces.append([(t.text, t.compute, t.start, t.end) for t in ours.last_times])
        for key in runs:
            times[key].append([w for w, _ in per[key]])
            cpu[key].append([c for _, c in per[key]])
    return {"times": times, "cpu": cpu, "traces": traces, "torch_error": error,
            "stages": [st.index for st in part.stages]}


def _worker(schedules, pp: int, microbatches: dict, steps: int, rounds: int, threads: int):
    torch.set_num_threads(threads)
    latency = _one_way_latency((PER_MICROBATCH, SEQ, CFG.dim))
    out = {"latency_s": latency, "schedules": {}}
    for name in schedules:
        out["schedules"][name] = _bench_schedule(name, pp, microbatches[name], steps, rounds)
    return out


# ----------------------------------------------------------------------------- analysis


def _replayed(schedule, rows, latency: float) -> float:
    """The simulator's bubble for one step fed that step's own durations, action by action
    (rather than per-stage means): what is left of the measured bubble is the executor's
    own waiting, not the spread of the actions' durations."""
    own = {(a.stage, a.kind, a.microbatch): e - s for row in rows for a, s, e in row}
    times = replay(schedule.ranks, schedule.placement,
                   lambda a: own[(a.stage, a.kind, a.microbatch)], latency)
    spans = [[t for a, t in zip(acts, times[r]) if a.is_compute]
             for r, acts in enumerate(schedule.ranks)]
    start, end = min(c[0][0] for c in spans), max(c[-1][1] for c in spans)
    busy = sum(e - s for c in spans for s, e in c)
    return 1 - busy / (len(spans) * (end - start))


def _measured(schedule, per_rank: list[dict], name: str
              ) -> tuple[float, Costs, list, float, list[float]]:
    """Mean measured bubble over the timed steps, the per-stage mean costs, one step's
    timeline (rank -> [(action, start, end)] relative to its start), the mean replayed
    bubble (:func:`_replayed`) and the mean measured bubble of each round."""
    steps = len(per_rank[0]["schedules"][name]["traces"])
    bubbles, durations, first, replays = [], {}, None, []
    for i in range(steps):
        rows = []
        for res in per_rank:
            trace = res["schedules"][name]["traces"][i]
            rows.append([(Action.parse(text.split(" ")[0]), s, e)
                         for text, compute, s, e in trace if compute])
        start = min(row[0][1] for row in rows)
        end = max(row[-1][2] for row in rows)
        busy = sum(e - s for row in rows for _, s, e in row)
        bubbles.append(1 - busy / (len(rows) * (end - start)))
        replays.append(_replayed(schedule, rows, per_rank[0]["latency_s"]))
        for row in rows:
            for a, s, e in row:
                durations.setdefault((a.kind.value, a.stage), []).append(e - s)
        if first is None:
            first = [[(a, s - start, e - start) for a, s, e in row] for row in rows]
    n = schedule.num_stages

    def per_stage(kind: str) -> list[float]:
        return [statistics.mean(durations.get((kind, s), [0.0])) for s in range(n)]
    costs = Costs(f=per_stage("F"), b=per_stage("B"), i=per_stage("I"), w=per_stage("W"),
                  comm=per_rank[0]["latency_s"])
    rounds = len(per_rank[0]["schedules"][name]["times"]["ours"])
    per = max(1, steps // rounds)  # the traces are in round order, ``per`` steps each
    by_round = [statistics.mean(bubbles[i:i + per]) for i in range(0, steps, per)]
    return statistics.mean(bubbles), costs, first, statistics.mean(replays), by_round


def _draw(schedule, first, bubble: float, path: Path) -> None:
    """The measured timeline of one step, drawn like a simulated one (unit: ms)."""
    timeline = tuple(tuple(TimedAction(r, a, s * 1e3, e * 1e3) for a, s, e in row)
                     for r, row in enumerate(first))
    step = max(t.end for row in timeline for t in row)
    sim = Simulation(schedule, Costs(), step, bubble, (), (), (), (), (), 0, timeline)
    draw_timeline(sim, path, title=f"{schedule.name}: measured, pp={schedule.pp}, "
                                   f"microbatches={schedule.microbatches}, virtual="
                                   f"{schedule.virtual}; step {step:.0f} ms, bubble "
                                   f"{bubble:.1%} (time in ms)")


def analyse(pp: int, per_rank: list[dict], microbatches: dict, draw: Path | None
            ) -> list[dict]:
    rows = []
    for name, res in per_rank[0]["schedules"].items():
        schedule = build_schedule(name, pp, microbatches[name])
        bubble, costs, first, replayed, by_round = _measured(schedule, per_rank, name)
        sim = simulate(schedule, costs)
        formula = reference_bubble(name, pp, schedule.microbatches, schedule.virtual)
        ours = [statistics.median(r) for r in res["times"]["ours"]]
        theirs = [statistics.median(r) for r in res["times"].get("torch", [])]
        ratios = [a / b for a, b in zip(ours, theirs)]
        cpu_ours = [statistics.median(r) for r in res["cpu"]["ours"]]
        cpu_theirs = [statistics.median(r) for r in res["cpu"].get("torch", [])]
        rows.append({"schedule": name, "pp": pp, "microbatches": schedule.microbatches,
                     "virtual": schedule.virtual, "bubble_measured": bubble,
                     "bubble_rounds": by_round,
                     "bubble_simulated": float(sim.bubble), "bubble_replayed": replayed,
                     "step_simulated_s": float(sim.step_time),
                     "bubble_formula": float(formula[1]) if formula else None,
                     "formula": formula[0] if formula else None,
                     "ours_s": ours, "torch_s": theirs, "ratio": ratios,
                     "cpu_ours_s": cpu_ours, "cpu_torch_s": cpu_theirs,
                     "cpu_ratio": [a / b for a, b in zip(cpu_ours, cpu_theirs)],
                     "torch_error": res["torch_error"],
                     "costs_ms": {k: [round(1e3 * c, 2) for c in getattr(costs, k)]
                                  for k in ("f", "b", "i", "w")},
                     "latency_ms": round(1e3 * costs.comm, 3)})
        if draw is not None:
            folder = draw / "pp_timelines"
            folder.mkdir(parents=True, exist_ok=True)
            _draw(schedule, first, bubble, folder / f"{name}.png")
    return rows


def _gaps(row: dict) -> list[float]:
    """|measured - simulated| bubble of each round (the mean over all steps for results
    written before rounds were kept)."""
    return [abs(b - row["bubble_simulated"])
            for b in row.get("bubble_rounds") or [row["bubble_measured"]]]


def _range(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return fmt.format(min(values)) if len(values) == 1 else \
        f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Pipeline schedules on CPU ranks ({meta['date']})", "",
             f"Model: Llama dim {CFG.dim}, {CFG.n_layers} layers, seq {SEQ}, "
             f"{PER_MICROBATCH} sequences per micro-batch, fp32, no ZeRO; Gloo, "
             f"{meta['threads']} thread(s) per rank on {meta['cores']} cores; "
             f"{meta['rounds']} round(s) x {meta['steps']} timed steps (forward + backward) "
             f"per runtime; torch {meta['torch']}, commit {meta['commit']}.", "",
             "Bubble = idle rank-time / (p x step time). Simulated: the simulator on the "
             "measured mean F/B/I/W per stage and message latency (the target's figure). "
             "Replayed: the simulator fed each step's own action durations (not means), "
             "averaged over the steps; measured - replayed is the executor's own waiting "
             "beyond the message latency, simulated - replayed the effect of the actions' "
             "spread. Step time: median per round, the range over rounds; ratio = ours / "
             "torch.distributed.pipelining; CPU ratio: the same of the CPU time the slowest "
             "rank's process used per step (median per round).", "",
             "| pp | schedule | m | v | bubble measured | simulated | replayed | formula | "
             "|measured - simulated| (rounds) | ours (s) | torch (s) | ratio | CPU ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = f"{r['pp']}" + (" (oversubscribed)" if r["pp"] > meta["cores"] else "")
        formula = f"{r['bubble_formula']:.1%}" if r["bubble_formula"] is not None else "-"
        gaps = _gaps(r)
        torch_s = _range(r["torch_s"], "{:.3f}") if r["torch_s"] else \
            f"n/a ({r['torch_error'][:60]})"
        lines.append(f"| {label} | {r['schedule']} | {r['microbatches']} | {r['virtual']} | "
                     f"{r['bubble_measured']:.1%} | {r['bubble_simulated']:.1%} | "
                     f"{r['bubble_replayed']:.1%} | {formula} | "
                     f"{_range([100 * g for g in gaps], '{:.1f}')} pt | "
                     f"{_range(r['ours_s'], '{:.3f}')} | {torch_s} | "
                     f"{_range(r['ratio'], '{:.2f}')} | {_range(r['cpu_ratio'], '{:.2f}')} |")
    lines += ["", *_verdicts(rows, meta), "", "Measured per-stage costs (ms, mean) and "
              "message latency:", ""]
    for r in rows:
        lines.append(f"- pp {r['pp']} {r['schedule']}: F {r['costs_ms']['f']}, B "
                     f"{r['costs_ms']['b']}, I {r['costs_ms']['i']}, W {r['costs_ms']['w']}; "
                     f"latency {r['latency_ms']} ms")
    return "\n".join(lines) + "\n"


def _verdicts(rows: list[dict], meta: dict) -> list[str]:
    """The issue's targets at pp <= cores, each met only when every round holds it."""
    load = meta.get("load")
    # The 1-minute average when the run started: other jobs. The 5/15-minute figures still
    # hold earlier work, and the end figure counts the benchmark's own ranks.
    busy = load is not None and load[0] >= 1.0
    out = ["Targets (pp within the core count; a ratio target is met only when every round "
           "holds it):", ""]
    if load is not None:
        end = meta.get("load_at_end")
        out += [f"Load average at start (1/5/15 min): {', '.join(f'{x:.1f}' for x in load)}"
                + (f"; at the end {', '.join(f'{x:.1f}' for x in end)} (the benchmark's "
                   f"own ranks included)" if end else "")
                + (" - other jobs shared the machine, so time figures are not settled."
                   if busy else "."), ""]
    for r in rows:
        if r["pp"] > meta["cores"]:
            continue
        gap = 100 * max(_gaps(r))  # the worst round
        ratios = r["ratio"] or []
        speed = ("no torch peer" if not ratios else "met" if max(ratios) <= 1.0 else
                 "missed" if min(ratios) > 1.0 else "not settled (rounds straddle 1.0)")
        out.append(f"- pp {r['pp']} {r['schedule']}: bubble within 5 pt of the simulator: "
                   f"{'met' if gap <= 5 else 'missed'} (worst round {gap:.1f} pt); step "
                   f"time <= 1.0x "
                   f"torch: {speed}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=0,
                        help="micro-batches (default: 4 pp; dualpipev at least 2 pp)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wait-load", type=float, default=0.0,
                        help="first wait up to this many minutes for a load average < 1")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 2, 1
    names = args.schedules.split(",")
    _wait_for_quiet(args.wait_load)
    load_at_start = os.getloadavg()
    rows = []
    for i, pp in enumerate(args.pp):
        m = {n: args.microbatches or 4 * pp for n in names}
        per_rank = run_ranks(_worker, pp, args=(names, pp, m, args.steps, args.rounds,
                                                args.threads),
                             timeout_s=3600, threads=args.threads)
        rows += analyse(pp, per_rank, m, draw=args.out if i == 0 else None)
        print(to_markdown(rows, _meta(args, load_at_start)), flush=True)
    meta = _meta(args, load_at_start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pp_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "pp_bench.md").write_text(to_markdown(rows, meta))


def _wait_for_quiet(minutes: float) -> None:
    """Wait up to ``minutes`` for the 1-minute load average to drop below 1.0."""
    deadline = time.time() + 60 * minutes
    while minutes > 0 and os.getloadavg()[0] >= 1.0 and time.time() < deadline:
        time.sleep(15)


def _meta(args, load: tuple) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "commit": commit,
            "cores": os.cpu_count(), "threads": args.threads, "steps": args.steps,
            "rounds": args.rounds, "machine": platform.platform(),
            "load": load, "load_at_end": os.getloadavg()}


if __name__ == "__main__":
    main()
