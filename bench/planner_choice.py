"""The planner's choice, measured: its top layout against the trainer's default and against
a brute-force measurement of every buildable layout, on this machine's CPU ranks.

    python bench/planner_choice.py                          # calibrate, screen, 3 rounds
    python bench/planner_choice.py --rounds 3 --screen-from bench/results/planner_choice.json
    python bench/planner_choice.py --only "debug x2" --rounds 1 --steps 1 --screen-max 4

Jobs: the debug and small models on 2 and 4 ranks, each without a cap (the device's
memory) and with a cap that the trainer's default layout exceeds (``CAP_SHARE`` in
planner_choice_space.py: the planner must trade time for memory). Every layout is built
exactly as ``shardwise train`` builds it (``build_parallel_model``, planner_bench's rank
function) on random tokens. For each job:

* **top**: what ``--parallel.plan auto`` builds (``plan_layout.rank_layouts``' first, on the
  ``local`` device with ``hbm_gib`` at the cap);
* **default**: what ``shardwise train`` builds with no parallel flags (ZeRO-3 over every
  rank, 4 sequences of 128 tokens a rank);
* **brute force**: every buildable layout of the planner's enumeration that fits the cap,
  reduced by rules that do not come from the cost model ([Note: the brute-force space]).
  Each is screened once (a warm-up step and ``--screen-steps`` timed steps: its fastest);
  the ``--finalists`` fastest go into the rounds. ``--screen-per-family 1`` screens, on 4
  ranks, only the predicted fastest of each mesh and schedule (a shorter run).

Then, each job right after its screen (so every job ends complete and is written as it
ends), ``--rounds`` rounds: in each, the top, the default and the finalists are measured
back to back (the order rotating by round), each in its own launch of the ranks
([Note: one launch per layout]) with a warm-up step (memory-tracked: planner_bench's
accounting) and ``--steps`` timed steps. Per layout:
the median and the fastest step (the slowest rank's) and the CPU seconds a step. The
brute-force best of a round is the fastest fitting layout measured in it (the top and
finalists; the default when it fits). Targets, judged on the fastest steps (the machine is
shared; medians shown beside) and met only when every round holds them: the top no slower
than the default (jobs where the default fits), within 10% of the brute-force best, and
its predicted gain over the default (default predicted / top predicted, the undisturbed
prediction for the fastest step) within 15% of the measured gain.

Writes ``bench/results/planner_choice.{md,json}`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import planner_choice_space as space  # noqa: E402
from bench.planner_bench import _calibrate  # noqa: E402  (the same calibration step)
from bench.planner_choice_report import OUT, write  # noqa: E402

STEPS = {"debug": 4, "small": 2}
"""Timed steps per layout in a round (after the warm-up step)."""
SCREEN_STEPS = {"debug": 2, "small": 1}
_TIMEOUT_S = 600  # one layout's launch


def measure(job: space.Job, layouts: list, steps: int) -> list[dict[str, Any]]:
    """Build and time each layout of ``job`` on its ranks: the slowest rank's median,
    fastest and CPU seconds a step, and the largest rank's engine-accounted bytes.

    [Note: one launch per layout] Each layout gets its own launch of the ranks (processes
    forked from the preloaded server, a second or two), so every layout is equally the
    first its processes run, and a layout that fails cannot disturb the next. (The ranks
    once ended one collective apart after a pipeline here: selective checkpointing under a
    split-backward schedule failed mid-step on the last stage's rank only, and the next
    build's group creation met the first stage's loss all-reduce. The executor now refuses
    that at build time on every rank alike: tests/test_pp_rebuild.py.) A layout whose
    ranks fail is recorded with its error and the others go on.
    """
    from bench.planner_bench import KINDS, _rank
    from shardwise.testing.dist import RankFailure, RankTimeout, run_ranks
    from shardwise.train import plan_layout
    from shardwise.train.preflight import build_model_config

    base = space.job_config(job)
    model_cfg = build_model_config(base)
    out: list[dict[str, Any]] = []
    for L in layouts:
        cfg = plan_layout.with_layout(base, L)
        load = os.getloadavg()[0]  # the machine's, as the layout starts
        try:
            rows = run_ranks(_rank, job.ranks, args=(cfg, model_cfg, steps), threads=1,
                             env={"OMP_NUM_THREADS": "1"}, timeout_s=_TIMEOUT_S)
        except (RankFailure, RankTimeout) as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        mem = [sum(r[k] for k in KINDS) for r in rows]
        out.append({k: max(r[k] for r in rows) for k in
                    ("step_time", "best_step_time", "cpu_step_time")}
                   | {"memory": max(mem), "load": load})
    return out


def predict(job: space.Job, L, hw) -> dict[str, float]:
    """The planner's step time (median and undisturbed) and memory of ``L``: the total it
    compares with the cap, and the bytes planner_bench measures (the rest: allowances)."""
    from bench.planner_bench import _predict
    from shardwise.planner.cost_model import CostModel
    from shardwise.train import plan_layout
    from shardwise.train.preflight import build_model_config

    cfg = plan_layout.with_layout(space.job_config(job), L)
    model_cfg = build_model_config(cfg)
    p = _predict(cfg, model_cfg, hw)
    spec, hw, wl = plan_layout.planner_inputs(cfg, model_cfg, hw)
    total = CostModel(spec, hw, wl).estimate(L, exact=True).memory.total
    return {"step_time": p["step_time"], "best_step_time": p["best_step_time"],
            "memory": total, "measured_kinds": p["memory"]}


def _plan(job: space.Job, hw0) -> dict[str, Any]:
    cap = space.job_cap(job, hw0)
    hw = space.capped(hw0, cap)
    top, default = space.top_layout(job, hw), space.default_layout(job)
    return {"job": job, "cap": cap, "hw": hw, "top": top, "default": default,
            "brute": space.brute_force(job, hw)}


def _family(L) -> tuple:
    """A layout's mesh and schedule: what ``--screen-per-family`` keeps a few of."""
    return L.dp_replicate, L.dp_shard, L.cp, L.tp, L.pp, L.pp_schedule, L.pp_virtual


def _screen(plan: dict[str, Any], steps: int, limit: int | None,
            per_family: int = 0) -> list[dict[str, Any]]:
    """Measure the job's brute-force space (its first ``limit``; with ``per_family``, the
    predicted fastest few of each mesh and schedule)."""
    job, brute = plan["job"], plan["brute"]
    if per_family:
        kept, seen = [], {}
        for L in brute:  # fastest predicted first
            seen[_family(L)] = seen.get(_family(L), 0) + 1
            if seen[_family(L)] <= per_family:
                kept.append(L)
        brute = kept
    chosen = brute if limit is None else brute[:limit]
    got = measure(job, chosen, steps)
    rows = []
    for L, g in zip(chosen, got, strict=True):
        pred = predict(job, L, plan["hw"])
        rows.append({"layout": L.as_dict(), "name": space.name_of(L),
                     "pred_best": pred["best_step_time"], "pred_kinds": pred["measured_kinds"],
                     **g})
    print(f"screen {job.name}: {len(rows)} of {len(brute)} layouts measured", flush=True)
    return rows


def _finalists(plan: dict[str, Any], screen: list[dict[str, Any]], k: int) -> list:
    """Top, default, then the ``k`` fastest screened layouts (by their fastest step)."""
    ok = sorted((r for r in screen if "error" not in r), key=lambda r: r["best_step_time"])
    out = [plan["top"], plan["default"]]
    for r in ok:
        L = space.layout_from(r["layout"])
        if len(out) >= k + 2:
            break
        if L not in out:
            out.append(L)
    return out


def _round(plan: dict[str, Any], layouts: list, args, rnd: int) -> None:
    """One round of one job: every layout back to back, the first slot moving by round."""
    job = plan["job"]
    turn = rnd % len(layouts)
    order = layouts[turn:] + layouts[:turn]
    got = measure(job, order, args.steps or STEPS[job.model])
    for L, g in zip(order, got, strict=True):
        plan["rounds"].setdefault(space.name_of(L), []).append(g)
    print(f"round {rnd + 1}: {job.name}: " + "; ".join(
        f"{space.name_of(L)} {g.get('best_step_time', float('nan')):.3f}"
        for L, g in zip(order, got, strict=True)), flush=True)


def _old_screens(path: str | None) -> dict[str, list]:
    """The screens of an earlier run: its planner_choice.json or planner_choice_screen.json."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    return {r["job"]: r["screen"] for r in data["jobs"]} if "jobs" in data else data




def _record(plan: dict[str, Any], finals: list, screen) -> dict[str, Any]:
    job, hw = plan["job"], plan["hw"]
    return {"job": job.name, "model": job.model, "ranks": job.ranks, "capped": job.capped,
            "cap_bytes": plan["cap"], "top": space.name_of(plan["top"]),
            "default": space.name_of(plan["default"]), "brute_force_size": len(plan["brute"]),
            "screen": screen,
            "layouts": [_layout_record(job, L, hw, plan["rounds"]) for L in finals]}


def _layout_record(job: space.Job, L, hw, rounds: dict[str, list]) -> dict[str, Any]:
    pred = predict(job, L, hw)
    return {"name": space.name_of(L), "layout": L.as_dict(), "pred": pred,
            "fits": pred["memory"] <= hw.hbm_bytes, "rounds": rounds[space.name_of(L)]}


def main(argv: list[str] | None = None) -> None:
    """Calibrate, screen every job's brute-force space, run the rounds, write the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per layout in a round (default: 4 debug, 2 small)")
    p.add_argument("--screen-steps", type=int, default=None,
                   help="timed steps per screened layout (default: 2 debug, 1 small)")
    p.add_argument("--screen-max", type=int, default=None,
                   help="screen only the first N layouts of each space (predicted fastest "
                        "first; default: all, the brute force)")
    p.add_argument("--screen-per-family", type=int, default=0,
                   help="screen only the N predicted fastest layouts of each mesh and "
                        "schedule (jobs of --family-ranks ranks or more; default 0: all)")
    p.add_argument("--family-ranks", type=int, default=4,
                   help="the rank count from which --screen-per-family applies")
    p.add_argument("--screen-from", help="reuse the screen of an earlier planner_choice.json "
                   "(same calibration file needed: --calibration)")
    p.add_argument("--finalists", type=int, default=2,
                   help="fastest screened layouts measured in the rounds")
    p.add_argument("--calibration", help="an existing calibration file, or where to write one")
    p.add_argument("--only", default="", help="the job of this name, or the jobs whose "
                   "name contains this")
    p.add_argument("--out", default=str(OUT), help="where the .md and .json go")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the markdown from --out's planner_choice.json, measure nothing")
    args = p.parse_args(argv)
    if args.report_only:
        print(write(json.loads((Path(args.out) / "planner_choice.json").read_text()),
                    Path(args.out)))
        return
    from shardwise.planner.hardware import get_hardware

    start = time.perf_counter()
    path, secs = _calibrate(args.calibration)
    hw0 = get_hardware("local", calibration=path)
    jobs = ([j for j in space.JOBS if j.name == args.only]  # a whole name: that job alone
            or [j for j in space.JOBS if args.only in j.name])
    if not jobs:
        raise ValueError(f"--only={args.only!r} matches no job of {[j.name for j in space.JOBS]}")
    meta = {"rounds": args.rounds, "steps": args.steps, "steps_per_model": STEPS,
            "screen_steps": args.screen_steps, "screen_steps_per_model": SCREEN_STEPS,
            "screen_from": args.screen_from, "screen_max": args.screen_max,
            "screen_per_family": args.screen_per_family, "family_ranks": args.family_ranks,
            "finalists": args.finalists, "cap_share": space.CAP_SHARE,
            "calibration_s": secs, "calibration": Path(path).read_text(),
            "command": "python bench/planner_choice.py " + " ".join(sys.argv[1:] if argv is None
                                                                    else argv)}
    old, screens, done = _old_screens(args.screen_from), {}, []
    for job in jobs:  # a job's screen, then its rounds: each job complete as it ends
        plan = {**_plan(job, hw0), "rounds": {}}
        screens[job.name] = old.get(job.name) or _screen(
            plan, args.screen_steps or SCREEN_STEPS[job.model], args.screen_max,
            args.screen_per_family if job.ranks >= args.family_ranks else 0)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "planner_choice_screen.json").write_text(json.dumps(screens))
        finals = _finalists(plan, screens[job.name], args.finalists)
        for rnd in range(args.rounds):
            _round(plan, finals, args, rnd)
        done.append(_record(plan, finals, screens[job.name]))
        meta["duration_s"] = time.perf_counter() - start
        text = write({"meta": meta, "jobs": done}, Path(args.out))
    print(text)

if __name__ == "__main__":
    main()
