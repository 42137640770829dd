"""Compiled vs eager training at ZeRO stages 0-3: loss parity, graph breaks, recompiles, time.

    python bench/compile_check.py --backend inductor --device cuda          # one GPU
    torchrun --nproc_per_node 8 bench/compile_check.py --backend inductor   # NCCL, 8 GPUs
    python bench/compile_check.py --backend aot_eager --device cpu --steps 3 --dim 64

For each stage the same model (``--model``, seed 0, optionally narrowed with ``--dim`` /
``--layers``) trains ``--steps`` AdamW steps eagerly and with
``shardwise.compile_blocks(backend=...)`` (each with ``--ac`` activation checkpointing too,
if given) on the same batches; rank r takes its own slice. Reported per run: the largest
relative loss difference to eager, Dynamo's graph breaks, the graphs compiled in the first
step and after it (``error_on_recompile`` is on after the first step, so a recompile fails
the run), and the median step time of the steps after the first. Exits 1 when a difference
exceeds ``--rtol`` or a block breaks or recompiles. TF32 is off so that fp32 parity means
fp32; inductor's fused kernels reorder reductions, hence the default ``--rtol`` 1e-4 (the
CI test with ``aot_eager`` holds 1e-5).

Python: :func:`compile_check` returns the rows on each rank; bench/gpu_check.sh calls the
command line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config


def _train(cfg, device: torch.device, tokens: torch.Tensor, stage: int, backend: str | None,
           ac: str, steps: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model(cfg, device="meta")
    shardwise.checkpoint_activations(model, ac)
    if backend:
        shardwise.compile_blocks(model, backend=backend)
    torch.manual_seed(0)
    shardwise.shard(model, stage=stage, wrap={TransformerBlock}, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times, graphs = [], [], []
    try:
        for step in range(steps):
            start = time.perf_counter()
            batch = tokens[step].to(device)
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().double()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
            times.append(time.perf_counter() - start)
            graphs.append(counters["stats"]["unique_graphs"])
            torch._dynamo.config.error_on_recompile = True  # from the second step on
    finally:
        torch._dynamo.config.error_on_recompile = False
    return {"losses": losses, "graphs": graphs, "breaks": sum(counters["graph_break"].values()),
            "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}


def compile_check(backend: str = "inductor", stages: tuple[int, ...] = (0, 1, 2, 3),
                  model: str = "debug", dim: int | None = None, layers: int | None = None,
                  batch: int = 4, seq: int = 128, steps: int = 10,
                  ac: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Eager vs compiled rows on the current process group (call on every rank).

    Args:
        backend: ``torch.compile`` backend (default "inductor").
        stages: ZeRO stages to run (default all).
        model: named model config (default "debug"); ``dim`` / ``layers`` narrow it.
        batch, seq: sequences per rank and tokens per sequence (defaults 4 x 128).
        steps: optimizer steps per run (default 10).
        ac: activation-checkpointing policies to run compiled as well ("full", "selective").

    Returns:
        One dict per (stage, policy): losses, the largest relative loss difference to eager,
        graph breaks, graphs after each step, eager and compiled step times.
    """
    over = {k: v for k, v in (("dim", dim), ("n_layers", layers)) if v is not None}
    if dim is not None:
        over.update(n_heads=max(1, dim // 32), n_kv_heads=max(1, dim // 64))
    cfg = get_model_config(model, **over)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        and dist.get_backend() == "nccl" else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (steps, batch * world, seq + 1), generator=gen)
    tokens = tokens[:, rank * batch:(rank + 1) * batch]
    rows = []
    for stage in stages:
        eager = _train(cfg, device, tokens, stage, None, "none", steps)
        for policy in ("none", *ac):
            run = _train(cfg, device, tokens, stage, backend, policy, steps)
            diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], eager["losses"]))
            rows.append({"stage": stage, "ac": policy, "backend": backend, "rel_diff": diff,
                         "breaks": run["breaks"], "graphs": run["graphs"],
                         "eager_step_s": eager["step_s"], "compiled_step_s": run["step_s"],
                         "losses": run["losses"], "eager_losses": eager["losses"]})
    return rows


def format_rows(rows: list[dict[str, Any]], rtol: float) -> tuple[str, bool]:
    """A markdown table of the rows, and whether every row passed."""
    lines = ["| stage | checkpointing | backend | max rel loss diff | graph breaks | graphs "
             "(first step / last) | eager step (s) | compiled step (s) | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    all_ok = True
    for r in rows:
        ok = r["rel_diff"] <= rtol and r["breaks"] == 0 and len(set(r["graphs"])) == 1
        all_ok &= ok
        lines.append(f"| {r['stage']} | {r['ac']} | {r['backend']} | {r['rel_diff']:.1e} | "
                     f"{r['breaks']} | {r['graphs'][0]} / {r['graphs'][-1]} | "
                     f"{r['eager_step_s']:.3f} | {r['compiled_step_s']:.3f} | "
                     f"{'yes' if ok else 'NO'} |")
    return "\n".join(lines), all_ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA (NCCL) when available, else CPU (Gloo)")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--model", default="debug")
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ac", default="", help="comma-separated policies also run compiled")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--json", help="also write the rows to this file (rank 0)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    use_cuda = args.device == "cuda" or args.device == "auto" and torch.cuda.is_available()
    env = shardwise.distributed.init(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
    rows = compile_check(args.backend, tuple(int(s) for s in args.stages.split(",")),
                         args.model, args.dim, args.layers, args.batch, args.seq, args.steps,
                         tuple(a for a in args.ac.split(",") if a))
    table, ok = format_rows(rows, args.rtol)
    if env.rank == 0:
        print(table, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
