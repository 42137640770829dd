"""Activation memory and step time of activation checkpointing: none / selective / full.

    python bench/ac_bench.py                      # small model, 2 x 128 tokens, 2 rounds
    python bench/ac_bench.py --model debug --rounds 3 --batch 4 --seq 128

One process per (policy, round) trains the model on one rank (no sharding: checkpointing
acts on the blocks alone), so each process's peak RSS is its own. Figures per policy:

* **held after forward**: bytes of the tensors that ops created during the forward pass and
  that are still alive when it returns -- what is kept for backward (the logits and the
  loss included; parameters excluded). Measured exactly with a ``TorchDispatchMode`` that
  tracks every output storage through a weak reference (``StorageWeakRef``), so it also
  sees what checkpointing keeps by itself: the block inputs its recompute closure holds and
  the outputs selective checkpointing caches. **of which blocks**: the part created inside
  the transformer blocks, the activations checkpointing acts on.
* **peak in step**: the most such bytes alive at once during forward + backward (the
  recompute of one block included; the parameters' gradients, the same under every policy,
  are allocated before the step and not counted).
* **saved (hooks)**: the bytes an outer ``torch.autograd.graph.saved_tensors_hooks`` sees
  packed for backward, still alive when forward returns. Non-reentrant checkpointing saves
  each block's inputs through such hooks, but installs its own hooks inside the block, and
  selective checkpointing caches the matmul outputs it keeps outside any hook: this view
  matches "held after forward" for none and full and misses selective's cache, which is
  why the dispatch-mode figure is the one to read.
* **peak RSS growth**: the process's peak resident memory during the timed steps minus its
  resident memory before them (the allocator's view; noisy, a second opinion).
* **step time**: forward + backward + SGD step, median (and best) wall time of the timed
  steps, after two warm-up steps, tracking off; and the median CPU time the process used per
  step (all its threads), which other jobs on a shared machine disturb far less than the
  wall time (though not entirely: threads spin while they wait for cores).
* **GFLOP per step**: matmul and attention FLOPs of forward + backward counted by
  ``torch.utils.flop_counter.FlopCounterMode``; what the recompute costs, independent of
  the machine's load (selective checkpointing takes its saved matmuls from its cache).

Writes ``bench/results/ac_bench.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

OUT = Path(__file__).resolve().parent / "results"
POLICIES = ("none", "selective", "full")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create that are still alive (``exclude``: storages to skip,
    e.g. the parameters'). ``in_block()`` says whether an op runs inside a block."""

    def __init__(self, exclude: set[int], in_block=lambda: False) -> None:
        super().__init__()
        self.exclude, self.in_block = exclude, in_block
        self.live: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.total = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._prune()
        inside = self.in_block()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st._cdata  # the storage itself; freed ones were pruned above
                if st.data_ptr() in self.exclude or key in self.live or st.nbytes() == 0:
                    continue
                self.live[key] = (StorageWeakRef(st), st.nbytes(), inside)
                self.total += st.nbytes()
        self.peak = max(self.peak, self.total)
        return out

    def _prune(self) -> None:
        dead = [k for k, (ref, _, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.total -= self.live.pop(k)[1]

    def held(self, blocks_only: bool = False) -> int:
        """Bytes alive now (only those created inside blocks with ``blocks_only``)."""
        self._prune()
        return sum(n for _, n, inside in self.live.values() if inside or not blocks_only)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _block_depth(model: nn.Module, blocks: tuple[type, ...]):
    """Hooks that count how deep in blocks the forward is; returns ``inside()``."""
    depth = [0]

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    for m in model.modules():
        if isinstance(m, blocks):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
    return lambda: depth[0] > 0


def measure_memory(model: nn.Module, tokens: torch.Tensor, blocks: tuple[type, ...]
                   ) -> dict[str, int]:
    """One forward + backward of ``model`` on ``tokens`` with the bytes tracked.

    Returns:
        ``held``, ``held_blocks`` (bytes kept for backward, all / created inside blocks),
        ``peak`` (most bytes alive during the step) and ``saved_hooks`` (what an outer
        ``saved_tensors_hooks`` saw packed, unique storages).
    """
    # Gradients are the same under every policy: allocated up front and excluded, the peak
    # is that of activations (and the transient per-parameter gradients before they are
    # accumulated).
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    exclude = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
    inside = _block_depth(model, blocks)
    packed: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            packed.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return t

    with LiveBytes(exclude, inside) as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss(model, tokens)
        held, held_blocks = live.held(), live.held(blocks_only=True)
        saved = sum(n for ref, n in packed.values() if not ref.expired())
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"held": held, "held_blocks": held_blocks, "peak": live.peak, "saved_hooks": saved}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(model_name: str, policy: str, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """One process's measurements (see the module docstring)."""
    import shardwise
    from shardwise.models import TransformerBlock, build_model, get_model_config

    cfg = get_model_config(model_name)
    model = build_model(cfg, seed=0)
    shardwise.checkpoint_activations(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    for _ in range(2):  # warm-up: lazy imports and inits (checkpointing's first call), allocator
        _loss(model, tokens).backward()
        opt.zero_grad(set_to_none=True)
    rss0 = _rss_bytes()
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with FlopCounterMode(display=False) as flops:
        _loss(model, tokens).backward()
    model.zero_grad(set_to_none=True)
    mem = measure_memory(model, tokens, (TransformerBlock,))
    return {"policy": policy, "step_s": statistics.median(times), "step_min_s": min(times),
            "step_cpu_s": statistics.median(cpu), "flops": flops.get_total_flops(),
            "rss_growth": peak_rss - rss0,
            "loss": loss.item(), **mem}


def _run_worker(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", policy, "--model", args.model, "--batch",
           str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _range(values: list[float], fmt) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def report(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table: per policy, ranges over the rounds."""
    from shardwise.models import get_model_config

    cfg = get_model_config(args.model)
    base = statistics.median(r["held_blocks"] for r in rows["none"])
    lines = [
        "# Activation checkpointing: activation memory and step time",
        "",
        f"Model `{args.model}` ({cfg.n_layers} blocks, dim {cfg.dim}, vocab {cfg.vocab_size}, "
        f"{cfg.num_params() / 1e6:.1f}M parameters), one process, fp32, batch {args.batch} x "
        f"{args.seq} tokens, SGD; torch {torch.__version__}, {args.threads} intra-op "
        f"thread(s), {platform.machine()} CPU shared with other jobs. {args.rounds} rounds, "
        f"each policy in its own process per round; `a-b` is the range over the rounds. "
        f"`python bench/ac_bench.py --model {args.model} --batch {args.batch} --seq "
        f"{args.seq} --rounds {args.rounds}`. Columns: see the docstring of bench/ac_bench.py.",
        "",
        "| policy | held after forward (MiB) | of which blocks (MiB) | blocks vs none | "
        "peak in step (MiB) | saved (hooks, MiB) | peak RSS growth (MiB) | step wall time, "
        "median (best) (s) | step CPU time (s) | GFLOP per step | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        rs = rows[policy]
        ratio = base / statistics.median(r["held_blocks"] for r in rs)
        lines.append(
            f"| {policy} | {_range([r['held'] for r in rs], _mib)} | "
            f"{_range([r['held_blocks'] for r in rs], _mib)} | 1/{ratio:.1f} | "
            f"{_range([r['peak'] for r in rs], _mib)} | "
            f"{_range([r['saved_hooks'] for r in rs], _mib)} | "
            f"{_range([r['rss_growth'] for r in rs], _mib)} | "
            f"{_range([r['step_s'] for r in rs], lambda v: f'{v:.2f}')} "
            f"({_range([r['step_min_s'] for r in rs], lambda v: f'{v:.2f}')}) | "
            f"{_range([r['step_cpu_s'] for r in rs], lambda v: f'{v:.2f}')} | "
            f"{_range([r['flops'] for r in rs], lambda v: f'{v / 1e9:.1f}')} | "
            f"{_range([r['loss'] for r in rs], lambda v: f'{v:.6f}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.batch, args.seq, args.steps)))
        return
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in POLICIES}
    for _ in range(args.rounds):  # interleaved: a busy spell hits every policy alike
        for policy in POLICIES:
            rows[policy].append(_run_worker(args, policy))
            print(policy, rows[policy][-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ac_bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = report(args, rows)
    (args.out / "ac_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
