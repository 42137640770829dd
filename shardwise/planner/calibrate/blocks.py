"""Composed blocks: whole Llama blocks timed as the trainer runs them, and the factors the
cost model prices a CPU rank's layers with ([Note: composed blocks] in devices/cpu/costs.py).

    blocks = median_blocks([measure_blocks(1.0) for _ in range(3)])   # one thread
    pairs = median_blocks([measure_tp_blocks(1.0) for _ in range(3)])  # 2 Gloo ranks
    costs = composed_costs(plain_hw, replace(costs, blocks=blocks, tp_blocks=pairs))

[Note: two composition factors] The kernels other than the multiplies (RMSNorm, RoPE,
SwiGLU, attention, the loss) are timed alone at their fastest, on operands the previous
call left in the caches; in a block each runs after a multiply that evicted them. So they
compose worse than the multiplies, and a narrow block, where they are a larger share,
runs further above its parts; one factor fitted on wide blocks prices a narrow one fast.
Fitted as two factors, ``seconds = compose * multiplies + compose_kernels * kernels``, on
blocks of different mixes, they price the registry's widths (not fitted) well (the
figures: docs/planner.md). The two are told apart only when the blocks' ratios of kernels
to multiplies differ at least twofold, and kept only when the kernels' factor lies within
0.5-4 times the multiplies'; otherwise the blocks give one factor (their geometric mean).

[Note: tensor-parallel pairs] A tensor-parallel layer meets its peer ten times a micro-batch
(sequence parallelism's gathers and reduce-scatters, both ways, and the weight gradients'
regather), each time after a few milliseconds of a block's operators: the peer's jitter is
waited for at every meeting, and sequence parallelism's concatenations and copies run
around each. The collectives' fits (timed after a fixed multiply on every rank) and the
kernels' fits miss both, so a tensor-parallel block takes longer than its priced parts.
``--calibrate`` therefore runs sequence-parallel blocks on 2 Gloo ranks (each on its own
core, as the trainer's ranks), and the seconds they take beyond their priced parts, per
tensor-parallel collective, are ``collective_overhead``.

[Note: collectives between operators] The engine's gathers and reductions and the
pipeline's sends are met the same way: issued and waited for from hooks between a block's
operators, on ranks whose peers jitter, and their excess is the same size. So the cost
model charges ``collective_overhead`` on every collective of a step
(``devices.cpu.step.collective_overhead_seconds``): each tensor-parallel one, each of the
engine's (``sends.engine_calls``, counted as comm_stats counts them), each pipeline
send or receive and each context-parallel all-to-all and ring exchange
(``sends.cp_calls_per_layer``), while the ranks keep a core each; beyond the cores the crowded
collectives, measured amid the other ranks at the tensor-parallel and the layer gap, price
what a call meets instead ([Note: crowded collectives] in devices/cpu/step.py). What it
was worth on the committed bench: bench/results/planner_bench.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.env import quiet_flight_recorder
from shardwise.distributed.parallel_dims import ParallelDims
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.models.layers import rope_tables
from shardwise.parallel.tensor import apply_tp
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.devices.cpu.costs import CpuCosts
from shardwise.planner.devices.cpu.device import CpuDevice
from shardwise.planner.devices.cpu.fits import fit_terms
from shardwise.planner.sends import tp_calls_per_layer
from shardwise.planner.stage_cost import StageCoster
from shardwise.planner.calibrate.timing import run_local_ranks
from shardwise.planner.workload import Workload

__all__ = ["BLOCKS", "TP_BLOCKS", "BLOCK_TOKENS", "CONTENTION_BLOCK", "block_config",
           "block_work", "measure_blocks", "measure_tp_blocks", "median_blocks",
           "priced_block_parts", "priced_block_seconds", "priced_tp_block_seconds",
           "compose_factors", "collective_overhead_of", "composed_costs"]

BLOCKS = ((192, 6, 3), (384, 6, 3), (640, 10, 5))
"""(dim, heads, kv_heads) of the blocks [Note: composed blocks] times: mixes of kernels and
multiplies far enough apart to tell two factors ([Note: two composition factors]); none is
a registry model's width."""
TP_BLOCKS = ((384, 6, 2), (640, 10, 2))
"""(dim, heads, kv_heads) of the 2-way tensor-parallel blocks ([Note: tensor-parallel
pairs]): key/value heads divisible by 2."""
CONTENTION_BLOCK = (384, 6, 3)
"""The block ``kernels.contention_ratios`` runs on every core."""
BLOCK_TOKENS = (4, 128)
"""(sequences, sequence length) each block runs on."""
_MIN_MIX_SPREAD = 2.0
"""The blocks' largest ratio of kernels to multiplies over their smallest below which the
two factors are not told apart ([Note: two composition factors])."""
_KERNEL_RATIO = (0.5, 4.0)
"""The kernels' factor over the multiplies' that two fitted factors must keep."""


def block_config(dim: int, heads: int, kv_heads: int):
    """The one-layer ``LlamaConfig`` of a calibration block."""
    return get_model_config("debug", dim=dim, n_heads=heads, n_kv_heads=kv_heads, n_layers=1)


def _timed(fn, seconds: float, clock) -> list[float]:
    """Seconds of ``fn`` by ``clock``, called for ``seconds`` and at least 3 times (after
    one warm-up call)."""
    fn()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def block_work(seconds: float, shape: tuple[int, int, int] = CONTENTION_BLOCK
               ) -> tuple[float, float]:
    """(median, fastest) thread CPU seconds of a Llama block's forward and backward
    (shardwise.models; ``shape`` = (dim, heads, kv_heads), ``BLOCK_TOKENS``), repeated for
    ``seconds``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dim, heads, _ = shape
    block = TransformerBlock(block_config(*shape))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    batch, seq = BLOCK_TOKENS
    cos, sin = rope_tables(dim // heads, seq, 10000.0)
    x = torch.randn(batch, seq, dim, requires_grad=True)

    def fn():
        y = block(x, cos, sin)
        y.backward(torch.ones_like(y))
    times = _timed(fn, seconds, time.thread_time)
    return statistics.median(times), min(times)


def measure_blocks(seconds: float = 2.0) -> tuple[tuple[int, int, int, float, float], ...]:
    """``(dim, heads, kv_heads, median seconds, fastest seconds)`` of each of ``BLOCKS``
    on one thread ([Note: composed blocks])."""
    threads = torch.get_num_threads()
    try:
        return tuple((*shape, *block_work(seconds, shape)) for shape in BLOCKS)
    finally:
        torch.set_num_threads(threads)


def _tp_worker(rank: int, world: int, port: int, shapes, seconds: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    quiet_flight_recorder("gloo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = ParallelDims(tp=world, world_size=world).build_mesh("cpu")
    batch, seq = BLOCK_TOKENS
    rows = []
    for dim, heads, kv in shapes:
        torch.manual_seed(0)
        model = build_model(block_config(dim, heads, kv))
        apply_tp(model, mesh["tp"], sequence_parallel=True)
        block = model.layers[0]
        cos, sin = rope_tables(dim // heads, seq, 10000.0)
        x = torch.randn(batch, seq // world, dim, requires_grad=True)  # (B, T / tp, C)

        def fn(block=block, x=x, cos=cos, sin=sin):
            y = block(x, cos, sin)
            y.backward(torch.ones_like(y))
        fn()
        times, end = [], time.perf_counter() + seconds
        while True:  # the ranks agree on every call (each issues the block's collectives)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            more = torch.tensor([float(time.perf_counter() < end or len(times) < 3)])
            comm.all_reduce(more, op=dist.ReduceOp.MIN, label="calibrate.tp_block.more")
            if not more.item():
                break
        rows.append((dim, heads, kv, statistics.median(times), min(times)))
    queue.put(rows)
    dist.destroy_process_group()


def measure_tp_blocks(seconds: float = 1.0, timeout_s: float = 180.0
                      ) -> tuple[tuple[int, int, int, float, float], ...]:
    """``(dim, heads, kv_heads, median seconds, fastest seconds)`` of each of ``TP_BLOCKS``
    split 2 ways with sequence parallelism, forward and backward on 2 Gloo ranks of one
    thread each, by the wall clock: the slowest rank's ([Note: tensor-parallel pairs])."""
    per_rank = run_local_ranks(_tp_worker, 2, (TP_BLOCKS, seconds),
                               "tensor-parallel block micro-benchmark", timeout_s)
    return tuple((*rows[0][:3], max(r[3] for r in rows), max(r[4] for r in rows))
                 for rows in zip(*per_rank, strict=True))


def median_blocks(passes) -> tuple[tuple[int, int, int, float, float], ...]:
    """Per block, the median of the passes' median seconds and the fastest call of any
    pass, over passes of :func:`measure_blocks` (or :func:`measure_tp_blocks`) made at
    different moments of the calibration ([Note: composed blocks]: one pass alone let a
    fast minute decide ``compose``). A pass without its fastest call (four columns) counts
    its median."""
    out = []
    for rows in zip(*passes, strict=True):
        out.append((*rows[0][:3], statistics.median(r[3] for r in rows),
                    min(r[4] if len(r) > 4 else r[3] for r in rows)))
    return tuple(out)


# ---------------------------------------------------------------------- pricing and fits
def _block(dim: int, heads: int, kv_heads: int):
    """(ModelSpec, Workload) of one calibration block."""
    batch, seq = BLOCK_TOKENS
    spec = from_llama_config(block_config(dim, heads, kv_heads), f"block-{dim}")
    return spec, Workload(seq_len=seq, global_batch=batch, compute_dtype="fp32",
                          param_dtype="fp32")


def priced_block_parts(hw, dim: int, heads: int, kv_heads: int) -> tuple[float, float]:
    """(multiplies, other kernels) seconds of one calibration block's forward and backward
    as the cost model prices them on ``hw`` with no composition factor."""
    spec, wl = _block(dim, heads, kv_heads)
    gemm, kf, kb = CpuDevice(hw).layer_parts(spec, wl, 1, False, BLOCK_TOKENS[0])
    return 3 * gemm, kf + kb


def priced_block_seconds(hw, dim: int, heads: int, kv_heads: int) -> float:
    """:func:`priced_block_parts`, summed."""
    return sum(priced_block_parts(hw, dim, heads, kv_heads))


def priced_tp_block_seconds(hw, dim: int, heads: int, kv_heads: int) -> float:
    """What the cost model prices one 2-way tensor-parallel, sequence-parallel block at on
    ``hw`` (its composition factors applied, no ``collective_overhead``), as each of 2
    ranks on
    its own core runs it: the compute slowed by the cores' contention, plus the
    collectives' fits."""
    spec, wl = _block(dim, heads, kv_heads)
    t = StageCoster(spec, CpuDevice(hw), wl).layer(False, 2, 1, True, 1, BLOCK_TOKENS[0], "none")
    slow = hw.cpu.contention(2, hw.cores or 2)
    return slow * (t.fwd + t.bwd) + t.tp_comm


def compose_factors(hw, blocks, fastest: bool = False) -> tuple[float, float]:
    """(``compose``, ``compose_kernels``) from ``blocks`` ((dim, heads, kv_heads, seconds,
    fastest seconds) rows) priced on ``hw`` (no factors): the median calls, or with
    ``fastest`` the fastest calls ([Note: two composition factors]). One factor (the
    geometric mean of measured over priced, and 0 for the kernels: "not told apart") when
    the blocks cannot separate the two; (1, 0) with no blocks."""
    if not blocks:
        return 1.0, 0.0
    parts = [priced_block_parts(hw, *b[:3]) for b in blocks]
    secs = [b[4] if fastest and len(b) > 4 else b[3] for b in blocks]
    one = math.exp(statistics.fmean(math.log(s / (m + k))
                                    for s, (m, k) in zip(secs, parts, strict=True)))
    mix = [k / m for m, k in parts]  # each block's kernels per second of multiplies
    if len(blocks) < 2 or max(mix) < _MIN_MIX_SPREAD * min(mix):
        return one, 0.0
    mm, kernels = fit_terms([((m, k), s) for s, (m, k) in zip(secs, parts, strict=True)])
    lo, hi = _KERNEL_RATIO
    if mm <= 0 or not lo <= kernels / mm <= hi:
        return one, 0.0
    return mm, kernels


def collective_overhead_of(hw, tp_blocks, fastest: bool = False) -> float:
    """Seconds per tensor-parallel collective that ``tp_blocks`` took beyond their price on
    ``hw`` (its composition factors set), the mean over the blocks, at least 0 ([Note:
    tensor-parallel pairs]); 0 with no blocks."""
    if not tp_blocks:
        return 0.0
    calls = tp_calls_per_layer(True, False)
    extra = [(b[4] if fastest and len(b) > 4 else b[3]) - priced_tp_block_seconds(hw, *b[:3])
             for b in tp_blocks]
    return max(0.0, statistics.fmean(extra) / calls)


def composed_costs(plain, cpu: CpuCosts) -> CpuCosts:
    """``cpu`` with every factor its blocks give, priced on ``plain`` (the calibration's
    fits, no factors): ``compose`` and ``compose_kernels`` from ``blocks``, then
    ``collective_overhead`` from ``tp_blocks`` priced with those; each also from the
    fastest calls
    ([Note: undisturbed steps] in devices/cpu/costs.py)."""
    compose, kernels = compose_factors(plain, cpu.blocks)
    best, kernels_best = compose_factors(plain, cpu.blocks, fastest=True)
    out = dataclasses.replace(cpu, compose=compose, compose_kernels=kernels,
                              compose_best=best, compose_kernels_best=kernels_best)
    if not cpu.tp_blocks:
        return out
    hw = plain.replace(cpu=out)
    quiet = plain.replace(cpu=out.undisturbed())
    return dataclasses.replace(
        out, collective_overhead=collective_overhead_of(hw, cpu.tp_blocks),
        collective_overhead_best=collective_overhead_of(quiet, cpu.tp_blocks, True))
