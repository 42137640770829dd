"""One benchmark job, as each rank runs it: build, wrap, warm up, time, measure.

``run_rank(spec)`` is what :func:`bench.launch.run_job` calls on every rank. The timed
step is forward + backward + optimizer step + zero_grad, preceded by a barrier that is not
timed; each rank returns its own step times and the aggregator takes, per step, the
slowest rank (the step is done when every rank is done). Each rank also returns the CPU
time its process (all threads, Gloo's included) spent in each step: unlike wall time it
hardly changes when other jobs load the machine, though it leaves out time spent waiting.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench import measure
from bench.frameworks import build_runner

__all__ = ["REGIMES", "make_batches", "run_rank", "model_config"]

# model: overrides of the "debug" config; batch x seq_len tokens per rank per step.
REGIMES = {
    "compute": {"model": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4,
                          "vocab_size": 8192, "ffn_dim": 1024},
                "batch": 4, "seq_len": 256},
    "overhead": {"model": {"dim": 256, "n_layers": 12, "n_heads": 8, "n_kv_heads": 4,
                           "vocab_size": 256},
                 "batch": 2, "seq_len": 32},
}


def model_config(regime: str):
    from shardwise.models import get_model_config
    return get_model_config("debug", **REGIMES[regime]["model"])


def make_batches(regime: str, n_steps: int, world_size: int, rank: int, seed: int = 0):
    """This rank's (inputs, targets) for each step: rank r of n takes sequences
    [r*B, (r+1)*B) of a global batch of n*B random sequences (same data for every framework)."""
    r = REGIMES[regime]
    b, t = r["batch"], r["seq_len"]
    vocab = r["model"]["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_steps, world_size * b, t + 1), generator=g)
    mine = tokens[:, rank * b:(rank + 1) * b]                        # (steps, B, T + 1)
    return [(mine[i, :, :-1].contiguous(), mine[i, :, 1:].contiguous()) for i in range(n_steps)]


def setup(spec: dict):
    """Build the model and wrap it; returns (runner, batches, memory notes)."""
    from shardwise.models import build_model
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = {"rss_entry": measure.rss_now(), "maxrss_entry": measure.ru_maxrss()}
    batches = make_batches(spec["regime"], spec["warmup"] + spec["steps"], world, rank)
    model = build_model(model_config(spec["regime"]), seed=0)
    mem["rss_after_build"] = measure.rss_now()
    runner = build_runner(spec["framework"], model, spec["opt"], REGIMES[spec["regime"]]["batch"])
    mem["rss_after_wrap"] = measure.rss_now()
    return runner, batches, mem


def _warmup(runner, batches, n: int) -> tuple[list[float], dict]:
    """Untimed steps; the last one is also where held tensor bytes are measured."""
    losses, held = [], {}
    for i in range(n):
        loss = runner.fwd_bwd(*batches[i])
        if i == n - 1:
            held["after_backward"], held["sources_after_backward"] = runner.held_bytes()
            held["engine_after_backward"] = runner.engine_report()
        runner.opt_step()
        if i == n - 1:
            held["after_step"], held["sources_after_step"] = runner.held_bytes()
            held["engine_after_step"] = runner.engine_report()
        losses.append(loss.item())
    held["model_state"] = measure.merge_max(held["after_backward"], held["after_step"])
    return losses, held


def _comm_stats_reset() -> None:
    import shardwise
    shardwise.reset_comm_stats()


def _comm_stats() -> dict:
    import shardwise
    return shardwise.comm_stats().as_dict()


def run_rank(spec: dict) -> dict:
    """Run one job on this rank; return its measurements (see the keys below)."""
    rank = dist.get_rank()
    runner, batches, mem = setup(spec)
    mem["hwm_reset"] = measure.reset_hwm()
    warm_losses, held = _warmup(runner, batches, spec["warmup"])

    _comm_stats_reset()
    dist.barrier()
    lo0 = measure.loopback_bytes()
    loop0 = time.perf_counter()
    times, cpu, losses = [], [], []
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = runner.fwd_bwd(*batches[i])
        runner.opt_step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.item())
    dist.barrier()
    loop_s = time.perf_counter() - loop0
    lo1 = measure.loopback_bytes()
    comm = _comm_stats()

    mem["ru_maxrss"] = measure.ru_maxrss()
    mem["rss_train_peak"] = measure.rss_hwm()
    return {
        "rank": rank, "framework": spec["framework"], "step_s": times, "cpu_s": cpu,
        "loop_s": loop_s,
        "losses": warm_losses + losses, "memory": mem, "held": held,
        "lo_tx_bytes": lo1[1] - lo0[1], "lo_rx_bytes": lo1[0] - lo0[0],
        "comm_stats": comm, "shardwise_file": _shardwise_file(),
    }


def _shardwise_file() -> str:
    import shardwise
    return shardwise.__file__
