"""Elastic soak: fault-tolerant training across replica groups under many kills and stops,
checked bitwise against a fault-free replay, and its goodput beside checkpoint-restart.

    python bench/elastic_soak.py                       # both soaks (500 steps) + 1 goodput round
    python bench/elastic_soak.py --steps 200 --rounds 2 --configs 4x1
    python bench/elastic_soak.py --quick               # 3 groups x 1 rank, 30 steps (CI smoke)

Soak, per configuration (``4x1``: 4 replica groups of 1 rank, ``2x2``: 2 groups of 2 ranks,
ZeRO inside each group; the debug model): a generated schedule of ``--kills`` SIGKILLs (the
group's elastic agent restarts it, it rejoins and heals from a live peer) and ``--stops``
SIGSTOPs of a whole group for ``--stop-s`` seconds (it resumes and heals), spread over the
phases start/forward/backward/reduction/optimizer and over the groups (group 0 is never
killed). Checks, from ``<log.dir>/ft``: at least ``--min-fired`` faults of each kind fired,
none twice; every step 1..N committed once with one participant set; the groups' final
digests equal; group 0 kept its one PID; and a replay (``SHARDWISE_FT_REPLAY`` = the run's
membership, no faults, ``ft_min_groups`` = all) ends with bitwise the same digests.

Goodput, per round (``4x1``, ``--goodput-steps``, one kill per ``--kill-every`` steps): a
fault-free fault-tolerant run gives tokens/s; the fault run's goodput is its committed tokens
over what that rate commits in the fault run's wall time. Beside it the checkpoint-restart path
(no fault tolerance, ``--checkpoint.interval``), killed at the same steps and relaunched by
this script with ``--checkpoint.resume auto`` until done: useful tokens over its own fault-free
rate (same checkpoint interval) times the total wall time of all launches.

Every run records its wall time, its own CPU time and the CPU time the rest of the machine
used meanwhile (/proc/stat): the bench shares a 2-core machine. Results:
``bench/results/elastic_soak.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import elastic_runs as er  # noqa: E402

CONFIGS = {"4x1": (4, 4), "2x2": (2, 4), "3x1": (3, 3)}


def soak(name: str, opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One configuration's soak: the fault run, its checks, the replay and its comparison."""
    groups, nproc = CONFIGS[name]
    size = nproc // groups
    if opts.quick:
        spec = ["kill:group=1:step=5:phase=backward:attempt=0:rejoin=12",
                f"stop:group=2:step=15:seconds={opts.stop_s:g}:phase=reduction:attempt=any"]
    else:
        spec = er.soak_schedule(groups, size, opts.steps, opts.kills, opts.stops, opts.stop_s,
                                opts.rejoins)
    fault_dir, replay_dir = work / f"{name}_faults", work / f"{name}_replay"
    print(f"[{name}] fault run: {opts.steps} steps, {len(spec)} faults", flush=True)
    args = er.ft_args(groups, nproc, opts.steps, fault_dir, opts.timeout_s,
                      extra=["--faults", ";".join(spec)])
    fault = er.run_train(args, work / f"{name}_faults.log")
    run = er.read_ft(fault_dir)
    checked = er.check_soak(run, opts.steps, opts.min_fired,
                            sum(1 for f in spec if ":rejoin=" in f))
    membership = work / f"{name}_membership.json"
    shutil.copy(fault_dir / "ft" / "membership.json", membership)
    print(f"[{name}] replay", flush=True)
    args = er.ft_args(groups, nproc, opts.steps, replay_dir, opts.timeout_s,
                      extra=["--parallel.ft_min_groups", str(groups)])
    replay = er.run_train(args, work / f"{name}_replay.log",
                          env={"SHARDWISE_FT_REPLAY": str(membership)})
    ref = er.read_ft(replay_dir)
    mine = {tuple(r["digests"]) for r in run["results"].values()}
    theirs = {tuple(r["digests"]) for r in ref["results"].values()}
    checked["checks"]["replay_bitwise_equal"] = len(mine) == 1 and mine == theirs
    checked["checks"]["runs_exit_0"] = fault["rc"] == 0 and replay["rc"] == 0
    s = run["summary"]
    out = {"config": name, "groups": groups, "ranks_per_group": size, "steps": opts.steps,
           "schedule": spec, **checked, "phases": er.phases_fired(run["faults"]),
           "groups_hit": er.groups_fired(run["faults"]),
           "restarts": s.get("restarts"), "healed": s.get("healed"),
           "recovery_s": s.get("recovery_s"), "rejoin_s": er.rejoin_s(run),
           "steps_with_fewer_groups": s.get("steps_with_fewer_groups"),
           "discarded_steps": s.get("discarded_steps"),
           "committed_tokens": s.get("committed_tokens"), "fault_run": fault,
           "replay_run": replay, "replay_steps": ref["summary"].get("steps"),
           "passed": all(checked["checks"].values())}
    rec = out["recovery_s"] or {}
    print(f"[{name}] checks {out['checks']} recovery median {rec.get('median')} max "
          f"{rec.get('max')}", flush=True)
    return out


def _ckpt_restart(opts: argparse.Namespace, work: Path, kills: list[int],
                  tag: str) -> dict[str, Any]:
    """The checkpoint-restart path: launch, killed at the next kill step, relaunch with
    ``resume auto`` until a launch finishes."""
    log_dir, fault_log = work / f"ckpt_{tag}", work / f"ckpt_{tag}_faults.jsonl"
    fault_log.unlink(missing_ok=True)
    base = ["--nproc", "4", "--parallel.dp_replicate", "4", "--train.steps",
            str(opts.goodput_steps), "--log.dir", str(log_dir), "--log.progress", "false",
            "--checkpoint.interval", str(opts.ckpt_interval), *opts.goodput_args.split()]
    launches: list[dict[str, Any]] = []
    for attempt in range(len(kills) + 3):
        fired = {json.loads(t)["step"] for t in fault_log.read_text().splitlines()} \
            if fault_log.exists() else set()
        pending = [s for s in kills if s not in fired]
        args = base + (["--log.overwrite", "true"] if attempt == 0 else
                       ["--checkpoint.resume", "auto"])
        if pending:
            args += ["--faults", f"kill:rank=1:step={pending[0]}:phase=backward"]
        r = er.run_train(args, work / f"ckpt_{tag}_{attempt}.log",
                         env={"SHARDWISE_FAULT_LOG": str(fault_log)})
        launches.append(r)
        if r["rc"] == 0:
            break
    summary = json.loads((log_dir / "summary.json").read_text()) \
        if (log_dir / "summary.json").exists() else {}
    return {"launches": launches, "finished": launches[-1]["rc"] == 0,
            "wall_s": round(sum(r["wall_s"] for r in launches), 2),
            "cpu_s": round(sum(r["cpu_s"] for r in launches), 1),
            "other_cpu_s": round(sum(r["other_cpu_s"] for r in launches), 1),
            "resumed_from": summary.get("checkpoint", {}).get("resumed_from_step")}


def goodput_round(opts: argparse.Namespace, work: Path, r: int) -> dict[str, Any]:
    """One goodput round (config 4x1): fault-tolerant beside checkpoint-restart.

    [Note: a fault-free run on each side] Goodput divides the fault run's committed tokens by
    what a fault-free run would commit in its time, and runs of the same command on this
    machine differ by up to 15% in their steady pace (the fault run's steps before its first
    fault were 10-15% slower than the fault-free run's just before it, twice in a row, with
    nothing else running). With ``--sandwich`` a second fault-free run follows the fault run;
    the rate is the two runs' mean, and each one's goodput is kept beside it.
    """
    groups, nproc, n = 4, 4, opts.goodput_steps
    plan = er.kill_schedule(groups, n, opts.kill_every, opts.kill_every - 20)
    spec = ";".join(f"kill:group={g}:step={s}:phase={er.PHASES[i % 5]}"
                    f":attempt={sum(1 for _, h in plan[:i] if h == g)}"  # see soak_schedule
                    for i, (s, g) in enumerate(plan))
    rows: dict[str, Any] = {"kill_steps": [s for s, _ in plan], "tag": opts.tag,
                            "train_args": opts.goodput_args}
    variants = [("ft", opts.timeout_s, None)]
    if opts.fast_detect:
        variants.append(("ft_fast", 2.0, 500))
    for tag, timeout, hb in variants:
        print(f"[goodput {r}] {tag}: fault-free, then {len(plan)} kills", flush=True)
        f_dir = work / f"g{r}_{tag}_faults"
        extra = opts.goodput_args.split()

        def fault_free(when: str, tag: str = tag, timeout: float = timeout,
                       hb: int | None = hb, extra: list[str] = extra
                       ) -> tuple[dict[str, Any], float]:
            ff_dir = work / f"g{r}_{tag}_ff{when}"
            ff = er.run_train(er.ft_args(groups, nproc, n, ff_dir, timeout, hb, extra),
                              work / f"g{r}_{tag}_ff{when}.log")
            return ff, er.read_ft(ff_dir)["summary"].get("committed_tokens", 0) / ff["wall_s"]

        ff, rate = fault_free("")
        fr = er.run_train(er.ft_args(groups, nproc, n, f_dir, timeout, hb,
                                     [*extra, "--faults", spec]),
                          work / f"g{r}_{tag}_faults.log")
        fs = er.read_ft(f_dir)
        committed = fs["summary"].get("committed_tokens", 0)
        rows[tag] = {"timeout_s": timeout, "heartbeat_ms": hb or 1000, "fault_free": ff,
                     "fault_free_tokens_per_s": round(rate, 1), "fault_run": fr,
                     "kills_fired": sum(1 for f in fs["faults"] if f["action"] == "kill"),
                     "committed_tokens": committed, "steps": fs["summary"].get("steps"),
                     "recovery_s": fs["summary"].get("recovery_s"),
                     "goodput": round(committed / (rate * fr["wall_s"]), 3)}
        if opts.sandwich:  # [Note: a fault-free run on each side]
            after, rate_after = fault_free("_after")
            each = [committed / (x * fr["wall_s"]) for x in (rate, rate_after)]
            rows[tag].update(fault_free_after=after,
                             fault_free_tokens_per_s_after=round(rate_after, 1),
                             goodput=round(2 * committed / ((rate + rate_after) * fr["wall_s"]),
                                           3),
                             goodput_each=[round(g, 3) for g in each])
    if opts.no_ckpt:
        return rows
    print(f"[goodput {r}] checkpoint-restart: fault-free, then kills", flush=True)

    def ckpt_fault_free(when: str) -> tuple[dict[str, Any], float, float]:
        ff_dir = work / f"g{r}_ckpt_ff{when}"
        ff = er.run_train(["--nproc", "4", "--parallel.dp_replicate", "4", "--train.steps",
                           str(n), "--log.dir", str(ff_dir), "--log.overwrite", "true",
                           "--log.progress", "false", "--checkpoint.interval",
                           str(opts.ckpt_interval), *opts.goodput_args.split()],
                          work / f"g{r}_ckpt_ff{when}.log")
        ff_sum = json.loads((ff_dir / "summary.json").read_text())
        return ff, ff_sum["tokens"] / ff_sum["steps"], ff_sum["tokens"] / ff["wall_s"]

    ff, per_step, rate = ckpt_fault_free("")
    cr = _ckpt_restart(opts, work, [s for s, _ in plan], f"r{r}")
    useful = per_step * n if cr["finished"] else 0
    rows["ckpt"] = {"interval": opts.ckpt_interval, "fault_free": ff,
                    "fault_free_tokens_per_s": round(rate, 1), **cr,
                    "useful_tokens": useful, "goodput": round(useful / (rate * cr["wall_s"]), 3)}
    if opts.sandwich:
        after, _, rate_after = ckpt_fault_free("_after")
        rows["ckpt"].update(
            fault_free_after=after, fault_free_tokens_per_s_after=round(rate_after, 1),
            goodput=round(2 * useful / ((rate + rate_after) * cr["wall_s"]), 3),
            goodput_each=[round(useful / (x * cr["wall_s"]), 3) for x in (rate, rate_after)])
    print(f"[goodput {r}] " + ", ".join(f"{k} {v['goodput']}" for k, v in rows.items()
                                        if isinstance(v, dict)), flush=True)
    return rows


def _cpu_note(runs: list[dict[str, Any]]) -> str:
    wall = sum(r["wall_s"] for r in runs)
    other = sum(r["other_cpu_s"] for r in runs)
    mine = sum(r["cpu_s"] for r in runs)
    return (f"{len(runs)} runs, {wall:.0f} s wall: their CPU {mine:.0f} s, the rest of the "
            f"machine {other:.0f} s meanwhile (= {other / max(wall, 1e-9):.2f} of a core on "
            f"average{'; runs were under outside load' if other / max(wall, 1e-9) > 0.1 else ''})")


def _rates(row: dict[str, Any]) -> str:
    """The fault-free rate, or the rates before / after the fault run."""
    after = row.get("fault_free_tokens_per_s_after")
    return f"{row['fault_free_tokens_per_s']}" + ("" if after is None else f" / {after}")


def _each(row: dict[str, Any]) -> str:
    each = row.get("goodput_each")
    return "" if not each else f" ({each[0]} / {each[1]})"


def markdown(res: dict[str, Any], notes: Path | None = None) -> str:
    """The results as a markdown report (``notes``: a markdown file appended, if it
    exists)."""
    lines = ["# Elastic soak: fault tolerance across replica groups", "",
             f"`python bench/elastic_soak.py {res['argv']}` ({res['date']}, debug model, CPU, "
             f"Gloo, {res['cpus']} cores; ft_timeout_s {res['timeout_s']}, heartbeat 1000 ms "
             "unless said).", ""]
    if res["soak"]:
        lines += ["## Soak", "", "| config | steps | kills fired | stops fired | restarts | "
                  "recovery median / max (s) | kill -> rejoin median (s) | rejoins on cue | "
                  "steps with fewer "
                  "groups | steps committed apart, healed over | checks | wall (s) | "
                  "CPU / other CPU (s) |", "|---" * 13 + "|"]
        for s in res["soak"]:
            rec, rj = s["recovery_s"] or {}, s["rejoin_s"]
            med = f"{rec['median']:.2f} / {rec['max']:.2f}" if rec.get("median") else "-"
            verdict = "all pass" if s["passed"] else "FAIL: " + ", ".join(
                k for k, v in s["checks"].items() if not v)
            pinned = "" if any(f.startswith("kill") and f.endswith("attempt=any")
                               for f in s["schedule"]) else ", kills attempt-pinned"
            lines.append(
                f"| {s['groups']} groups x {s['ranks_per_group']}{pinned} | {s['steps']} | "
                f"{s['fired']['kill']} | {s['fired']['stop']} | {s['restarts']} | {med} | "
                f"{f'{statistics.median(rj):.2f}' if rj else '-'} | "
                f"{s['fired'].get('rejoin', '-')} | "
                f"{s['steps_with_fewer_groups']} | "
                f"{s.get('discarded_steps')} | {verdict} | "
                f"{s['fault_run']['wall_s']} | {s['fault_run']['cpu_s']} / "
                f"{s['fault_run']['other_cpu_s']} |")
        lines += ["", "Checks per config: " + "; ".join(
            f"{s['config']}: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}"
                                           for k, v in s["checks"].items())
            for s in res["soak"]), "",
            "Faults by phase: " + "; ".join(f"{s['config']}: {s['phases']}" for s in res["soak"]),
            "", "Faults by group: " + "; ".join(f"{s['config']}: {s['groups_hit']}"
                                                for s in res["soak"]),
            "", "Recoveries (s, fault -> next step committed by another group): " + "; ".join(
                f"{s['config']}: {(s['recovery_s'] or {}).get('all')}" for s in res["soak"]),
            ""]
    for i, g in enumerate(res["goodput"]):
        lines += [f"## Goodput, round {i + 1}{' ' + g['tag'] if g.get('tag') else ''} (4 "
                  f"groups x 1 rank, {res['goodput_steps']} steps, kills at steps "
                  f"{g['kill_steps']}{', ' + g['train_args'] if g.get('train_args') else ''})",
                  "",
                  "| path | fault-free tokens/s (before / after) | fault run wall (s) | "
                  "useful tokens | goodput | recovery median / max (s) | CPU / other CPU (s) |",
                  "|---" * 7 + "|"]
        for tag in ("ft", "ft_fast"):
            if tag in g:
                v = g[tag]
                rec = v["recovery_s"] or {}
                med = f"{rec['median']:.2f} / {rec['max']:.2f}" if rec.get("median") else "-"
                lines.append(f"| fault tolerant (timeout {v['timeout_s']} s, heartbeat "
                             f"{v['heartbeat_ms']} ms; {v['kills_fired']} kills) | "
                             f"{_rates(v)} | {v['fault_run']['wall_s']} | "
                             f"{v['committed_tokens']} | **{v['goodput']}**{_each(v)} | {med} | "
                             f"{v['fault_run']['cpu_s']} / {v['fault_run']['other_cpu_s']} |")
        c = g.get("ckpt")
        lines.append("" if c is None else f"| checkpoint-restart (interval {c['interval']}, "
                     f"{len(c['launches'])} launches) | {_rates(c)} | "
                     f"{c['wall_s']} | {c['useful_tokens']:.0f} | **{c['goodput']}**"
                     f"{_each(c)} | - | "
                     f"{c['cpu_s']} / {c['other_cpu_s']} |")
        lines.append("")
    lines += ["## Machine load", "", _cpu_note(res["all_runs"]), ""]
    if notes is not None and notes.exists():  # findings, written after reading the numbers
        lines += [notes.read_text()]
    return "\n".join(lines) + "\n"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--configs", default="4x1,2x2",
                   help="comma list of " + ", ".join(CONFIGS) + " ('': no soak)")
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--stops", type=int, default=12)
    p.add_argument("--rejoins", type=int, default=12,
                   help="kills whose group rejoins only 8 steps later (rejoin=step+8)")
    p.add_argument("--min-fired", type=int, default=10)
    p.add_argument("--stop-s", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=1, help="goodput rounds (0: none)")
    p.add_argument("--goodput-steps", type=int, default=200)
    p.add_argument("--kill-every", type=int, default=50)
    p.add_argument("--ckpt-interval", type=int, default=20)
    p.add_argument("--goodput-args", default="",
                   help="more `shardwise train` arguments for the goodput runs, e.g. "
                        "'--model.name small' for steps of seconds, as on a real cluster")
    p.add_argument("--fast-detect", action="store_true",
                   help="goodput also with ft_heartbeat_ms 500, ft_timeout_s 2")
    p.add_argument("--sandwich", action="store_true",
                   help="a second fault-free run after each fault run; goodput against their "
                        "mean rate ([Note: a fault-free run on each side])")
    p.add_argument("--no-ckpt", action="store_true",
                   help="goodput rounds without the checkpoint-restart path")
    p.add_argument("--tag", default="", help="a label for this invocation's goodput rounds")
    p.add_argument("--quick", action="store_true",
                   help="3 groups x 1 rank, 30 steps, 1 kill + 1 stop, no goodput")
    p.add_argument("--keep", action="store_true",
                   help="keep the soaks and rounds already in --out's json, add these")
    p.add_argument("--work", type=Path, default=Path("/tmp/elastic_soak"))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "elastic_soak")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.steps, opts.configs, opts.min_fired, opts.rounds = 30, "3x1", 1, 0
        opts.keep = False
    opts.configs = [c for c in opts.configs.split(",") if c]
    for c in opts.configs:
        if c not in CONFIGS:
            raise ValueError(f"--configs: unknown configuration {c!r}; expected one of "
                             f"{', '.join(CONFIGS)}")
    return opts


def main(argv: list[str] | None = None) -> int:
    """Run the soak and goodput rounds; write the md + json. Returns 0 when every check
    passed."""
    import os

    opts = _parse(argv)
    opts.work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"argv": " ".join(sys.argv[1:] if argv is None else argv),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "cpus": os.cpu_count(), "timeout_s": opts.timeout_s,
                           "goodput_steps": opts.goodput_steps, "soak": [], "goodput": []}
    if opts.keep and Path(f"{opts.out}.json").exists():  # add to an earlier invocation's
        old = json.loads(Path(f"{opts.out}.json").read_text())
        res["soak"], res["goodput"] = old["soak"], old["goodput"]
        res["argv"] = f"{old['argv']}` then `{res['argv']}"
    for name in opts.configs:
        res["soak"].append(soak(name, opts, opts.work))
        _write(res, opts.out)
    for r in range(opts.rounds):
        res["goodput"].append(goodput_round(opts, opts.work, r + 1))
        _write(res, opts.out)
    ok = all(s["passed"] for s in res["soak"])
    print(f"elastic soak: {'all checks pass' if ok else 'CHECKS FAILED'}; {opts.out}.md",
          flush=True)
    return 0 if ok else 1


def _write(res: dict[str, Any], out: Path) -> None:
    runs = [s[k] for s in res["soak"] for k in ("fault_run", "replay_run")]
    for g in res["goodput"]:
        for tag in ("ft", "ft_fast"):
            if tag in g:
                runs += [g[tag]["fault_free"], g[tag]["fault_run"]]
        if "ckpt" in g:
            runs += [g["ckpt"]["fault_free"], *g["ckpt"]["launches"]]
    res["all_runs"] = runs
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(res, Path(f"{out}_notes.md")))


if __name__ == "__main__":
    sys.exit(main())
