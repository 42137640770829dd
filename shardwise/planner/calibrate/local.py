"""The local machine measured as a device: micro-benchmarks, and the ``local`` entry of the
hardware catalogue they are written as ([Note: calibration] in calibrate/__init__.py).

    meas = measure_local(budget_s=30.0)
    write_calibration(meas, default_calibration_path())
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.compat import tomllib
from shardwise.distributed.comm import byte_counts as comm_bytes
from shardwise.planner.calibrate.blocks import composed_costs
from shardwise.planner.calibrate.fit import fit_constants, log_error
from shardwise.planner.calibrate.kernels import LINEAR_SHAPES, measure_cpu, measure_linear
from shardwise.planner.calibrate.timing import best_time, kernel_clock, run_local_ranks
from shardwise.planner.devices.cpu.costs import CpuCosts
from shardwise.planner.hardware import get_hardware

__all__ = ["measure_local", "write_calibration", "fit_matmul_curve", "fit_alpha_beta",
           "usable_cores", "measure_collectives", "LocalMeasurements"]


def fit_matmul_curve(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(peak FLOP/s, matmul_max, half-size FLOPs) of the curve ``t = (F + h) / (peak e)``.

    The peak is the best measured throughput; ``matmul_max`` and the half-size are fitted
    to every point (log errors).
    """
    peak = max(f / t for f, t in points)
    start = {"matmul_max": 0.95, "half": min(f for f, _ in points)}
    hi = max(f for f, _ in points)
    best, _ = fit_constants(start, {"matmul_max": (0.3, 1.0), "half": (1.0, hi)},
                            lambda p: log_error([(f + p["half"]) / (peak * p["matmul_max"])
                                                 for f, _ in points], [t for _, t in points]))
    return peak, best["matmul_max"], best["half"]


def fit_alpha_beta(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(latency per step s, bandwidth bytes/s) from (steps, bytes, seconds) points."""
    start = {"alpha": 1e-5, "beta": 1e9}
    best, _ = fit_constants(start, {"alpha": (1e-8, 1e-1), "beta": (1e6, 1e12)},
                            lambda p: log_error([s * p["alpha"] + b / p["beta"]
                                                 for s, b, _ in points], [t for *_, t in points]))
    return best["alpha"], best["beta"]


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int,
                       queue) -> None:
    import torch.distributed as dist

    from shardwise.distributed import comm
    from shardwise.distributed.comm import objects as comm_objects
    from shardwise.distributed.env import quiet_flight_recorder
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    quiet_flight_recorder("gloo")  # as shardwise.distributed.init() runs the engine's groups
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        t = torch.ones(numel)
        out = torch.empty(numel * world)
        shard = torch.ones(numel)

        def ar(t=t):
            comm.all_reduce(t, label="calibrate.all_reduce")

        def ag(out=out, shard=shard):  # the engine's own all-gather (sends on Gloo)
            comm.all_gather_into_tensor(out, shard, label="calibrate.all_gather")

        # A fixed number of calls: every rank must issue the same collectives.
        comm_objects.barrier(label="calibrate")
        rows.append(("all_reduce", numel * 4, best_time(ar, repeats, min_seconds=0.0)))
        comm_objects.barrier(label="calibrate")
        rows.append(("all_gather", numel * 4, best_time(ag, repeats, min_seconds=0.0)))
    queue.put(rows)  # every rank's: the same calls, timed on each
    dist.destroy_process_group()


def measure_collectives(world: int, sizes: list[int], repeats: int = 3,
                        timeout_s: float = 120.0) -> list[tuple[str, int, float]]:
    """(kind, payload bytes, seconds) of Gloo all-reduces and all-gathers on ``world``
    local ranks (payload: the all-reduced tensor, or one rank's all-gather shard)."""
    return run_local_ranks(_collective_worker, world, (sizes, repeats),
                           "collective micro-benchmark", timeout_s)[0]


def _alpha_beta_points(rows, world: int) -> list[tuple[int, float, float]]:
    pts = []
    for kind, nbytes, secs in rows:
        if kind == "all_reduce":
            pts.append((2 * (world - 1), comm_bytes.all_reduce_bytes(world, nbytes)[0], secs))
        else:
            pts.append((world - 1, comm_bytes.all_gather_bytes(world, nbytes)[0], secs))
    return pts


@dataclass
class LocalMeasurements:
    """What :func:`measure_local` measured (see [Note: calibration])."""

    matmul: list[tuple[float, float]]
    copy_bandwidth: float
    collectives: dict[int, list[tuple[str, int, float]]] = field(default_factory=dict)
    ranks: int = 2
    memory_bytes: float = 0.0
    cores: int = 0
    cpu: CpuCosts | None = None
    """The trainer's kernels, update and collectives on CPU ranks ([Note: CPU kernels])."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: a ``taskset`` or a container's
    cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_local(budget_s: float = 30.0, ranks: int | None = None) -> LocalMeasurements:
    """Run the micro-benchmarks (about ``budget_s`` seconds; smaller budgets measure
    fewer sizes) on this machine's CPU and Gloo ranks."""
    quick = budget_s < 15
    cores = usable_cores()
    ranks = ranks or max(2, min(4, cores))
    threads = torch.get_num_threads()
    # One rank's share of the cores, as each training rank gets: it is one rank's speed
    # that is priced, and fewer threads than cores avoid waiting on descheduled ones.
    torch.set_num_threads(max(1, cores // ranks))
    try:
        # the trainer's multiplies: F.linear forward and backward at linear shapes
        matmul = measure_linear(LINEAR_SHAPES[:5] if quick else LINEAR_SHAPES,
                                repeats=2 if quick else 3)
        n = 1 << (22 if quick else 25)  # 16 / 128 MiB fp32
        x = torch.ones(n)
        y = torch.empty(n)
        copy = 2 * 4 * n / best_time(lambda: y.copy_(x), 2 if quick else 4,
                                      clock=kernel_clock())
    finally:
        torch.set_num_threads(threads)
    msg = [4096, 65536, 1 << 20] if quick else [4096, 65536, 1 << 20, 1 << 23]
    coll = {}
    for world in sorted({2, ranks}):
        coll[world] = measure_collectives(world, msg, repeats=2 if quick else 3)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = measure_cpu(ranks, quick, cores)  # kernels on one thread, as a training rank runs them
    return LocalMeasurements(matmul, copy, coll, ranks, float(mem), cores, cpu)


def write_calibration(meas: LocalMeasurements, path: str | Path) -> Path:
    """Fit the measurements and write the ``local`` catalogue entry to ``path``."""
    peak, emax, half = fit_matmul_curve(meas.matmul)
    alphas, betas = [], []
    for world, rows in meas.collectives.items():
        a, b = fit_alpha_beta(_alpha_beta_points(rows, world))
        alphas.append(a)
        betas.append(b)
    alpha, beta = sum(alphas) / len(alphas), min(betas)
    per_rank = meas.memory_bytes / meas.ranks
    lines = ["# Written by `shardwise plan --hardware local --calibrate` (see docs/planner.md).",
             "[local]",
             'description = "this machine, measured: CPU ranks over Gloo"',
             'family = "local"',
             f"peak_tflops = {{ fp32 = {peak / 1e12:.6g}, bf16 = {peak / 1e12:.6g}, "
             f"fp16 = {peak / 1e12:.6g} }}",
             f"hbm_gib = {per_rank / 2**30:.4g}",
             f"hbm_gbs = {meas.copy_bandwidth / 1e9:.4g}",
             f"gpus_per_node = {meas.ranks}",
             f"cores = {meas.cores}", 'backend = "gloo"',
             f"intra_gbs = {beta / 1e9:.4g}", f"inter_gbs = {beta / 1e9:.4g}",
             f"intra_latency_us = {alpha * 1e6:.4g}", f"inter_latency_us = {alpha * 1e6:.4g}",
             f"pcie_gbs = {meas.copy_bandwidth / 1e9:.4g}",
             f"host_gbs = {meas.copy_bandwidth / 1e9:.4g}",
             f"host_gib = {meas.memory_bytes / 2**30:.4g}", "reserved_gib = 0.25",
             f"matmul_max = {emax:.4g}", f"matmul_half_gflop = {half / 1e9:.6g}",
             "memory_efficiency = 1.0", "intra_efficiency = 1.0", "inter_efficiency = 1.0",
             f'fitted_on = "calibrated {time.strftime("%Y-%m-%d %H:%M")}"', "",
             "[local.measured]",
             "matmul_flops_seconds = [" + ", ".join(f"[{f:.6g}, {t:.6g}]"
                                                   for f, t in meas.matmul) + "]",
             f"copy_bytes_per_s = {meas.copy_bandwidth:.6g}"]
    for world, rows in meas.collectives.items():
        lines.append(f"collectives_{world}_ranks = [" + ", ".join(
            f'["{k}", {b}, {t:.6g}]' for k, b, t in rows) + "]")
    if meas.cpu is not None:
        cpu = meas.cpu
        if cpu.blocks or cpu.tp_blocks:  # price the measured blocks with the fits above
            table = tomllib.loads("\n".join(lines + [""] + cpu.toml_lines("local")))
            cpu = composed_costs(get_hardware("local", extra_tables=[table]), cpu)
        lines += [""] + cpu.toml_lines("local")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out
