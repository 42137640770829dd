"""Turn per-rank job records into the summary, the target checks and the markdown table."""

from __future__ import annotations

import statistics

from bench.frameworks import FRAMEWORKS, LABELS
from bench.worker import REGIMES, model_config

__all__ = ["aggregate", "write_markdown", "model_sizes"]

MIB = 2 ** 20
# ZeRO paper, fp32 + Adam (K = 8 bytes of state per parameter): bytes per rank / Psi.
ZERO_FORMULA = {"ddp": lambda n: 16.0, "sw0": lambda n: 16.0,
                "ds1": lambda n: 8 + 8 / n, "sw1": lambda n: 8 + 8 / n,
                "ds2": lambda n: 4 + 12 / n, "sw2": lambda n: 4 + 12 / n,
                "ds3": lambda n: 16 / n, "sw3": lambda n: 16 / n, "fsdp2": lambda n: 16 / n}
STEP_TARGETS = {"compute": [("sw0", "ddp", 1.00), ("sw1", "ddp", 1.03), ("sw2", "ddp", 1.03),
                            ("sw3", "ddp", 1.08)],
                "overhead": [("sw3", "fsdp2", 0.85), ("sw3", "ds3", 0.85)]}
RSS_TARGETS = [("sw3", "fsdp2"), ("sw3", "ds3"), ("sw2", "ds2"), ("sw1", "ds1")]
RSS_TOLERANCE = 1.01  # allocator noise: "no higher" allows 1%


def model_sizes(regime: str) -> dict:
    """Parameter count and the fp32 bytes of each unit (blocks, then the root's rest)."""
    from shardwise.models import build_model
    model = build_model(model_config(regime), device="meta")
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.layers]
    total = sum(p.numel() for p in model.parameters())
    units = sorted(blocks + [total - sum(blocks)], reverse=True)
    return {"params": total, "unit_params": units, "two_largest_units_bytes": 4 * sum(units[:2])}


def _model_state(rank: dict) -> dict[str, int]:
    held = rank["held"]
    a, b = held.get("engine_after_backward"), held.get("engine_after_step")
    if a and b:  # shardwise: its own accounting; whole params held between steps count
        return {"params": max(r["param_bytes"] + r["unsharded_bytes"] for r in (a, b)),
                "grads": max(r["grad_bytes"] for r in (a, b)),
                "optimizer": max(r["optimizer_bytes"] for r in (a, b))}
    return {k: v for k, v in held["model_state"].items() if k != "other"}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _summarise(recs: list[dict], world: int) -> dict:
    ok = [r for r in recs if r["error"] is None]
    out = {"jobs": len(recs), "failed": len(recs) - len(ok),
           "errors": [r["error"][:2000] for r in recs if r["error"]]}
    if not ok:
        return out
    samples, per_round, loops, rss, rss_train, wire, sw_sent = [], [], [], [], [], [], []
    cpu, cpu_round = [], []
    for r in ok:
        ranks = r["ranks"]
        steps = [max(s) for s in zip(*[x["step_s"] for x in ranks])]  # slowest rank
        samples += steps
        per_round.append(statistics.median(steps))
        csteps = [max(c) for c in zip(*[x["cpu_s"] for x in ranks])]
        cpu += csteps
        cpu_round.append(statistics.median(csteps))
        loops.append(max(x["loop_s"] for x in ranks) / len(steps))
        rss.append(max(x["memory"]["ru_maxrss"] for x in ranks))
        rss_train.append(max(x["memory"]["rss_train_peak"] for x in ranks))
        wire.append(ranks[0]["lo_tx_bytes"] / world / len(steps))
        if any(x["comm_stats"] for x in ranks):
            sent = [sum(k["bytes_sent"] for k in x["comm_stats"].values()) for x in ranks]
            sw_sent.append(statistics.mean(sent) / len(steps))
    states = [_model_state(x) for x in ok[0]["ranks"]]
    worst = max(states, key=lambda s: sum(s.values()))
    out.update(
        step_s=statistics.median(samples), step_s_min=min(samples), step_samples=samples,
        step_s_per_round=per_round, rounds=[r["round"] for r in ok],
        cpu_s=statistics.median(cpu), cpu_s_per_round=cpu_round,
        loop_s_per_step=statistics.median(loops),
        rss_peak=statistics.median(rss), rss_peak_per_round=rss,
        rss_entry=max(x["memory"]["rss_entry"] for x in ok[0]["ranks"]),
        rss_train_peak=statistics.median(rss_train),
        model_state=sum(worst.values()), model_state_parts=worst,
        held_sources=ok[0]["ranks"][0]["held"]["sources_after_step"],
        wire_bytes_per_step=statistics.median(wire), wire_per_round=wire,
        comm_stats_sent_per_step=_median(sw_sent),
        comm_stats=ok[0]["ranks"][0]["comm_stats"],
        losses_rank0=ok[0]["ranks"][0]["losses"])
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def _round_ratios(a: dict, b: dict) -> list[float]:
    """Ratio of per-round medians, for rounds in which both rows ran."""
    rb = dict(zip(b.get("rounds", []), b.get("step_s_per_round", [])))
    return [x / rb[r] for r, x in zip(a.get("rounds", []), a.get("step_s_per_round", []))
            if r in rb and rb[r]]


def aggregate(records: list[dict]) -> dict:
    """Summary per regime / world / framework, plus the target checks."""
    summary: dict = {}
    sizes = {}
    for regime in REGIMES:
        recs = [r for r in records if r["regime"] == regime]
        if not recs:
            continue
        sizes[regime] = model_sizes(regime)
        psi = sizes[regime]["params"]
        for world in sorted({r["world"] for r in recs}):
            cell = summary.setdefault(regime, {}).setdefault(str(world), {})
            for fw in FRAMEWORKS:
                mine = [r for r in recs if r["world"] == world and r["framework"] == fw]
                if mine:
                    cell[fw] = _summarise(mine, world)
            ideal = 16 * psi / world
            for fw, s in cell.items():
                step = s.get("step_s")
                s["vs_ddp"] = _ratio(step, cell.get("ddp", {}).get("step_s"))
                s["cpu_vs_ddp"] = _ratio(s.get("cpu_s"), cell.get("ddp", {}).get("cpu_s"))
                s["cpu_vs_fsdp2"] = _ratio(s.get("cpu_s"), cell.get("fsdp2", {}).get("cpu_s"))
                s["cpu_vs_ds3"] = _ratio(s.get("cpu_s"), cell.get("ds3", {}).get("cpu_s"))
                s["vs_fsdp2"] = _ratio(step, cell.get("fsdp2", {}).get("step_s"))
                s["vs_ds3"] = _ratio(step, cell.get("ds3", {}).get("step_s"))
                s["vs_16psi_n"] = _ratio(s.get("model_state"), ideal)
                s["vs_zero_formula"] = _ratio(s.get("model_state"), ZERO_FORMULA[fw](world) * psi)
                first = cell.get("ddp", {}).get("losses_rank0")
                if first and s.get("losses_rank0"):
                    s["loss_rel_diff_vs_ddp"] = max(abs(a - b) / abs(b) for a, b in
                                                    zip(s["losses_rank0"], first))
    return {"model_sizes": sizes, "summary": summary, "targets": check_targets(summary, sizes)}


def _check(name, regime, world, value, limit, unit="x") -> dict:
    status = "n/a" if value is None or limit is None else ("PASS" if value <= limit else "MISS")
    return {"target": name, "regime": regime, "world": int(world), "value": value,
            "limit": limit, "unit": unit, "status": status}


def check_targets(summary: dict, sizes: dict) -> list[dict]:
    out = []
    for regime, worlds in summary.items():
        for world, cell in worlds.items():
            for fw, peer, limit in STEP_TARGETS.get(regime, []):
                a, b = cell.get(fw, {}), cell.get(peer, {})
                t = _check(f"{LABELS[fw]} step time <= {limit:.2f}x {LABELS[peer]}",
                           regime, world, _ratio(a.get("step_s"), b.get("step_s")), limit)
                t["per_round"] = _round_ratios(a, b)
                t["cpu_ratio"] = _ratio(a.get("cpu_s"), b.get("cpu_s"))
                out.append(t)
            sw3 = cell.get("sw3", {})
            psi, n = sizes[regime]["params"], int(world)
            limit = 1.02 * 16 * psi / n + sizes[regime]["two_largest_units_bytes"]
            out.append(_check("shardwise stage 3 model-state bytes <= 1.02 x 16 Psi/N + two "
                              "largest units' fp32 params", regime, world,
                              sw3.get("model_state"), limit, "bytes"))
            for fw, peer in RSS_TARGETS:
                a, b = cell.get(fw, {}).get("rss_peak"), cell.get(peer, {}).get("rss_peak")
                out.append(_check(f"{LABELS[fw]} peak RSS <= {LABELS[peer]}'s (1% tolerance)",
                                  regime, world, a, b * RSS_TOLERANCE if b else None, "bytes"))
    return out


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _table(cell: dict) -> list[str]:
    rows = ["| framework | step (ms) | vs DDP | vs FSDP2 | vs ZeRO-3 | CPU ms/step | CPU vs DDP | "
            "peak RSS (MiB) | "
            "RSS peak in training (MiB) | model state (MiB) | vs 16Psi/N | wire MiB/step/rank | "
            "comm_stats MiB/step/rank |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fw, s in cell.items():
        if "step_s" not in s:
            rows.append(f"| {LABELS[fw]} | FAILED ({s['failed']}/{s['jobs']} jobs) |" + " |" * 11)
            continue
        is3 = fw == "sw3"
        sent = s["comm_stats_sent_per_step"]
        rows.append(
            f"| {LABELS[fw]} | {1e3 * s['step_s']:.0f} | {_f(s['vs_ddp'])} | "
            f"{_f(s['vs_fsdp2']) if is3 else ''} | {_f(s['vs_ds3']) if is3 else ''} | "
            f"{1e3 * s['cpu_s']:.0f} | {_f(s['cpu_vs_ddp'])} | "
            f"{s['rss_peak'] / MIB:.0f} | {s['rss_train_peak'] / MIB:.0f} | "
            f"{s['model_state'] / MIB:.1f} | {_f(s['vs_16psi_n'])} | "
            f"{s['wire_bytes_per_step'] / MIB:.1f} | "
            f"{_f(sent and sent / MIB, '{:.1f}')} |")
    return rows


def write_markdown(payload: dict, path: str) -> None:
    env, summary = payload["environment"], payload["summary"]
    lines = ["# ZeRO benchmark: shardwise vs DDP, FSDP2, DeepSpeed", "",
             f"{env['date']} on {env['cpus']} x {env['cpu_model']}, {env['mem_total_gib']} GiB; "
             f"torch {env['torch']}, DeepSpeed {env['deepspeed']}, Python {env['python']}; "
             f"Gloo, 1 intra-op thread per rank; network namespace {env['netns']}; "
             f"load average at start {_f(env['loadavg_start'][0])}, at end "
             f"{_f(env['loadavg_end'][0])}; rounds {env.get('rounds_done', '?')} of "
             f"{env.get('rounds_planned', '?')}; shardwise from "
             f"{env.get('engine_source', 'the working tree')}.", "",
             f"Command: `{env['command']}`. Every number and every rank's raw measurement is in "
             f"the JSON beside this file; bench/README.md says how each column is measured.", ""]
    for regime, worlds in summary.items():
        r, sz = REGIMES[regime], payload["model_sizes"][regime]
        psi = sz["params"]
        lines += [f"## {regime}-bound: {psi / 1e6:.2f}M parameters "
                  f"({', '.join(f'{k}={v}' for k, v in r['model'].items())}), "
                  f"{r['batch']} x {r['seq_len']} tokens per rank per step", ""]
        for world, cell in worlds.items():
            n = int(world)
            any_ok = next((s for s in cell.values() if "rss_entry" in s), {})
            lines += [f"### {world} ranks (16 Psi/N = {16 * psi / n / MIB:.1f} MiB; "
                      f"RSS baseline at rank start {any_ok.get('rss_entry', 0) / MIB:.0f} MiB)",
                      "", *_table(cell), ""]
            diffs = [s["loss_rel_diff_vs_ddp"] for s in cell.values()
                     if "loss_rel_diff_vs_ddp" in s]
            if diffs:
                lines += [f"Same training in every row: rank 0's losses over all "
                          f"{len(cell.get('ddp', {}).get('losses_rank0', []))} steps match DDP's "
                          f"to {max(diffs):.1e} relative (max over rows).", ""]
    lines += ["## Targets (issue 3), as ratios within this run", "",
              "| target | regime | ranks | value | per-round range | CPU-time ratio | limit | "
              "status |", "|---|---|---:|---:|---|---:|---:|---|"]
    for t in payload["targets"]:
        fmt = (lambda x: _f(x and x / MIB, "{:.1f} MiB")) if t["unit"] == "bytes" else \
            (lambda x: _f(x, "{:.3f}x"))
        rr = t.get("per_round") or []
        span = f"{min(rr):.2f}-{max(rr):.2f}" if len(rr) > 1 else ""
        lines.append(f"| {t['target']} | {t['regime']} | {t['world']} | {fmt(t['value'])} | "
                     f"{span} | {_f(t.get('cpu_ratio'), '{:.3f}x', '')} | {fmt(t['limit'])} | "
                     f"**{t['status']}** |")
    lines += ["", "## Setup", ""] + [f"- {k}: {v}" for k, v in payload["setup"].items()]
    lines += ["", "Columns: step = median over all timed steps of all rounds of the slowest "
              "rank's forward + backward + optimizer step + zero_grad (barrier before each step, "
              "not timed); CPU ms/step = the same for the CPU time of the rank's process (all "
              "threads; waiting excluded), which other jobs on the machine barely change; "
              "peak RSS = median over rounds of the max over ranks of ru_maxrss "
              "(includes the baseline above: interpreter, torch, shardwise and DeepSpeed "
              "imported, plus the full fp32 model every framework builds before wrapping); RSS "
              "peak in training = VmHWM reset after wrapping; model state = params + grads + "
              "optimizer state held by the rank (max over ranks); wire = loopback bytes sent "
              "per rank per step (payload + TCP/IP headers); comm_stats = shardwise's own "
              "ring-algorithm count of bytes sent.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
