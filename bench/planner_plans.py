"""The two plans docs/planner.md prints ("Plans"): a trillion parameters on 4,096 H100 and
DeepSeek-V3 on 2,048 H800, as markdown, with their plots.

    python bench/planner_plans.py            # ~1 min; prints the markdown, writes the plots

Each is ``shardwise plan`` with the command line shown in the docs; the top 3 layouts, and
the memory and step-time breakdowns of the best, come from the same ``search`` and
``Estimate`` the command prints from. Paste the output over the docs' section when the model
changes (tests/test_planner_validation.py does the same for the validation table).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from shardwise.planner.catalogue import get_model_spec
from shardwise.planner.cost_model import CostModel
from shardwise.planner.hardware import get_hardware
from shardwise.planner.plot import plot_estimate
from shardwise.planner.search import search
from shardwise.planner.workload import Workload, parse_workload

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
PLANS = [
    ("planner_gpt1t_4096_h100.png",
     "--model gpt-1t --hardware h100 --gpus 4096 --seq-len 2048 --global-batch 3072 "
     "--fused-kernels"),
    ("planner_deepseek_v3_2048_h800.png",
     "--model deepseek-v3-mtp --hardware h800 --gpus 2048 --seq-len 4096 --global-batch 15360 "
     "--compute-dtype fp8 --fused-kernels --workload overlap_ep=true,ep_node_limit=4,"
     "comm_sm_fraction=0.15"),
]
_GIB = 2 ** 30


def _args(line: str) -> dict:
    words = shlex.split(line)
    return {w[2:].replace("-", "_"): (words[i + 1] if i + 1 < len(words)
                                      and not words[i + 1].startswith("--") else True)
            for i, w in enumerate(words) if w.startswith("--")}


def _layout(L) -> str:
    from shardwise.planner.parallel_layout import Layout
    default, keep = Layout(), ("tp", "pp", "dp_shard", "zero", "microbatch", "ac", "sp")
    keep += ("cp_impl",) if L.cp > 1 else ()
    return " ".join(f"{k}={str(v).lower()}" for k, v in L.as_dict().items()
                    if (k in keep or (v != getattr(default, k) and k != "cp_impl"))
                    and k != "pp_microbatches")


def plan(image: str, line: str) -> str:
    a = _args(line)
    spec, hw = get_model_spec(a["model"]), get_hardware(a["hardware"])
    wl = Workload(seq_len=int(a["seq_len"]), global_batch=int(a["global_batch"]),
                  compute_dtype=a.get("compute_dtype", "bf16"),
                  fused_kernels="fused_kernels" in a, **parse_workload(a.get("workload", "")))
    result = search(spec, hw, wl, int(a["gpus"]), {})
    rows = [f"`shardwise plan {line}`: {result.evaluated:,} layouts priced, "
            f"{result.pruned:,} pruned.", "",
            "| # | layout | step s | tokens/s/GPU | MFU | HFU | GiB/GPU | bottleneck |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for i, e in enumerate(result.ranked[:3], 1):
        rows.append(f"| {i} | {_layout(e.layout)} | {e.step_time:.3g} | "
                    f"{e.tokens_per_s_per_gpu:.4g} | {e.mfu:.1%} | {e.hfu:.1%} | "
                    f"{e.memory.total / _GIB:.1f} | {e.bottleneck} |")
    best = result.ranked[0]
    mem = ", ".join(f"{k} {v / _GIB:.1f}" for k, v in best.memory.as_dict().items()
                    if k not in ("pp_rank", "total"))
    step = ", ".join(f"{k} {v:.3g}" for k, v in best.breakdown.items() if v)
    rows += ["", f"Memory of the best layout's largest rank (pipeline rank "
                 f"{best.memory.pp_rank}), GiB: {mem}; total {best.memory.total / _GIB:.1f} of "
                 f"{hw.hbm_bytes / _GIB:.1f}.",
             f"Step time of the best layout, s: {step}."]
    plot_estimate(best, CostModel(spec, hw, wl), str(IMAGES / image))
    return "\n".join(rows)


def main() -> None:
    for image, line in PLANS:
        print(plan(image, line), end="\n\n")


if __name__ == "__main__":
    main()
