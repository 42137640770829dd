"""Grouped expert compute on CPU: torch's grouped_mm vs a padded bmm vs a loop over experts.

    python bench/moe_experts_bench.py                 # ~3 minutes on 2 cores
    python bench/moe_experts_bench.py --reps 5 --threads 2

Times forward + backward of ``shardwise.models.experts.expert_ffn`` (three SwiGLU
projections over rows sorted by expert) for each compute path, on shapes that bracket the
built-in MoE models: the ``debug-moe`` layer on one rank's micro-batch (balanced routing and
a skewed one), a wider layer, and fine-grained experts (DeepSeek-style: many small experts).
Each case checks first that the three paths agree (outputs and gradients). Writes
``bench/results/moe_experts.{md,json}``; the choice of ``compute="auto"`` in
``shardwise/models/experts.py`` rests on this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shardwise.models.experts import expert_ffn

OUT = Path(__file__).resolve().parent / "results"
PATHS = ("grouped_mm", "padded", "loop")

# name, experts, dim, hidden, rows (tokens x top_k), skew (0: uniform routing)
CASES = [
    ("debug-moe layer, balanced", 8, 256, 384, 1024, 0.0),
    ("debug-moe layer, skewed", 8, 256, 384, 1024, 1.5),
    ("wide: E=16, 512 -> 1024", 16, 512, 1024, 4096, 0.0),
    ("fine-grained: E=64, 256 -> 128", 64, 256, 128, 4096, 0.0),
    ("fine-grained, skewed", 64, 256, 128, 4096, 1.0),
]


def _counts(experts: int, rows: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert drawn from a Zipf-like law (skew 0: uniform), summing to ``rows``."""
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    picks = torch.multinomial(weights, rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts)


def _inputs(experts, dim, hidden, rows, gen):
    def t(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).requires_grad_()
    return (t(rows, dim, std=1.0), t(experts, dim, hidden), t(experts, hidden, dim),
            t(experts, dim, hidden))


def _step(path, x, counts, w1, w2, w3, grad):
    for p in (x, w1, w2, w3):
        p.grad = None
    y = expert_ffn(x, counts, w1, w2, w3, compute=path)
    y.backward(grad)
    return y


def _check(x, counts, ws, grad) -> float:
    ref = _step("loop", x, counts, *ws, grad).detach()
    ref_grads = [p.grad.clone() for p in (x, *ws)]
    worst = 0.0
    for path in PATHS[:2]:
        y = _step(path, x, counts, *ws, grad).detach()
        errs = [(y - ref).abs().max()] + [(p.grad - g).abs().max()
                                           for p, g in zip((x, *ws), ref_grads, strict=True)]
        worst = max(worst, max(e.item() for e in errs))
    return worst


def run_case(case, reps: int, seed: int) -> dict:
    name, experts, dim, hidden, rows, skew = case
    gen = torch.Generator().manual_seed(seed)
    counts = _counts(experts, rows, skew, gen)
    x, *ws = _inputs(experts, dim, hidden, rows, gen)
    grad = torch.randn(rows, dim, generator=gen)
    max_abs_diff = _check(x, counts, ws, grad)
    times = {p: [] for p in PATHS}
    for _ in range(reps):  # interleaved, so load changes hit every path alike
        for path in PATHS:
            start = time.perf_counter()
            _step(path, x, counts, *ws, grad)
            times[path].append(time.perf_counter() - start)
    ms = {p: 1e3 * statistics.median(v) for p, v in times.items()}
    best = {p: 1e3 * min(v) for p, v in times.items()}
    return {"case": name, "experts": experts, "dim": dim, "hidden": hidden, "rows": rows,
            "max_count": int(counts.max()), "min_count": int(counts.min()),
            "median_ms": ms, "min_ms": best, "fastest": min(best, key=best.get),
            "max_abs_diff": max_abs_diff}


def to_markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Grouped expert compute on CPU (forward + backward, fp32)", "",
             f"torch {meta['torch']}, {meta['threads']} intra-op thread(s), median of "
             f"{meta['reps']} interleaved repetitions: best (median) ms; shared 2-core "
             "machine, so the best time is the steadier figure. "
             "`python bench/moe_experts_bench.py`.", "",
             "| case | rows (min/max per expert) | grouped_mm | padded | loop | "
             "fastest (best) | max abs diff vs loop |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ms, best = r["median_ms"], r["min_ms"]
        cells = " | ".join(f"{best[p]:.1f} ({ms[p]:.1f})" for p in PATHS)
        lines.append(f"| {r['case']} | {r['rows']} ({r['min_count']}/{r['max_count']}) | "
                     f"{cells} | {r['fastest']} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for case in CASES:
        results.append(run_case(case, args.reps, args.seed))
        print(results[-1], flush=True)
    meta = {"torch": torch.__version__, "threads": args.threads, "reps": args.reps}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_experts.json").write_text(json.dumps({"meta": meta, "results": results},
                                                          indent=2) + "\n")
    (args.out / "moe_experts.md").write_text(to_markdown(results, meta))
    print(to_markdown(results, meta))


if __name__ == "__main__":
    main()
