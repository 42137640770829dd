"""Ten trillion parameters: ``moe-10t`` and ``dense-10t`` planned on 16K to 128K H100 and
B200 (docs/planner.md, "Ten trillion parameters").

    python bench/planner_10t.py            # every plan (~5 min on 2 busy cores): prints the
                                           # table, writes bench/results/planner_10t.{md,json}
                                           # and the docs section's generated part
    python bench/planner_10t.py --only moe-10t --gpus 131072 --hardware b200   # a subset,
                                           # printed only (nothing written)

Each plan is ``shardwise plan`` with the command line the JSON and the docs show (parsed by
the command's own parser, so the two cannot drift); the best layout, its memory and step
time breakdowns come from the same ``search`` and ``Estimate``. The search's wall time is
recorded per plan (issue 37: under a minute at 131,072 GPUs). "What breaks first" is read
off each series (one model on one device, the cluster growing at a fixed global batch): the
first size whose MFU falls below 90% of the 16K plan's, and the overhead whose share of the
step grew the most on the way there ([Note: what breaks first]).

[Note: what breaks first] The global batch is fixed by the optimisation, not by the
cluster: growing the cluster at a fixed batch divides the same sequences among more ranks,
so each pipeline gets fewer micro-batches (its bubble grows), each rank's multiplies shrink,
and the collectives that do not shrink with the batch (data-parallel gradients, expert
all-to-alls' latency) take a larger share. Which of these crosses first is what the series
answers; the docs print the series and the sentence this script writes from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from pathlib import Path

from shardwise.planner.catalogue import get_model_spec
from shardwise.planner.hardware import get_hardware
from shardwise.planner.search import search
from shardwise.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs" / "planner.md"
BEGIN, END = "<!-- planner_10t:begin -->", "<!-- planner_10t:end -->"
GPUS = (16384, 32768, 65536, 131072)
HARDWARE = ("h100", "b200")
# [Note: 10T workloads] Each model on its authors' stack, as the validation table prices
# their published runs (``--workload-of``): moe-10t as DeepSeek-V3 trained (fp8, expert
# all-to-alls overlapped and node-limited, MLA up-projections recomputed, fp8 activations,
# bf16 optimizer state, EMA on the CPU: run deepseek-v3-2048), seq 4096 and 16384
# sequences = 67M tokens a step (V3: 15360 x 4096 = 63M, rounded to a power of two so
# every data-parallel degree divides it); dense-10t as Llama 3 405B trained (bf16, fused
# kernels, stages split as Llama 3 splits them: run llama3-405b-8k-16384gpu), seq 8192 and
# 4096 sequences = 34M tokens (405B ended at 16M; the critical batch grows as the loss
# falls, Kaplan et al. 2020).
MODELS = {
    "moe-10t": "--seq-len 4096 --global-batch 16384 --workload-of deepseek-v3-2048",
    "dense-10t": "--seq-len 8192 --global-batch 4096 --workload-of llama3-405b-8k-16384gpu",
}
WHAT_IF_SCALE = 4
"""The largest cluster is also planned at this many times the batch (what feeds it)."""
_GIB = 2 ** 30
_DAY = 86400


def command(model: str, hardware: str, gpus: int, batch_scale: int = 1) -> str:
    """The ``shardwise plan`` arguments of one plan (``batch_scale``: the model's global
    batch times this, for the largest cluster's what-if)."""
    line = f"--model {model} --hardware {hardware} --gpus {gpus} {MODELS[model]}"
    return re.sub(r"--global-batch (\d+)",
                  lambda m: f"--global-batch {int(m.group(1)) * batch_scale}", line)


def _parse(line: str) -> argparse.Namespace:
    from shardwise.planner.cli import add_parser
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *shlex.split(line)])


def workload_of(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` ``shardwise plan`` builds from ``args`` (its own function)."""
    from shardwise.planner.cli import _workload
    return _workload(args, getattr(args, "workload_of", None))


def assumptions(wl: Workload, hw) -> dict[str, object]:
    """What the plan assumes beyond its layout: every workload field and the device's
    figures the cost model reads."""
    return {"workload": dataclasses.asdict(wl), "device": {
        "name": hw.name, "peak_tflops": {k: v / 1e12 for k, v in hw.peak_flops.items()},
        "hbm_gib": hw.hbm_bytes / _GIB, "hbm_gbs": hw.hbm_bandwidth / 1e9,
        "gpus_per_node": hw.gpus_per_node, "intra_gbs": hw.intra_peak.bandwidth / 1e9,
        "inter_gbs": hw.inter_peak.bandwidth / 1e9, "reserved_gib": hw.reserved_bytes / _GIB}}


def plan(model: str, hardware: str, gpus: int, batch_scale: int = 1) -> dict:
    """Search one plan; returns its JSON record (see the module docstring)."""
    line = command(model, hardware, gpus, batch_scale)
    args = _parse(line)
    spec, hw, wl = get_model_spec(model), get_hardware(hardware), workload_of(args)
    start, cpu = time.perf_counter(), time.process_time()
    result = search(spec, hw, wl, gpus, {})
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    fitting = [e for e in result.ranked if e.fits]
    best = (fitting or result.ranked)[0]
    L = best.layout
    return {
        "model": model, "hardware": hw.name, "gpus": gpus, "batch_scale": batch_scale,
        "command": f"shardwise plan {line}",
        "seq_len": wl.seq_len, "global_batch": wl.global_batch,
        "tokens_per_step": wl.seq_len * wl.global_batch,
        "search_s": wall, "search_cpu_s": cpu, "evaluated": result.evaluated,
        "pruned": result.pruned,
        "layout": L.as_dict(), "fits": best.fits, "step_time_s": best.step_time,
        "mfu": best.mfu, "hfu": best.hfu, "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu,
        "tokens_per_day": best.tokens_per_s_per_gpu * gpus * _DAY,
        "bottleneck": best.bottleneck,
        "memory_gib": {k: (v / _GIB if k != "pp_rank" else v)
                       for k, v in best.memory.as_dict().items()},
        "step_s": {k: v for k, v in best.breakdown.items()},
        "sequences_per_dp_rank": wl.global_batch // L.dp,
        "tokens_per_gpu": wl.seq_len * wl.global_batch / gpus,
        "assumptions": assumptions(wl, hw),
    }


# ---------------------------------------------------------------------------- report
SHAPES = ("deepseek-v3-mtp", "moe-10t", "llama3-405b", "dense-10t")


def _shape_row(name: str) -> list[str]:
    s = get_model_spec(name)
    moe = s.n_moe_layers
    mla = (f"q {s.q_lora_rank}, kv {s.kv_lora_rank}; qk {s.qk_nope_head_dim}+"
           f"{s.qk_rope_head_dim}, v {s.v_head_dim}") if s.is_mla else "-"
    experts = (f"{s.n_experts} + {s.n_shared_experts} shared, width {s.moe_ffn_dim}, "
               f"top-{s.top_k}") if s.is_moe else "-"
    heads = f"{s.n_heads}" + ("" if s.is_mla else f" ({s.kv_heads} kv)")
    return [name, f"{s.n_layers} ({s.n_layers - moe} dense + {moe} MoE)" if moe
            else str(s.n_layers), str(s.dim), heads, mla, str(s.ffn_dim), experts,
            str(s.vocab_size), f"{s.num_params() / 1e12:.3f}T",
            f"{s.active_params() / 1e9:.1f}B" if s.is_moe else "all",
            f"{s.mtp_params() / 1e9:.1f}B" if s.mtp_layers else "-"]


def shapes(names=SHAPES) -> str:
    """The shape table of the 10T models beside the published ones they scale, from the
    planner's own ModelSpec (parameters without the multi-token-prediction module, as
    DeepSeek-V3's 671B; its parameters apart)."""
    head = ["model", "layers", "hidden", "heads", "MLA ranks; head dims", "dense ffn",
            "routed experts", "vocab", "parameters", "active/token", "MTP module"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows += ["| " + " | ".join(_shape_row(n)) + " |" for n in names]
    return "\n".join(rows)


def overhead(r: dict) -> tuple[str, float]:
    """The largest part of the step that is not compute, and its share of the step."""
    parts = {k: v for k, v in r["step_s"].items() if k not in ("compute", "optimizer")}
    if not parts:
        return "none", 0.0
    k = max(parts, key=parts.get)
    return k, parts[k] / r["step_time_s"]


def breaks_first(series: list[dict]) -> str:
    """One sentence on a series of one model on one device ([Note: what breaks first])."""
    series = sorted(series, key=lambda r: r["gpus"])
    base = series[0]
    shares0 = {k: v / base["step_time_s"] for k, v in base["step_s"].items()}
    last = series[-1]
    k, share = overhead(last)
    grown = f"; at {last['gpus']:,} the largest overhead is {k} ({share:.1%} of the step)"
    for prev, r in zip(series, series[1:]):
        if r["mfu"] >= 0.9 * base["mfu"] and r["fits"]:
            continue
        shares = {k: v / r["step_time_s"] for k, v in r["step_s"].items() if k != "compute"}
        grew = max(shares, key=lambda k: shares[k] - shares0.get(k, 0.0))
        return (f"{r['model']} on {r['hardware']}: MFU holds to {prev['gpus']:,} GPUs and "
                f"falls to {r['mfu']:.1%} at {r['gpus']:,} ({base['mfu']:.1%} at "
                f"{base['gpus']:,}); {grew} grew most, {shares0.get(grew, 0.0):.1%} -> "
                f"{shares[grew]:.1%} of the step, with {r['sequences_per_dp_rank']} "
                f"sequences per data-parallel rank ({r['layout']['pp_microbatches']} "
                f"micro-batches for pp={r['layout']['pp']}) and {r['tokens_per_gpu']:,.0f} "
                f"tokens per GPU" + (grown if r is not last else "") + ".")
    return (f"{last['model']} on {last['hardware']}: MFU stays within 10% of the "
            f"{base['gpus']:,}-GPU plan's up to {last['gpus']:,} GPUs ({base['mfu']:.1%} -> "
            f"{last['mfu']:.1%}); the largest overhead there is {k} ({share:.1%} of the step).")


def _layout(d: dict) -> str:
    keep = ("tp", "pp", "dp_shard", "ep", "zero", "microbatch", "pp_microbatches", "ac")
    skip = {"dp_replicate": 1, "cp": 1, "pp_schedule": "none", "pp_virtual": 1, "sp": False,
            "offload": "none", "comm_weights": "fp", "comm_grads": "fp"}
    out = []
    for k, v in d.items():
        if k == "cp_impl":
            show = d.get("cp", 1) > 1
        else:
            show = v != skip[k] if k in skip else k in keep
        if show:
            out.append(f"{k}={str(v).lower()}")
    return " ".join(out)


def table(records: list[dict]) -> str:
    """The plan table (one row per plan) as markdown."""
    rows = ["| model | GPUs | device | search s (CPU) | step s | MFU | tokens/day | GiB/GPU | "
            "bottleneck | largest overhead | seq/DP rank | layout |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for r in records:
        k, share = overhead(r)
        fit = "" if r["fits"] else " (does not fit)"
        rows.append(f"| {r['model']} | {r['gpus']:,} | {r['hardware']} | "
                    f"{r['search_s']:.1f} ({r['search_cpu_s']:.1f}) | "
                    f"{r['step_time_s']:.3g} | {r['mfu']:.1%} | "
                    f"{r['tokens_per_day'] / 1e9:,.0f}B | {r['memory_gib']['total']:.1f}{fit} | "
                    f"{r['bottleneck']} | {k} {share:.1%} | {r['sequences_per_dp_rank']} | "
                    f"{_layout(r['layout'])} |")
    return "\n".join(rows)


def breakdowns(records: list[dict]) -> str:
    """Memory and step-time breakdowns of every plan, as markdown lines."""
    out = []
    for r in records:
        mem = ", ".join(f"{k} {v:.1f}" for k, v in r["memory_gib"].items()
                        if k not in ("pp_rank", "total") and v)
        step = ", ".join(f"{k} {v:.3g}" for k, v in r["step_s"].items() if v)
        out.append(f"- {r['model']} on {r['gpus']:,} x {r['hardware']}: memory GiB (pipeline "
                   f"rank {r['memory_gib']['pp_rank']}) {mem}; total "
                   f"{r['memory_gib']['total']:.1f} of "
                   f"{r['assumptions']['device']['hbm_gib']:.1f}. Step s: {step}.")
    return "\n".join(out)


def assumption_lines(records: list[dict]) -> str:
    """The workload of each model (identical across its plans) and each device's figures."""
    out, seen = [], set()
    for r in records:
        if r["model"] in seen:
            continue
        seen.add(r["model"])
        wl = r["assumptions"]["workload"]
        default = dataclasses.asdict(Workload(seq_len=wl["seq_len"],
                                              global_batch=wl["global_batch"]))
        diff = ", ".join(f"{k}={v}" for k, v in wl.items() if default[k] != v) or "none"
        same = ", ".join(f"{k}={v}" for k, v in wl.items()
                         if default[k] == v and k not in ("seq_len", "global_batch"))
        out.append(f"- {r['model']}: seq {wl['seq_len']}, {wl['global_batch']} sequences "
                   f"({r['tokens_per_step'] / 1e6:.0f}M tokens) a step; set: {diff}; "
                   f"defaults kept: {same}.")
    devs = {r["hardware"]: r["assumptions"]["device"] for r in records}
    for name, d in devs.items():
        figs = ", ".join(f"{k} {v}" for k, v in d.items() if k != "name")
        out.append(f"- {name}: {figs}.")
    return "\n".join(out)


def markdown(records: list[dict]) -> str:
    """The generated part of the docs section (and bench/results/planner_10t.md)."""
    series: dict[tuple, list[dict]] = {}
    fixed = [r for r in records if r["batch_scale"] == 1]
    for r in fixed:
        series.setdefault((r["model"], r["hardware"]), []).append(r)
    worst = max(records, key=lambda r: r["search_s"])
    bigger = [r for r in records if r["batch_scale"] != 1]
    what_if = ([f"The largest cluster with {bigger[0]['batch_scale']}x the batch ("
                + ", ".join(dict.fromkeys(f"{r['model']} {r['global_batch']} sequences, "
                                          f"{r['tokens_per_step'] / 1e6:.0f}M tokens"
                                          for r in bigger)) + "):\n\n" + table(bigger)]
               if bigger else [])
    return "\n\n".join([
        shapes(),
        table(fixed),
        *what_if,
        f"Search time per plan on this machine (2 cores shared with other work): at most "
        f"{worst['search_s']:.1f} s wall ({worst['search_cpu_s']:.1f} s CPU), "
        f"{worst['model']} on {worst['gpus']:,} {worst['hardware']}.",
        "What breaks first, per series (fixed global batch, the cluster growing):\n\n"
        + "\n".join(f"- {breaks_first(s)}" for s in series.values()),
        "Assumptions (every plan's full list is in bench/results/planner_10t.json):\n\n"
        + assumption_lines(records),
        "Breakdowns of each best layout:\n\n" + breakdowns(records)])


def write_docs(text: str, path: Path = DOCS) -> None:
    """Replace what lies between the section's markers in ``path`` with ``text``.

    Raises:
        ValueError: the markers are missing.
    """
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"{path}: markers {BEGIN} / {END} not found")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(MODELS), help="one model (printed, not written)")
    p.add_argument("--hardware", choices=HARDWARE, help="one device (printed, not written)")
    p.add_argument("--gpus", type=int, choices=GPUS, help="one size (printed, not written)")
    p.add_argument("--batch-scale", type=int, default=1,
                   help="the global batch times this (printed, not written)")
    a = p.parse_args(argv)
    subset = bool(a.only or a.hardware or a.gpus or a.batch_scale != 1)
    jobs = [(m, h, g, a.batch_scale) for m in ([a.only] if a.only else MODELS)
            for h in ([a.hardware] if a.hardware else HARDWARE)
            for g in ([a.gpus] if a.gpus else GPUS)]
    if not subset:  # what the largest cluster does with a batch that feeds it
        jobs += [(m, h, GPUS[-1], WHAT_IF_SCALE) for m in MODELS for h in HARDWARE]
    records = []
    for job in jobs:
        records.append(plan(*job))
        r = records[-1]
        print(f"{' '.join(map(str, job))}: {r['search_s']:.1f} s search, step "
              f"{r['step_time_s']:.3g} s, MFU {r['mfu']:.1%}", file=sys.stderr)
    text = markdown(records)
    print(text)
    if not subset:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "planner_10t.json").write_text(json.dumps(records, indent=1) + "\n")
        (RESULTS / "planner_10t.md").write_text(text + "\n")
        write_docs(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
