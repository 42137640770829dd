"""What a fault-tolerant run committed, read back from its groups' journals.

    python -m shardwise.train.fault_tolerant runs/ft        # a run folder

The launcher prints this at the end of a local run; on a cluster (one launch per group) run
it on the shared run folder. It writes ``<log.dir>/ft/summary.json``,
``<log.dir>/ft/membership.json`` (``{step: [group ids]}`` of the history that survived,
what ``SHARDWISE_FT_REPLAY`` replays) and ``<log.dir>/metrics.jsonl`` (that history's steps
and the evaluations, as any run writes them).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from shardwise.train.fault_tolerant.combine import next_lineage

__all__ = ["read_journals", "read_faults", "summarize", "print_summary", "main"]


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


def read_faults(ft_dir: Path) -> list[dict[str, Any]]:
    """Every fault fired (``faults.jsonl``), in order; none when the file is absent."""
    path = ft_dir / "faults.jsonl"
    if not path.exists():
        return []
    return [json.loads(t) for t in path.read_text().splitlines() if t.strip()]


def summarize(ft_dir: Path, steps: int, elapsed_s: float | None = None) -> dict[str, Any]:
    """What the run committed, its membership, faults and recoveries, and what disagrees;
    written to ``summary.json`` and ``membership.json`` in ``ft_dir``.

    Recovery of a fault: from the fault to the next step committed by any other group.
    """
    journals = read_journals(ft_dir)
    results = {g: finish[-1] for g, lines in journals.items()
               if (finish := [r for r in lines if r.get("event") == "finish"])}
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
    history: dict[int, dict[str, Any]] = {}
    while lineage is not None and lineage in by_lineage:
        visited.add(lineage)
        r = by_lineage[lineage]
        if r["step"] in membership:
            problems.append(f"step {r['step']} appears twice in the surviving history")
            break
        membership[r["step"]], losses[r["step"]] = r["participants"], r["loss"]
        history[r["step"]] = r
        tokens[r["step"]] = r["tokens"]
        lineage = r["lineage_before"] if r["step"] > 1 else None
        if lineage not in by_lineage and lineage == next_lineage(0, r["step"] - 1, []):
            # Resumed from the checkpoint of the step before (replica.py: every group lost
            # at once): that step's last commit is what the checkpoint saved.
            saved = [c for c in by_lineage.values() if c["step"] == r["step"] - 1]
            lineage = max(saved, key=lambda c: c["time"])["lineage"] if saved else lineage
    missing = [s for s in range(1, steps + 1) if s not in membership]
    if missing:
        problems.append(f"steps never committed: {missing[:10]}{' ...' * (len(missing) > 10)}")
    digests = {g: tuple(r["digests"]) for g, r in results.items()}
    if len(set(digests.values())) > 1:
        problems.append(f"the groups' final states differ: {sorted(digests)} hold "
                        f"{len(set(digests.values()))} different states")
    if not results:
        problems.append("no group finished")
    faults = read_faults(ft_dir)
    commits.sort()
    recoveries = []
    for f in faults:
        group = None if f["group"] is None else int(f["group"])
        after = [t for t, g, _ in commits if t > f["time"] and g != group]
        if after:
            recoveries.append(after[0] - f["time"])
    restarts = {g: sum(1 for r in lines if r.get("event") in ("start", "left")) - 1
                for g, lines in journals.items()}
    left = sorted(g for g, lines in journals.items()
                  if lines and lines[-1].get("event") == "left")
    healed = {g: sum(1 for r in lines if r.get("event") == "healed")
              for g, lines in journals.items()}
    committed_tokens = sum(tokens.values())
    discarded = len(by_lineage) - len(visited)
    out = {
        "steps": len(membership), "final_train_loss": losses.get(steps),
        "groups_finished": sorted(results), "groups_left": left,
        "digests_equal": len(set(digests.values())) == 1,
        "faults": len(faults), "fault_actions": sorted({f["action"] for f in faults}),
        "restarts": restarts, "healed": healed,
        "recovery_s": {"median": statistics.median(recoveries) if recoveries else None,
                       "max": max(recoveries) if recoveries else None,
                       "all": [round(x, 3) for x in recoveries]},
        "discarded_steps": discarded,
        "steps_with_fewer_groups": sum(1 for ids in membership.values()
                                       if len(ids) < len(journals)),
        "committed_tokens": committed_tokens,
        "elapsed_s": None if elapsed_s is None else round(elapsed_s, 2),
        "problems": problems,
    }
    metrics = _metrics(history, journals)
    evals = [m for m in metrics if "val_loss" in m]
    out["final_val_loss"] = evals[-1]["val_loss"] if evals else None
    (ft_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    (ft_dir / "membership.json").write_text(
        json.dumps({str(s): membership[s] for s in sorted(membership)}) + "\n")
    (ft_dir.parent / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return out


def _metrics(history: dict[int, dict[str, Any]],
             journals: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run's metrics, as a run without fault tolerance writes them: one line per step of
    the history that survived (the participants' mean loss), then each evaluation: the mean
    of the groups' shares of the validation batches (equal shares), with the groups that
    evaluated."""
    keep = ("step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "participants")
    lines = [{k: history[s][k] for k in keep if k in history[s]} for s in sorted(history)]
    shares: dict[int, dict[int, dict[str, Any]]] = {}  # step -> group -> its share
    for g in sorted(journals):
        for r in journals[g]:
            if r.get("event") == "eval":
                shares.setdefault(r["step"], {})[g] = r
    for step, by_group in sorted(shares.items()):
        vals = list(by_group.values())
        lines.append({"step": step, "val_loss": sum(r["val_loss"] for r in vals) / len(vals),
                      "val_tokens": sum(r["val_tokens"] for r in vals),
                      "val_groups": sorted(by_group)})
    return lines


def print_summary(summary: dict[str, Any]) -> None:
    rec = summary["recovery_s"]
    rec_text = ("" if rec["median"] is None else
                f"; recovery median {rec['median']:.2f} s, max {rec['max']:.2f} s")
    left = (f" (groups {summary['groups_left']} left for good)"
            if summary.get("groups_left") else "")
    dropped = (f" ({summary['discarded_steps']} committed apart and healed over)"
               if summary["discarded_steps"] else "")
    print(f"fault tolerance: {summary['steps']} steps committed{dropped}, {summary['faults']} "
          f"faults "
          f"({', '.join(summary['fault_actions']) or 'none'}), restarts "
          f"{summary['restarts']}, healed {summary['healed']}{rec_text}; final states "
          f"{'equal' if summary['digests_equal'] else 'DIFFER'} in groups "
          f"{summary['groups_finished']}{left}; loss {summary['final_train_loss']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.train.fault_tolerant RUN_DIR [STEPS]``: print the
    summary of a run folder (STEPS: the run's train.steps, default from its journals)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m shardwise.train.fault_tolerant RUN_DIR [STEPS]",
              file=sys.stderr)
        return 2
    ft_dir = Path(args[0]) / "ft"
    journals = read_journals(ft_dir) if ft_dir.is_dir() else {}
    if not journals:
        print(f"no fault-tolerant journals in {ft_dir}", file=sys.stderr)
        return 2
    steps = int(args[1]) if len(args) > 1 else max(
        (r.get("step", 0) for lines in journals.values() for r in lines
         if r.get("event") == "finish"), default=0)
    summary = summarize(ft_dir, steps)
    print_summary(summary)
    return 1 if summary["problems"] else 0
