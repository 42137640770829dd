"""Statistics, verdict and markdown table of bench/vla_bench.py's record (see its module doc
and [Note: vla bench noise control] there for what is measured)."""

from __future__ import annotations

import math
import statistics

__all__ = ["LOSS_RTOL", "TARGET", "PEER", "median_interval", "round_ratio", "pooled_ratio",
           "overall_verdict", "loss_agreement", "to_markdown"]

TARGET, PEER = "sw3", "fsdp2"
LOSS_RTOL = 1e-5  # the relative loss difference the peers must stay within


def median_interval(values: list[float], conf: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: order statistics k and
    n + 1 - k, with k the largest rank whose binomial(n, 1/2) tail is at most (1 - conf) / 2
    (for fewer than 6 values, the whole range).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("median_interval needs at least one value")
    xs, n = sorted(values), len(values)
    tail, k, cdf = (1 - conf) / 2, 0, 0.0
    for j in range(n):  # cdf = P(Bin(n, 1/2) <= j)
        cdf += math.comb(n, j) / 2 ** n
        if cdf > tail:
            break
        k = j + 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def _verdict(lo: float, hi: float) -> str:
    if hi <= 1.0:
        return "met"
    if lo > 1.0:
        return "not met"
    return "unsettled"


def round_ratio(rec: dict, key: str = "wall", target: str = TARGET,
                peer: str = PEER) -> dict:
    """Paired per-step ratios ``target / peer`` of one round's ``key`` ("wall" or "cpu"):
    their median, 95% interval and the round's verdict (met: interval <= 1.00)."""
    ratios = [a / b for a, b in zip(rec["peers"][target][key], rec["peers"][peer][key])]
    lo, hi = median_interval(ratios)
    return {"ratio": statistics.median(ratios), "lo": lo, "hi": hi, "verdict": _verdict(lo, hi)}


def pooled_ratio(rounds: list[dict], key: str = "wall") -> dict:
    """:func:`round_ratio` over the paired steps of every round together (more pairs, a
    narrower interval; the target itself is per round)."""
    pooled = {"peers": {n: {key: [x for r in rounds for x in r["peers"][n][key]]}
                        for n in (TARGET, PEER)}}
    return round_ratio(pooled, key)


def overall_verdict(rounds: list[dict], key: str = "wall") -> str:
    """"met in every round", "not met in round k, ..." (any round whose interval lies above
    1.00), or "not settled (round k straddles 1.00 ...)"."""
    if not rounds:
        return "no rounds"
    per = [(r["round"], round_ratio(r, key)["verdict"]) for r in rounds]
    missed = [str(k) for k, v in per if v == "not met"]
    if missed:
        return f"not met in round {', '.join(missed)}"
    open_ = [str(k) for k, v in per if v == "unsettled"]
    if open_:
        return (f"not settled (round {', '.join(open_)}: the 95% interval straddles 1.00; "
                f"rerun with more steps per round, on a quieter machine)")
    return "met in every round"


def loss_agreement(data: dict, a: str, b: str = PEER) -> float:
    """Largest relative difference between peers ``a`` and ``b``'s losses over the timed
    steps of every round and rank (nan when a peer is missing)."""
    warmup, worst = data["meta"]["warmup"], 0.0
    for rec in data["rounds"]:
        if a not in rec["peers"] or b not in rec["peers"]:
            return float("nan")
        for la, lb in zip(rec["peers"][a]["loss"], rec["peers"][b]["loss"]):
            for x, y in zip(la[warmup:], lb[warmup:]):
                worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    return worst


def _ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f}"


def _ratio_cell(r: dict) -> str:
    return f"{r['ratio']:.3f} ({r['lo']:.3f}-{r['hi']:.3f})"


def _round_table(data: dict) -> list[str]:
    extra = [n for n in data["meta"]["peers"] if n not in (TARGET, PEER)]
    head = ("| round | load | sw3 ms | fsdp2 ms | sw3/fsdp2 (95%) | verdict | sw3 CPU ms | "
            "fsdp2 CPU ms | CPU sw3/fsdp2 (95%) | " + "".join(f"{n} ms (CPU) | " for n in extra)
            + "job s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in data["rounds"]:
        p = rec["peers"]
        w, c = round_ratio(rec, "wall"), round_ratio(rec, "cpu")
        cells = [str(rec["round"]), f"{rec['load'][0]:.1f}", _ms(p[TARGET]["wall"]),
                 _ms(p[PEER]["wall"]), _ratio_cell(w), w["verdict"], _ms(p[TARGET]["cpu"]),
                 _ms(p[PEER]["cpu"]), _ratio_cell(c)]
        cells += [f"{_ms(p[n]['wall'])} ({_ms(p[n]['cpu'])})" for n in extra]
        cells.append(f"{rec['job_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _spread(data: dict, key: str) -> str:
    ratios = [round_ratio(r, key)["ratio"] for r in data["rounds"]]
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"


def _loss_lines(data: dict) -> list[str]:
    lines = []
    for n in data["meta"]["peers"]:
        if n == PEER:
            continue
        d = loss_agreement(data, n)
        ok = "agree" if d <= LOSS_RTOL else "DIFFER"
        lines.append(f"- {n} vs fsdp2: largest relative loss difference over the timed steps "
                     f"(every rank, every round) {d:.1e}: {ok} (bound {LOSS_RTOL:.0e})")
    return lines


def to_markdown(data: dict) -> str:
    """The results page: setup, verdict, one row per round, loss agreement."""
    m = data["meta"]
    rounds = data["rounds"]
    lines = ["# VLA step: shardwise ZeRO-3 vs PyTorch FSDP2 (issue 34)", "",
             f"{m['date']}, torch {m['torch']}, shardwise {m['commit']} "
             f"(from `{m['shardwise_from']}`), {m['cores']} cores, {m['machine']}; "
             f"load average {m['load_at_start'][0]:.1f} at the start"
             + (f", {m['load_at_end'][0]:.1f} at the end" if "load_at_end" in m else "")
             + f"; {len(rounds)} of {m['rounds']} rounds, {m.get('minutes', 0):.1f} min.", "",
             f"`debug-vla` ({m['params'] / 1e6:.2f}M parameters), fp32, AdamW, {m['world']} "
             f"Gloo ranks (one thread each); {m['batch']} real {m['level']} samples per rank "
             f"per step ({m['frames_per_batch']} frames, {m['seq']} tokens each), "
             f"{m['warmup']} untimed + {m['steps']} timed steps per peer per round, the same "
             f"batches for every peer and round. Peers step in turn, rotated every step, in "
             f"one job per round (bench/vla_bench.py, [Note: vla bench noise control]).", ""]
    lines += [f"- {n}: {m['describe'][n]}" for n in m["peers"]] + [""]
    if not rounds:
        return "\n".join(lines + ["No round finished."]) + "\n"
    lines += [f"**Verdict (wall time, the target: sw3 no slower than fsdp2 in every round): "
              f"{overall_verdict(rounds, 'wall')}.** Per-round ratios {_spread(data, 'wall')}.",
              "",
              f"CPU time (process time of the ranks, insensitive to load): "
              f"{overall_verdict(rounds, 'cpu')}; per-round ratios {_spread(data, 'cpu')}.", "",
              f"All rounds pooled ({sum(len(r['peers'][TARGET]['wall']) for r in rounds)} "
              f"paired steps): wall {_ratio_cell(pooled_ratio(rounds, 'wall'))}, CPU "
              f"{_ratio_cell(pooled_ratio(rounds, 'cpu'))} (median paired ratio, 95% "
              f"interval).", ""]
    lines += _round_table(data) + [""]
    lines += ["Columns: step times are per-round medians of the slowest rank's time per step; "
              "sw3/fsdp2 is the median of the per-step paired ratios (the two peers' step i "
              "ran back to back on the same batch) with a distribution-free 95% interval of "
              "that median; a round is met when the interval lies at or below 1.00, not met "
              "when above, unsettled when it straddles 1.00. CPU ms: `time.process_time` of "
              "the rank process inside the step (slowest rank). load: 1-minute load average "
              "before the round's job.", "", "## Same numbers", ""]
    lines += _loss_lines(data) + [""]
    return "\n".join(lines)
