"""Stage 3 inside pipeline stages: all-gathers per step kept-for-the-step vs per micro-batch.

    python bench/pp_gathers.py          # pp 2 x dp 2 on 4 CPU ranks, a few seconds

Counts, on rank 0 for one training step after a warm-up step, the all-gathers and the bytes
they received (``shardwise.comm_stats``) and the peak of gathered parameters
(``memory_report().peak_unsharded_bytes``) for 1F1B and ZB-V with the stage's parameters
kept gathered for the step (``keep_gathered=True``) and re-gathered per micro-batch
(``keep_gathered=False``). The table goes to docs/parallelism.md ("With ZeRO inside each
stage"); counts and bytes are exact, not timings.
"""

from __future__ import annotations

import torch

import shardwise
from shardwise.models import LlamaConfig, build_model, init_module_weights
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, shard_stages,
                                         split_stages)
from shardwise.distributed.parallel_dims import ParallelDims
from shardwise.shard import engine_states
from shardwise.shard.memory import MemoryTracker
from shardwise.testing import run_ranks

CFG = LlamaConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=128,
                  multiple_of=64, max_seq_len=16)
MICROBATCHES = 8


def _measure(schedule_name: str, keep: bool, mesh) -> tuple[int, int, int]:
    schedule = build_schedule(schedule_name, 2, MICROBATCHES)
    part = split_stages(build_model(CFG, device="meta"), mesh, schedule.virtual,
                        placement=schedule.placement)
    torch.manual_seed(0)
    shard_stages(part, stage=3, init_weights=init_module_weights)
    pipe = PipelineExecutor(part, schedule, keep_gathered=keep)
    tokens = torch.randint(0, CFG.vocab_size, (MICROBATCHES, 17),
                           generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    pipe.step(x, y)  # warm-up: shapes agreed
    part.zero_grad(set_to_none=True)
    shared = _shared_tracker(part)
    shardwise.reset_comm_stats()
    pipe.step(x, y)
    stats = shardwise.comm_stats()["all_gather"]
    return stats.calls, stats.bytes_received, shared.peak["unsharded"]


def _shared_tracker(part) -> MemoryTracker:
    """One tracker for every unit of the part, so that its peak is the rank's simultaneous
    peak (each ``shard`` call, one per piece, keeps its own; their peaks would add up)."""
    states = [s for st in part.stages for s in engine_states(st)]
    shared = MemoryTracker()
    for kind in shared.current:
        shared.current[kind] = sum(s.tracker.current[kind] for s in states)
    shared.reset_peak()
    for s in states:
        s.tracker = shared
        for u in s.units:
            u.tracker = shared
    return shared


def _worker() -> list:
    torch.set_num_threads(1)
    mesh = ParallelDims(world_size=4, pp=2, dp_shard=2).build_mesh()
    return [(name, keep, *_measure(name, keep, mesh))
            for name in ("1f1b", "zbv") for keep in (True, False)]


def main() -> None:
    rows = run_ranks(_worker, 4, timeout_s=600, threads=1)[0]
    print("| schedule | mode | all-gathers | bytes received | peak gathered parameters |")
    print("|----------|------|-------------|----------------|--------------------------|")
    for name, keep, calls, received, peak in rows:
        mode = "kept for the step" if keep else "per micro-batch"
        print(f"| {name} | {mode} | {calls} | {received / 1e6:.2f} MB | {peak / 1e3:.0f} kB |")


if __name__ == "__main__":
    main()
