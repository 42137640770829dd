"""The engine's Gloo collectives on CPU ranks, met as the trainer meets them, for
``--calibrate`` ([Note: CPU kernels] in devices/cpu/costs.py).

    rows = measure_gloo(2, [4096, 1 << 20])   # (kind, payload bytes, seconds, CPU seconds)
    fits = fit_collectives({2: rows})         # kind -> group size -> Fit
    cpu_fractions({2: rows})                  # group size -> CPU seconds / seconds

Collectives run on real Gloo ranks through the engine's own calls
(``shardwise.distributed.comm``), met as the trainer meets them: every rank computes a few
milliseconds, then calls the collective, timed from the call to its return, averaged over
the calls and the ranks. That is what a collective adds to a step on saturated cores: its
latency and copies, and the wait for a peer still computing (with two ranks the mean wait
is half the mean difference of their compute times, what the slower one costs the step),
well above the same collective back to back. Under time-sharing (more ranks than cores)
the slices the others take are part of it too. The process CPU time of each call is
measured beside it: the part of a collective that occupies a core (the copies, the
reduction, Gloo's threads), which time-shared ranks compete for; the rest is waiting,
during which another rank can run (most of it, once ranks outnumber the cores).

Beyond the cores, ``group`` measures groups smaller than the world with every group
running at once, and ``multiplies`` sets the compute before each call ([Note: crowded
collectives] in devices/cpu/step.py).
"""

from __future__ import annotations

import os
import time

import torch

from shardwise.planner.devices.cpu.fits import Fit, fit_terms
from shardwise.planner.calibrate.timing import run_local_ranks

__all__ = ["measure_gloo", "gap_seconds", "fit_collectives", "cpu_fractions"]


def _multiplies(count: int):
    """The compute between two calls: ``count`` multiplies of a 256 x 256 by a 256 x 1024
    matrix on one thread, as a layer's work (or a tenth of it) comes between two
    collectives (:func:`gap_seconds` times them)."""
    a, b = torch.randn(256, 256), torch.randn(256, 1024)

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, b)
    return compute


def gap_seconds(multiplies: int = 3, repeats: int = 21) -> float:
    """Median seconds of the compute :func:`measure_gloo` runs before each call, on this
    thread (one thread, as each rank runs it)."""
    compute = _multiplies(multiplies)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compute()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compute()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], calls: int,
                 group_size: int, multiplies: int, queue) -> None:
    import torch.distributed as dist

    from shardwise.distributed.comm import objects as comm_objects
    from shardwise.distributed.env import quiet_flight_recorder
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    quiet_flight_recorder("gloo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = None  # the world
    if group_size < world:  # every rank creates every group (new_group is collective)
        groups = [dist.new_group(list(range(s, s + group_size)))
                  for s in range(0, world, group_size)]
        group = groups[rank // group_size]
    compute = _multiplies(multiplies)

    rows = []
    for nbytes in sizes:
        for kind, fn in _gloo_ops(rank, group_size, nbytes, group).items():
            comm_objects.barrier(label="calibrate")
            compute()
            fn()
            times, cpu = [], []
            for _ in range(calls):  # the same calls on every rank
                compute()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)  # this thread's and Gloo's threads'
            rows.append((kind, nbytes, _trimmed_mean(times), _trimmed_mean(cpu)))
    queue.put(rows)
    dist.destroy_process_group()


def _trimmed_mean(times: list[float]) -> float:
    """The mean of the middle 80% (a rank's waits are skewed: the mean is what a step
    pays, the extremes are other jobs' time slices)."""
    t = sorted(times)
    cut = len(t) // 10
    mid = t[cut:len(t) - cut] or t
    return sum(mid) / len(mid)


def _gloo_ops(rank: int, size: int, nbytes: int, group=None) -> dict:
    """The engine's collectives on payloads of ``nbytes`` over ``group`` (``size`` ranks,
    None: the world; see :func:`measure_gloo`)."""
    from shardwise.distributed import comm

    numel = max(1, nbytes // 4)
    shard, out = torch.ones(numel), torch.empty(numel * size)
    full, scratch = torch.ones(numel * size), torch.empty(numel * size)
    inbox = torch.empty(numel)
    # the neighbour inside the group (groups are blocks of consecutive, even-aligned ranks)
    peer = rank ^ 1 if (rank ^ 1) // size == rank // size and size > 1 else rank
    return {"all_gather": lambda: comm.all_gather_into_tensor(out, shard, group, label="cal"),
            "reduce_scatter": lambda: comm.reduce_scatter_tensor(shard, full, group,
                                                                label="cal", scratch=scratch),
            "all_reduce": lambda: comm.all_reduce(shard, group, label="cal"),
            "send_recv": lambda: _send_recv(shard, inbox, rank, peer)}


def _send_recv(t: torch.Tensor, inbox: torch.Tensor, rank: int, peer: int) -> None:
    """One message each way between ``rank`` and ``peer``, through shardwise's point-to-point
    layer (the one the pipeline executor uses)."""
    from shardwise.distributed.comm import p2p

    if peer == rank:
        return
    out, back = p2p.Message(t, peer, send=True, label="cal"), \
        p2p.Message(inbox, peer, send=False, label="cal")
    for w in p2p.batch_isend_irecv([out, back] if rank < peer else [back, out]):
        w.wait()


def measure_gloo(world: int, sizes: list[int], calls: int = 21, timeout_s: float = 300.0,
                 group: int | None = None, multiplies: int = 3
                 ) -> list[tuple[str, int, float, float]]:
    """(kind, payload bytes, seconds, CPU seconds) of the engine's collectives on ``world``
    Gloo ranks, each met after a few milliseconds of compute (see the module docstring;
    payload: the gathered shard, the reduced shard, the all-reduced tensor, one message
    each way). CPU seconds: the process time a rank spends per call, its own thread's and
    Gloo's ([Note: CPU ranks share the cores] in devices/cpu/step.py).

    Args:
        group: the ranks of each collective (None: all ``world``): the world splits into
            ``world / group`` groups of consecutive ranks, each running the same calls at
            the same time ([Note: crowded collectives] in devices/cpu/step.py).
        multiplies: the compute before each call, in :func:`_multiplies` units
            (:func:`gap_seconds` times it).

    Raises:
        ValueError: ``group`` not a divisor of ``world`` of at least 2.
    """
    group = world if group is None else group
    if group < 2 or world % group:
        raise ValueError(f"measure_gloo: group={group} must be at least 2 and divide "
                         f"world={world}")
    if multiplies < 1:
        raise ValueError(f"measure_gloo: multiplies={multiplies} must be at least 1")
    per_rank = run_local_ranks(_gloo_worker, world, (sizes, calls, group, multiplies),
                               "collective micro-benchmark", timeout_s)
    # every rank's mean wait: the one that arrives late waits little, the others more
    n = len(per_rank)
    return [(k, b, sum(r[i][2] for r in per_rank) / n, sum(r[i][3] for r in per_rank) / n)
            for i, (k, b, _, _) in enumerate(per_rank[0])]


def fit_collectives(rows_by_world: dict[int, list[tuple]]) -> dict[str, dict[int, Fit]]:
    """kind -> group size -> ``latency + bytes / bandwidth`` fit of the rows' seconds."""
    out: dict[str, dict[int, Fit]] = {}
    for world, rows in rows_by_world.items():
        for kind in sorted({r[0] for r in rows}):
            pts = [((1.0, float(r[1])), r[2]) for r in rows if r[0] == kind]
            out.setdefault(kind, {})[world] = Fit(*fit_terms(pts))
    return out


def cpu_fractions(rows_by_world: dict[int, list[tuple]]) -> dict[int, float]:
    """Group size -> the median over kinds and payloads of a collective's CPU seconds over
    its seconds (rows of :func:`measure_gloo`; groups without CPU times are left out)."""
    out = {}
    for world, rows in rows_by_world.items():
        ratios = sorted(r[3] / r[2] for r in rows if len(r) > 3 and r[2] > 0)
        if ratios:
            out[world] = min(1.0, ratios[len(ratios) // 2])
    return out
