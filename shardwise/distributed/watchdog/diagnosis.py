"""The watchdog's report: what every rank was doing, composed into one message.

Pure functions over what the ranks published to the c10d store when the watchdog tripped
(see watchdog.py): each answering rank's *state* (its progress per process group from
optrack, the collective it waits in, its exception if it raised one, its Python stack) and
each rank's last *heartbeat* (the same progress, a poll interval old: all there is of a rank
that died or does not answer).

[Note: reading the report] The first line is the cause, by priority: a rank that raised an
exception of its own; ranks that disagree on a collective (seq ``s`` of group ``g``: they
issued different collectives, or shapes / dtypes differ); a rank that stopped answering; a
collective some ranks never issued (they skipped it or are stuck elsewhere: their stacks say
where); a collective every rank issued that still did not finish. Then one line per rank,
then the Python stacks, identical stacks printed once. Sequence numbers count the
collectives of one process group from 0, identically on every member, so seq 41 of group "0"
names the same call on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardwise.distributed.optrack import P2P_GROUP, fingerprint_text, where_text

__all__ = ["compose", "compact_ranks", "find_disagreement"]


def compact_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def _plural(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {compact_ranks(ranks)}"


def short_group(name: str) -> str:
    """A process group's name as shown: c10d names subgroups by a 40-digit hash."""
    return name if len(name) <= 12 else name[:8]


def _op_text(op: dict[str, Any]) -> str:
    shape = tuple(op["shape"]) if op.get("shape") is not None else None
    return fingerprint_text(op["kind"], op["label"], shape, op.get("dtype"))


def _where(op: dict[str, Any], groups: dict[str, list[int]]) -> str:
    if op["group"] == P2P_GROUP:
        return where_text(op["group"], op["seq"])
    ranks = groups.get(op["group"])
    members = f" [ranks {compact_ranks(ranks)}]" if ranks else ""
    return f"seq {op['seq']} of group {short_group(op['group'])}{members}"


def _step(info: dict[str, Any]) -> str:
    """`` at step 7`` from the context the trainer set (empty without one)."""
    ctx = info.get("context") or {}
    return (" at " + ", ".join(f"{k} {v}" for k, v in ctx.items())) if ctx else ""


def _all_groups(infos: Iterable[dict[str, Any]]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for info in infos:
        groups.update(info.get("groups") or {})
    return groups


def find_disagreement(
    infos: dict[int, dict[str, Any]],
) -> tuple[str, int, dict[str, list[int]]] | None:
    """The first (group, seq) where ranks' recorded collectives differ.

    Returns:
        ``(group, seq, {collective text: ranks})`` or None when every pair agrees on every
        collective both remember.
    """
    best = None
    by_group: dict[str, dict[int, dict[int, str]]] = {}
    for rank, info in infos.items():
        for op in info.get("recent") or []:
            by_group.setdefault(op["group"], {}).setdefault(op["seq"], {})[rank] = _op_text(op)
    for group, seqs in by_group.items():
        for seq in sorted(seqs):
            texts = seqs[seq]
            if len(set(texts.values())) > 1:
                if best is None or seq < best[1]:
                    buckets: dict[str, list[int]] = {}
                    for rank, text in sorted(texts.items()):
                        buckets.setdefault(text, []).append(rank)
                    best = (group, seq, buckets)
                break
    return best


def _marks_disagree(infos: dict[int, dict[str, Any]]) -> tuple[str, int] | None:
    """(group, seq) of the first kept running hash that differs between two ranks."""
    found = None
    marks: dict[str, dict[int, set[int]]] = {}
    for info in infos.values():
        for group, kept in (info.get("marks") or {}).items():
            for seq, h in kept:
                marks.setdefault(group, {}).setdefault(seq, set()).add(h)
    for group, seqs in marks.items():
        for seq in sorted(seqs):
            if len(seqs[seq]) > 1:
                if found is None or seq < found[1]:
                    found = (group, seq)
                break
    return found


def _behind(op: dict[str, Any], infos: dict[int, dict[str, Any]],
            groups: dict[str, list[int]]) -> list[int]:
    """Members of ``op``'s group that have not issued it (their next seq is <= its seq)."""
    members = groups.get(op["group"], sorted(infos))
    return [r for r in members if r in infos
            and (infos[r].get("seqs") or {}).get(op["group"], 0) <= op["seq"]]


def _headline(states, silent, infos, groups, timeout_s: float, alarm) -> tuple[str, list[str]]:
    notes: list[str] = []
    failed = sorted((s.get("time", 0.0), r) for r, s in states.items() if s.get("failure"))
    if failed:
        r = failed[0][1]
        head = f"rank {r} failed{_step(states[r])}: {states[r]['failure']}"
        if len(failed) > 1:
            notes.append("then " + "; ".join(f"rank {q} failed: {states[q]['failure']}"
                                             for _, q in failed[1:]))
        return head, notes
    dis = find_disagreement(infos)
    if dis is not None:
        group, seq, buckets = dis
        ordered = sorted(buckets.items(), key=lambda kv: (-len(kv[1]), kv[1]))
        parts = [f"{_plural(ranks)} issued {text}" for text, ranks in ordered]
        head = (f"ranks disagree on collective seq {seq} of group {short_group(group)}"
                f" [ranks {compact_ranks(groups.get(group, sorted(infos)))}]: "
                + "; ".join(parts))
        if len(ordered) > 1 and len(ordered[0][1]) > len(ordered[1][1]):
            odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
            notes.append(f"{_plural(odd)} diverged from the others (a skipped, reordered or "
                         "reshaped collective)")
        return head, notes
    marks = _marks_disagree(infos)
    if marks is not None:
        return (f"ranks disagree on the collectives of group {short_group(marks[0])} issued "
                f"before seq "
                f"{marks[1] + 1} (their fingerprints differ; the difference is older than "
                "the history kept)"), notes
    if silent:
        r = min(silent)
        if (infos.get(r) or {}).get("ended"):
            return f"rank {r} ended before its peers: {silent[r]}", notes
        return f"rank {r} stopped answering: {silent[r]}", notes
    blocked = sorted((-s["blocked"]["seconds"], r) for r, s in states.items()
                     if s.get("blocked"))
    if blocked:
        r = blocked[0][1]
        op = states[r]["blocked"]
        if op["group"] == P2P_GROUP:
            return _p2p_headline(r, op, infos, timeout_s), notes
        waiting = sorted(q for q, s in states.items() if s.get("blocked")
                         and (s["blocked"]["group"], s["blocked"]["seq"])
                         == (op["group"], op["seq"]))
        behind = _behind(op, infos, groups)
        head = (f"collective {_op_text(op)} ({_where(op, groups)}) did not complete within "
                f"{timeout_s:g} s on {_plural(waiting)}")
        if behind:
            return head + f": {_plural(behind)} never issued it", notes
        return head + " although every rank of the group issued it (a backend or network " \
                      "problem, or a collective the watchdog does not see)", notes
    trig = (alarm or {}).get("detail") or "unknown"
    return f"rank {(alarm or {}).get('rank', '?')} raised the alarm: {trig}", notes


def _p2p_headline(r: int, op: dict[str, Any], infos: dict[int, dict[str, Any]],
                  timeout_s: float) -> str:
    """A point-to-point message that did not complete: what its peer is doing instead
    ([Note: point-to-point tracking] in p2p.py)."""
    peer = op["seq"]
    info = infos.get(peer)
    if info is None:
        doing = "gave no state"
    elif info.get("blocked"):
        b = info["blocked"]
        doing = f"waits in {_op_text(b)} ({_where(b, {})}){_step(info)}"
    else:
        doing = f"is not waiting for any message or collective{_step(info)}"
    return (f"{_op_text(op)} (point-to-point with rank {peer}) did not complete within "
            f"{timeout_s:g} s on rank {r}{_step(infos.get(r) or {})}: rank {peer} {doing}")


def _rank_line(r: int, states, heartbeats, silent, groups) -> str:
    info = states.get(r) or heartbeats.get(r) or {}
    who = f"rank {r}"
    if info.get("host"):
        who += f" (host {info['host']}, pid {info.get('pid')})"
    recent = info.get("recent") or []
    last = (f"last collective: {_op_text(recent[-1])} ({_where(recent[-1], groups)})"
            if recent else "no collective yet")
    if r in silent:
        hb = heartbeats.get(r)
        seen = f"; its last heartbeat: {last}" if hb else ""
        if hb and hb.get("ended"):  # [Note: a rank that ended]: its whole count is known
            seen = f"; before it ended it issued {_issued(hb)}; {last}"
        return f"{who}: no answer: {silent[r]}{seen}"
    state = states.get(r)
    if state is None:
        return f"{who}: no state and no heartbeat"
    if state.get("failure"):
        return f"{who}: failed{_step(state)}: {state['failure']}; {last}"
    op = state.get("blocked")
    if op:
        return (f"{who}: waiting {op['seconds']:.1f} s in {_op_text(op)} "
                f"({_where(op, groups)}){_step(state)}")
    return f"{who}: not in a collective{_step(state)}; has issued {_issued(state)}; {last}"


def _issued(info: dict[str, Any]) -> str:
    """``"27 collectives on group 4a2ad14e and 21 on group 0"`` from a rank's progress."""
    seqs = info.get("seqs") or {}
    parts = [f"{n} on group {short_group(g)}" for g, n in sorted(seqs.items())]
    if parts:
        parts[0] = parts[0].replace(" on ", " collectives on ", 1)
    return " and ".join(parts) or "no collective"


def _stacks(states: dict[int, dict[str, Any]]) -> list[str]:
    by_text: dict[str, list[int]] = {}
    for r, s in sorted(states.items()):
        if s.get("stack"):
            by_text.setdefault(s["stack"].rstrip(), []).append(r)
    out = []
    for text, ranks in by_text.items():
        what = "traceback" if any(states[r].get("failure") for r in ranks) else "Python stack"
        out.append(f"--- {what} of {_plural(ranks)}:")
        out.append(text)
    return out


def compose(states: dict[int, dict[str, Any]], heartbeats: dict[int, dict[str, Any]],
            silent: dict[int, str], world_size: int, timeout_s: float,
            alarm: dict[str, Any] | None = None) -> str:
    """The report (see [Note: reading the report]).

    Args:
        states: rank -> what it published when the watchdog tripped.
        heartbeats: rank -> its last heartbeat (used for ranks without a state).
        silent: rank -> why it gave no state (dead process, no answer in time).
        world_size: ranks in the job.
        timeout_s: the collective timeout.
        alarm: the first alarm raised (rank, kind, detail).

    Returns:
        The multi-line message, identical for identical inputs.
    """
    infos = {r: states.get(r) or heartbeats.get(r) for r in range(world_size)
             if states.get(r) or heartbeats.get(r)}
    groups = _all_groups(infos.values())
    head, notes = _headline(states, silent, infos, groups, timeout_s, alarm)
    lines = [f"shardwise watchdog: {head}"]
    lines += [f"  {n}" for n in notes]
    if alarm:
        lines.append(f"  detected by rank {alarm.get('rank')}: {alarm.get('detail')}")
    lines.append("per rank:")
    lines += [f"  {_rank_line(r, states, heartbeats, silent, groups)}" for r in range(world_size)]
    lines += _stacks(states)
    lines.append("(how to read this report: docs/failures.md)")
    return "\n".join(lines)
