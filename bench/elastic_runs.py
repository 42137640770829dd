"""Helpers of bench/elastic_soak.py: run ``shardwise train`` as a subprocess with its wall and
CPU time (and the machine's other CPU use meanwhile), generate fault schedules, and check a
fault-tolerant run's outputs (``<log.dir>/ft/``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardwise.train.fault_tolerant.summary import read_faults, read_journals

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("start", "forward", "backward", "reduction", "optimizer")
_CLI = "import sys; from shardwise.train.cli import main; sys.exit(main())"


def _machine_busy_s() -> float:
    """CPU-seconds every core of the machine spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_train(args: list[str], log: Path, env: dict[str, str] | None = None,
              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run ``shardwise train ARGS`` to completion.

    Args:
        args: the arguments after ``train``.
        log: where its stdout + stderr go.
        env: extra environment variables.
        timeout_s: the run is killed (rc -9) after this long.

    Returns:
        ``{"rc", "wall_s", "cpu_s" (this run's processes), "other_cpu_s" (the rest of the
        machine meanwhile), "load1"}``.
    """
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("SHARDWISE_FAULT", None)
    cpu0, busy0, t0 = _children_cpu_s(), _machine_busy_s(), time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run([sys.executable, "-c", _CLI, "train", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                                timeout=timeout_s, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    wall = time.perf_counter() - t0
    cpu = _children_cpu_s() - cpu0
    other = max(0.0, _machine_busy_s() - busy0 - cpu)
    return {"rc": rc, "wall_s": round(wall, 2), "cpu_s": round(cpu, 1),
            "other_cpu_s": round(other, 1), "load1": round(os.getloadavg()[0], 2)}


def ft_args(groups: int, nproc: int, steps: int, log_dir: Path, timeout_s: float,
            heartbeat_ms: int | None = None, extra: list[str] | None = None) -> list[str]:
    """The ``shardwise train`` arguments of a fault-tolerant run of the debug model."""
    args = ["--parallel.fault_tolerant", "true", "--parallel.dp_replicate", str(groups),
            "--nproc", str(nproc), "--train.steps", str(steps), "--log.dir", str(log_dir),
            "--log.overwrite", "true", "--log.progress", "false",
            "--parallel.ft_timeout_s", str(timeout_s)]
    if heartbeat_ms is not None:
        args += ["--parallel.ft_heartbeat_ms", str(heartbeat_ms)]
    return args + (extra or [])


def soak_schedule(groups: int, size: int, steps: int, kills: int, stops: int,
                  stop_s: float, rejoins: int = 0, rejoin_after: int = 8) -> list[str]:
    """Alternating kills and stops, evenly spaced over steps 8 .. steps - 10.

    Kills hit groups 1 .. groups-1 (group 0 is never killed: its PID must survive the run),
    in turn, on rank ``i % size`` inside the group; stops hit every group, chosen away from
    the group killed just before (so that group has time to rejoin). With 2 groups the stops
    hit group 1 too: a stop of group 0 while group 1 restarts leaves no group with the run's
    state alive, and the restarted group would train alone from step 1 (a second history that
    the checks report). Phases cycle through start/forward/backward/reduction/optimizer.
    A kill names the attempt it fires in (the group's restart count: its k-th kill fires in
    attempt k), so a group restarted into the same step is not killed again (with
    ``attempt=any`` it was, when it rejoined before the others had committed that step);
    stops fire in any attempt. ``rejoins`` of the kills (spread evenly over them) say
    ``rejoin=<step + rejoin_after>``: the restarted group holds until another group has
    committed that step, as a node replaced later would.

    Returns:
        One fault spec per fault (join with ``;``).
    """
    if groups < 2:
        raise ValueError(f"groups={groups}: a soak needs at least 2 replica groups")
    n = kills + stops
    span = steps - 18
    spacing = span / n
    out, k_i, s_i = [], 0, 0
    kills_of = [0] * groups
    for i in range(n):
        step = 8 + int(i * spacing)
        kill = (i % 2 == 0 and k_i < kills) or s_i >= stops
        phase = PHASES[(i // 2 + (0 if kill else 2)) % len(PHASES)]
        if kill:
            g = 1 + k_i % (groups - 1)
            held = rejoins and k_i * rejoins // kills != (k_i + 1) * rejoins // kills
            out.append(f"kill:group={g}:rank={(k_i // (groups - 1)) % size}:step={step}"
                       f":phase={phase}:attempt={kills_of[g]}"
                       + (f":rejoin={step + rejoin_after}" if held else ""))
            kills_of[g] += 1
            k_i += 1
        else:
            g = 1 if groups == 2 else (s_i + 3) % groups
            out.append(f"stop:group={g}:step={step}:seconds={stop_s:g}:phase={phase}"
                       f":attempt=any")
            s_i += 1
    return out


def kill_schedule(groups: int, steps: int, every: int, first: int) -> list[tuple[int, int]]:
    """(step, group) of one kill per ``every`` steps from ``first``, groups 1.. in turn."""
    return [(s, 1 + i % max(1, groups - 1)) for i, s in enumerate(range(first, steps, every))]


def read_ft(log_dir: Path) -> dict[str, Any]:
    """The summary, faults, journals and results of a fault-tolerant run."""
    ft = log_dir / "ft"
    summary = json.loads((ft / "summary.json").read_text()) if (ft / "summary.json").exists() \
        else {}
    faults, journals = read_faults(ft), read_journals(ft)
    results = {int(p.stem.removeprefix("result")): json.loads(p.read_text())
               for p in sorted(ft.glob("result*.json"))}
    return {"summary": summary, "faults": faults, "journals": journals, "results": results}


def check_soak(run: dict[str, Any], steps: int, min_each: int, rejoins: int = 0
               ) -> dict[str, Any]:
    """The soak's checks on a fault run's outputs (each a bool, with the numbers);
    ``rejoins``: how many kills the schedule held back (rejoin=N)."""
    s, faults = run["summary"], run["faults"]
    fired = {a: sum(1 for f in faults if f["action"] == a) for a in ("kill", "stop")}
    cues = rejoin_cues(run)
    fired["rejoin"] = len(cues)
    unique = len({f["fault"] for f in faults})
    killed = {int(f["group"]) for f in faults if f["action"] == "kill"}
    survivors = {}
    for g, lines in run["journals"].items():
        if g not in killed:
            pids = {r["pid"] for r in lines if r.get("event") == "start"}
            survivors[g] = sorted(pids)
    digests = {tuple(r["digests"]) for r in run["results"].values()}
    checks = {
        "kills_fired>=%d" % min_each: fired["kill"] >= min_each,
        "stops_fired>=%d" % min_each: fired["stop"] >= min_each,
        "no_fault_fired_twice": unique == len(faults),
        "all_steps_committed_once": s.get("steps") == steps and not s.get("problems"),
        "digests_equal": len(digests) == 1 and len(run["results"]) == len(run["journals"]),
        "survivors_keep_pid": bool(survivors) and all(len(p) == 1 for p in survivors.values()),
        "rejoined_on_cue": all(ok for _, ok in cues),
    }
    if rejoins:
        checks["rejoins_fired>=%d" % min(min_each, rejoins)] = \
            fired["rejoin"] >= min(min_each, rejoins)
    return {"checks": checks, "fired": fired, "survivor_pids": survivors,
            "problems": s.get("problems")}


def phases_fired(faults: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{action: {phase: count}} of the fired faults."""
    out: dict[str, dict[str, int]] = {}
    for f in faults:
        by = out.setdefault(f["action"], {})
        by[f["phase"]] = by.get(f["phase"], 0) + 1
    return out


def groups_fired(faults: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{action: {group: count}} of the fired faults."""
    out: dict[str, dict[str, int]] = {}
    for f in faults:
        by = out.setdefault(f["action"], {})
        by[str(f["group"])] = by.get(str(f["group"]), 0) + 1
    return out


def rejoin_cues(run: dict[str, Any]) -> list[tuple[int, bool]]:
    """Per kill that said ``rejoin=N``: (N, whether its group's restart began training only
    after another group had committed step N)."""
    out = []
    for f in run["faults"]:
        target = f.get("rejoin")
        if f["action"] != "kill" or target in (None, "never"):
            continue
        g = int(f["group"])
        starts = [r["time"] for r in run["journals"].get(g, [])
                  if r.get("event") == "start" and r["time"] > f["time"]]
        committed = [r["time"] for h, lines in run["journals"].items() if h != g
                     for r in lines if r.get("event") == "step" and r["committed"]
                     and r["step"] == int(target)]
        out.append((int(target), bool(starts and committed) and starts[0] > min(committed)))
    return out


def rejoin_s(run: dict[str, Any]) -> list[float]:
    """Per kill: seconds from the kill to the restarted group's next committed step."""
    out = []
    for f in run["faults"]:
        if f["action"] != "kill":
            continue
        lines = run["journals"].get(int(f["group"]), [])
        after = [r["time"] for r in lines if r.get("event") == "step" and r["committed"]
                 and r["time"] > f["time"]]
        if after:
            out.append(round(after[0] - f["time"], 2))
    return out
