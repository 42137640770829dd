"""Live bytes per phase of the first training steps, on the CPU, grouped by what holds them.

    python bench/memory_phases.py                     # dim 1024, 4 layers, vocab 32000
    python bench/memory_phases.py --seq 512 --steps 3 --runs plain,stage3,stage3-cuda

Why: the ~1B stage-3 throughput check ran out of 80 GB on an H100 where an estimate gave
~40 GiB (bench/results/gpu_check_h100.md). No GPU is at hand, so the step is replayed on the
CPU with every tensor storage an op creates tracked until it dies (a ``TorchDispatchMode``
holding weak references to the storages: ``shardwise.testing.live_memory``), phase by
phase: forward, loss (the logits' float cast and the cross entropy), backward, optimizer
step. Runs:

* ``plain``: the model in fp32, no shardwise (the reference);
* ``stage3``: ``shardwise.shard(stage=3, wrap={TransformerBlock})`` with bf16 compute at world
  size 1 (gloo), as bench/gpu_check.py's throughput check, on the CPU's code paths;
* ``stage3-cuda``: the same with the engine's CUDA-only code paths taken on the CPU
  ([Note: CUDA lifetimes on the CPU] in shardwise/testing/live_memory.py);
* ``fsdp2``: torch's ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16)`` at
  world size 1, when it runs on the CPU.

Storage resizes are not dispatched ops: the tracker reads every live storage's size again
after each op, so gathered parameters resized in place count what they hold.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shardwise  # noqa: E402
from shardwise.models import TransformerBlock, build_model, get_model_config  # noqa: E402
from shardwise.testing.live_memory import LiveStorages, cuda_code_paths  # noqa: E402

MIB = 2**20
PHASES = ("forward", "loss", "backward", "step")



def group(snapshot: list, at_step: int) -> dict[str, int]:
    """What a snapshot holds, by the phase (and step) that allocated it."""
    out: dict[str, int] = defaultdict(int)
    for n, s, p, _ in snapshot:
        when = "earlier step" if 0 < s < at_step else ("setup" if s == 0 else "this step")
        out[f"{p} ({when})"] += n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def top_ops(snapshot: list, k: int = 6) -> list[tuple[str, int]]:
    out: dict[str, int] = defaultdict(int)
    for n, s, p, op in snapshot:
        out[f"s{s} {p} {op}"] += n
    return sorted(out.items(), key=lambda kv: -kv[1])[:k]


def run_steps(model, opt, tokens: torch.Tensor, tracker: LiveStorages) -> list[int]:
    """bench/gpu_check.py's ``timed_steps`` with the phases marked; returns the bytes alive
    after each step."""
    after = []
    with tracker:
        for i in range(tokens.shape[0]):
            tracker.step = i + 1
            tracker.phase = "forward"
            out = model(tokens[i, :, :-1])
            tracker.phase = "loss"
            logits = out.float()
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[i, :, 1:].flatten())
            del out, logits
            tracker.phase = "backward"
            loss.backward()
            del loss
            tracker.phase = "step"
            opt.step()
            opt.zero_grad(set_to_none=True)
            after.append(tracker.now())
    return after


def build(kind: str, cfg):
    """The model and its optimizer for one run."""
    model = build_model(cfg, seed=0)
    if kind in ("stage3", "stage3-cuda"):
        shardwise.shard(model, stage=3, wrap={TransformerBlock},
                        mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))
    elif kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def measure(kind: str, cfg, tokens: torch.Tensor) -> dict:
    ctx = cuda_code_paths() if kind == "stage3-cuda" else contextlib.nullcontext()
    with ctx:
        model, opt = build(kind, cfg)
        tracker = LiveStorages()
        tracker.adopt(list(model.parameters()) + list(model.buffers()), "param")
        t0 = time.perf_counter()
        after = run_steps(model, opt, tokens, tracker)
        seconds = time.perf_counter() - t0
    return dict(kind=kind, peaks=tracker.peaks, after=after, seconds=seconds,
                params=sum(p.numel() for p in model.parameters()))


def report(res: dict, steps: int) -> None:
    print(f"\n== {res['kind']} ({res['seconds']:.0f} s) ==")
    print("peak MiB per phase: " + "  ".join(f"{p:>8}" for p in PHASES) + "   after step")
    for s in range(1, steps + 1):
        row = "  ".join(f"{res['peaks'].get((s, p), (0,))[0] / MIB:8.0f}" for p in PHASES)
        print(f"  step {s}:           {row}   {res['after'][s - 1] / MIB:8.0f}")
    worst = max(res["peaks"].items(), key=lambda kv: kv[1][0])
    (s, p), (held, snap) = worst
    print(f"  highest: step {s} {p}: {held / MIB:.0f} MiB; alive by where allocated:")
    for k, v in group(snap, s).items():
        print(f"    {k:<28} {v / MIB:8.1f} MiB")
    print("  largest (step, phase, op):", ", ".join(f"{k} {v / MIB:.0f}" for k, v
                                                    in top_ops(snap)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", default="plain,stage3,stage3-cuda,fsdp2")
    args = ap.parse_args()
    torch.manual_seed(0)
    shardwise.distributed.init(backend="gloo", watchdog="off")
    cfg = get_model_config("debug", dim=args.dim, n_layers=args.layers,
                           n_heads=args.dim // 64, n_kv_heads=args.dim // 128,
                           vocab_size=args.vocab, max_seq_len=args.seq, multiple_of=256)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, args.seq + 1),
                           generator=g)
    for kind in args.runs.split(","):
        try:
            res = measure(kind, cfg, tokens)
        except Exception as exc:  # noqa: BLE001 - one run that cannot go on the CPU
            print(f"\n== {kind}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        print(f"\n{res['params'] / 1e6:.1f}M params, {args.batch} x {args.seq} tokens")
        report(res, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
