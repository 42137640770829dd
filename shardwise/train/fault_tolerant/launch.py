"""``shardwise train --parallel.fault_tolerant true``: one command starts the quorum server
and every replica group, restarts a group that fails, and reports what committed.

    shardwise train --parallel.fault_tolerant true --parallel.dp_replicate 4 --nproc 4
    shardwise train --parallel.fault_tolerant true --parallel.dp_replicate 2 --nproc 4 \\
        --faults "kill:group=1:step=30;stop:group=0:step=60:seconds=6"

Each group is launched by PyTorch's own elastic agent (``elastic_launch``, what torchrun runs)
with its own rendezvous and ``max_restarts``: one lost rank takes its whole group down and the
agent starts the group again (the group is the unit of failure), while the other groups'
processes run on untouched. The quorum server is torchft's lighthouse. Each group's agent
leads its own process group, so a ``stop`` fault freezes the group as a whole, as a hung
node would.

After the run, the groups' journals (``<log.dir>/ft/group<g>.jsonl``) are checked: every
committed step has one set of participants in every group that committed it, the steps run
1..N with none missing, and every group ends with the same state (a sha256 per rank). The
membership, ``<log.dir>/ft/membership.json``, replays the run's arithmetic without faults
(``SHARDWISE_FT_REPLAY``, used by bench/elastic_soak.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from shardwise.train.config import Config
from shardwise.train.faults import ENV_VAR, LOG_ENV, parse_faults

__all__ = ["run_fault_tolerant", "read_journals", "summarize"]


def _group_agent(cfg: Config, data: Any, group: int, size: int, lighthouse: str,
                 result_path: str) -> None:
    """The process that launches (and restarts) one group's ranks, leading their process
    group."""
    os.setpgrp()
    os.environ.setdefault("RUST_LOG", "error")  # torchft's quorum client narrates each quorum
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.train.fault_tolerant.replica import run_replica

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=size,
                          run_id=f"shardwise-ft{group}-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          max_restarts=cfg.parallel.ft_max_restarts, monitor_interval=0.05,
                          start_method="spawn")
    out = elastic_launch(config, run_replica)(cfg, data, group, lighthouse)
    Path(result_path).write_text(json.dumps(out[0]))


def _lighthouse(cfg: Config):
    from torchft._torchft import LighthouseServer

    hb = cfg.parallel.ft_heartbeat_ms
    return LighthouseServer(bind="[::]:0", min_replicas=cfg.parallel.ft_min_groups,
                            join_timeout_ms=hb, quorum_tick_ms=20, heartbeat_timeout_ms=hb)


def run_fault_tolerant(cfg: Config, data: Any) -> dict[str, Any]:
    """Train ``cfg`` as ``parallel.dp_replicate`` fault-tolerant replica groups of
    ``parallel.nproc / dp_replicate`` local ranks each (checks already done by preflight).

    Returns:
        The summary (also ``<log.dir>/ft/summary.json``).

    Raises:
        RuntimeError: every group failed, or the groups disagree at the end (named).
    """
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError("parallel.fault_tolerant=true needs torchft (its quorum server and "
                         "process groups): pip install 'shardwise[ft]'") from None
    par = cfg.parallel
    if par.nproc % par.dp_replicate:
        raise ValueError(f"parallel.fault_tolerant: parallel.nproc={par.nproc} local ranks do "
                         f"not split into parallel.dp_replicate={par.dp_replicate} equal "
                         f"groups")
    groups, size = par.dp_replicate, par.nproc // par.dp_replicate
    ft_dir = Path(cfg.log.dir) / "ft"
    ft_dir.mkdir(parents=True, exist_ok=True)
    for old in ft_dir.glob("*"):
        old.unlink()
    fault_log = ft_dir / "faults.jsonl"
    os.environ[LOG_ENV] = str(fault_log)
    if os.environ.get(ENV_VAR):
        parse_faults(os.environ[ENV_VAR])  # a typo fails here, before any rank starts
    server = None
    os.environ.setdefault("RUST_LOG", "error")
    lighthouse = par.ft_lighthouse
    if not lighthouse:
        server = _lighthouse(cfg)
        lighthouse = server.address()
    print(f"fault tolerance: {groups} replica groups of {size} rank{'s' * (size > 1)}, quorum "
          f"server {lighthouse}; a step commits with at least {par.ft_min_groups} group(s)",
          flush=True)
    ctx = multiprocessing.get_context("spawn")
    agents = {}
    start = time.time()
    try:
        for g in range(groups):
            p = ctx.Process(target=_group_agent, name=f"ft-group{g}",
                            args=(cfg, data, g, size, lighthouse, str(ft_dir / f"result{g}.json")))
            p.start()
            agents[g] = p
        _supervise(agents, grace_s=par.ft_timeout_s + 10.0)
    finally:
        for p in agents.values():
            if p.is_alive():
                _kill_group(p)
        if server is not None:
            server.shutdown()
    summary = summarize(ft_dir, cfg.train.steps, time.time() - start)
    (ft_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (ft_dir / "membership.json").write_text(json.dumps(summary.pop("membership")) + "\n")
    _print_summary(summary)
    if summary["problems"]:
        raise RuntimeError("fault tolerance: " + "; ".join(summary["problems"]))
    return summary


def _kill_group(p) -> None:
    """SIGKILL a group's agent and every rank it leads (also a frozen one)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.join(timeout=10)


def _supervise(agents: dict[int, Any], grace_s: float) -> None:
    """Wait for the groups; once one has finished, the others get ``grace_s`` to finish the
    same last step (a group frozen for good, or restarting after the end, is stopped)."""
    finished_at = None
    while any(p.is_alive() for p in agents.values()):
        time.sleep(0.1)
        if finished_at is None and any(p.exitcode == 0 for p in agents.values()):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            for g, p in agents.items():
                if p.is_alive():
                    print(f"fault tolerance: group {g} did not finish within {grace_s:.0f} s "
                          f"of the others: stopped", flush=True)
                    _kill_group(p)


def read_journals(ft_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every group's journal lines (a line cut short by a kill is dropped)."""
    out = {}
    for path in sorted(ft_dir.glob("group*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                pass
        out[int(path.stem.removeprefix("group"))] = lines
    return out


def _faults(ft_dir: Path) -> list[dict[str, Any]]:
    path = ft_dir / "faults.jsonl"
    if not path.exists():
        return []
    return [json.loads(t) for t in path.read_text().splitlines() if t.strip()]


def summarize(ft_dir: Path, steps: int, elapsed_s: float) -> dict[str, Any]:
    """What the run committed, its membership, faults and recoveries, and what disagrees.

    Recovery of a fault: from the fault to the next step committed by any other group.
    """
    journals = read_journals(ft_dir)
    results = {}
    for path in sorted(ft_dir.glob("result*.json")):
        results[int(path.stem.removeprefix("result"))] = json.loads(path.read_text())
    problems = []
    by_lineage: dict[int, dict[str, Any]] = {}  # lineage after a commit -> its record
    commits: list[tuple[float, int, int]] = []  # (time, group, step)
    for g, lines in journals.items():
        for r in lines:
            if r.get("event") == "step" and r["committed"]:
                commits.append((r["time"], g, r["step"]))
                by_lineage.setdefault(r["lineage"], r)
    # The history that survived: from the final lineage back to step 1 ([Note: lineages] in
    # combine.py); steps committed on a lineage that was healed over are not in it.
    membership: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    tokens: dict[int, int] = {}
    finals = {r.get("lineage") for r in results.values()}
    if len(finals) > 1:
        problems.append(f"the groups end on {len(finals)} different histories")
    lineage = next(iter(finals)) if len(finals) == 1 else None
    visited = set()
    while lineage is not None and lineage in by_lineage:
        visited.add(lineage)
        r = by_lineage[lineage]
        if r["step"] in membership:
            problems.append(f"step {r['step']} appears twice in the surviving history")
            break
        membership[r["step"]], losses[r["step"]] = r["participants"], r["loss"]
        tokens[r["step"]] = r["tokens"]
        lineage = r["lineage_before"] if r["step"] > 1 else None
    missing = [s for s in range(1, steps + 1) if s not in membership]
    if missing:
        problems.append(f"steps never committed: {missing[:10]}{' ...' * (len(missing) > 10)}")
    digests = {g: tuple(r["digests"]) for g, r in results.items()}
    if len(set(digests.values())) > 1:
        problems.append(f"the groups' final states differ: {sorted(digests)} hold "
                        f"{len(set(digests.values()))} different states")
    if not results:
        problems.append("no group finished")
    faults = _faults(ft_dir)
    commits.sort()
    recoveries = []
    for f in faults:
        group = None if f["group"] is None else int(f["group"])
        after = [t for t, g, _ in commits if t > f["time"] and g != group]
        if after:
            recoveries.append(after[0] - f["time"])
    restarts = {g: sum(1 for r in lines if r.get("event") == "start") - 1
                for g, lines in journals.items()}
    healed = {g: sum(1 for r in lines if r.get("event") == "healed")
              for g, lines in journals.items()}
    committed_tokens = sum(tokens.values())
    discarded = len(by_lineage) - len(visited)
    return {
        "steps": len(membership), "final_train_loss": losses.get(steps),
        "groups_finished": sorted(results), "digests_equal": len(set(digests.values())) == 1,
        "faults": len(faults), "fault_actions": sorted({f["action"] for f in faults}),
        "restarts": restarts, "healed": healed,
        "recovery_s": {"median": statistics.median(recoveries) if recoveries else None,
                       "max": max(recoveries) if recoveries else None,
                       "all": [round(x, 3) for x in recoveries]},
        "discarded_steps": discarded,
        "steps_with_fewer_groups": sum(1 for ids in membership.values()
                                       if len(ids) < len(journals)),
        "committed_tokens": committed_tokens, "elapsed_s": round(elapsed_s, 2),
        "problems": problems,
        "membership": {str(s): membership[s] for s in sorted(membership)},
    }


def _print_summary(summary: dict[str, Any]) -> None:
    rec = summary["recovery_s"]
    rec_text = ("" if rec["median"] is None else
                f"; recovery median {rec['median']:.2f} s, max {rec['max']:.2f} s")
    dropped = (f" ({summary['discarded_steps']} committed apart and healed over)"
               if summary["discarded_steps"] else "")
    print(f"fault tolerance: {summary['steps']} steps committed{dropped}, {summary['faults']} "
          f"faults "
          f"({', '.join(summary['fault_actions']) or 'none'}), restarts "
          f"{summary['restarts']}, healed {summary['healed']}{rec_text}; final states "
          f"{'equal' if summary['digests_equal'] else 'DIFFER'} in groups "
          f"{summary['groups_finished']}; loss {summary['final_train_loss']}", flush=True)
