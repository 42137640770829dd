"""``shardwise train --parallel.fault_tolerant true``: one command starts the quorum server
and every replica group, restarts a group that fails, and reports what committed.

    shardwise train --parallel.fault_tolerant true --parallel.dp_replicate 4 --nproc 4
    shardwise train --parallel.fault_tolerant true --parallel.dp_replicate 2 --nproc 4 \\
        --faults "kill:group=1:step=30;stop:group=0:step=60:seconds=6"

Each group is launched by PyTorch's own elastic agent (``elastic_launch``, what torchrun runs)
with its own rendezvous and ``max_restarts``: one lost rank takes its whole group down and the
agent starts the group again (the group is the unit of failure), while the other groups'
processes run on untouched. A group whose capacity changed (a fault with ``ranks=M``) is
launched again with M ranks (resize.py). The quorum server is torchft's lighthouse. Each
group's agent leads its own process group, so a ``stop`` fault freezes the group as a
whole, as a hung node would.

After the run, the groups' journals (``<log.dir>/ft/group<g>.jsonl``) are checked: every
committed step has one set of participants in every group that committed it, the steps run
1..N with none missing, and every group ends with the same state (a sha256 per rank). The
membership, ``<log.dir>/ft/membership.json``, replays the run's arithmetic without faults
(``SHARDWISE_FT_REPLAY``, used by bench/elastic_soak.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from shardwise.train.config import Config
from shardwise.train.faults import ENV_VAR, LOG_ENV, parse_faults
from shardwise.train.fault_tolerant.rejoin import LEFT_EXIT
from shardwise.train.fault_tolerant.resize import GROUP_RANKS_ENV, check_resize_faults
from shardwise.train.fault_tolerant.summary import print_summary, summarize
from shardwise.train.rank_server import start_rank_server, stop_rank_server

__all__ = ["run_fault_tolerant", "FaultToleranceError", "threads_per_rank", "launch_resizing"]


class FaultToleranceError(RuntimeError):
    """The run ended without what it promises: no group finished, steps missing, or the
    groups' final states differ (each named)."""


def _group_agent(cfg: Config, data: Any, group: int, size: int, lighthouse: str,
                 result_path: str) -> None:
    """The process that launches (and restarts) one group's ranks, leading their process
    group."""
    os.setpgrp()
    _die_with(os.getppid())
    os.environ.setdefault("RUST_LOG", "error")  # torchft's quorum client narrates each quorum
    # Every group's ranks share this machine's cores: each rank gets its share of all of
    # them (the trainer's own share is per group, which it thinks has the machine alone:
    # 4 groups of 1 rank on 2 cores ran 8 compute threads, and a restarting group's start
    # slowed the survivors' steps 2-10x). Set before any rank starts, so restarts get it too.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(cfg.parallel.nproc)))
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.train.fault_tolerant.replica import run_replica

    # The group's ranks, and every restart of them, fork from a server process that has
    # imported torch and shardwise once, instead of each starting an interpreter and
    # importing them again (~2 CPU-s a rank, taken from the survivors' cores on a shared
    # machine, and seconds more that the group is out).
    method = start_rank_server(run_replica)

    def launch(size: int, base: int, max_restarts: int) -> dict[str, Any]:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=size,
                              run_id=f"shardwise-ft{group}-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                              max_restarts=max_restarts, monitor_interval=0.05,
                              start_method=method)
        return elastic_launch(config, run_replica)(cfg, data, group, lighthouse, None, base)[0]

    out = launch_resizing(launch, size, cfg.parallel.ft_max_restarts)
    stop_rank_server()
    Path(result_path).write_text(json.dumps(out))
    if out.get("left"):  # gone for good (rejoin=never): neither failed nor finished
        sys.exit(LEFT_EXIT)


def launch_resizing(launch: Callable[[int, int, int], dict[str, Any]], size: int,
                    max_restarts: int) -> dict[str, Any]:
    """Launch a group (``launch(size, attempt_base, max_restarts)``: one elastic agent run,
    returning rank 0's result) until it ends at the size it has.

    A group resized by a fault returns ``{"resize": M, "attempt": a}`` from the attempt that
    saw it, before building anything: that attempt is launched again with M ranks (as
    torchrun ``--nnodes MIN:MAX`` rendezvouses again after a node loss). Its number goes on
    (the new launch's base is ``a``), and so does the restart budget: every launch's restarts
    count (``a`` of them so far), the relaunch itself does not.

    Returns:
        Rank 0's result of the last launch.
    """
    base = 0
    while "resize" in (out := launch(size, base, max_restarts - base)):
        base, size = out["attempt"], out["resize"]
    return out


def threads_per_rank(local_ranks: int) -> int:
    """Intra-op threads for each of ``local_ranks`` ranks sharing this machine's cores (the
    cores this process may run on), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def _die_with(parent: int) -> None:
    """Take this group down (the agent and every rank it leads) when the launcher is gone:
    the group leads its own process group, so a launcher killed or interrupted would
    otherwise leave it training, and restarting, alone."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="shardwise-ft-parent", daemon=True).start()


def _lighthouse(cfg: Config):
    from torchft._torchft import LighthouseServer

    # A group still heartbeating gets ft_timeout_s to join a quorum: with the heartbeat's 1 s,
    # a live group slowed down (a loaded machine, or serving a peer's healing) missed the
    # quorum, healed at the next one, which slowed its source in turn: under load the groups
    # took turns sitting out (a third of the steps lacked a group). A dead or frozen group
    # stops heartbeating, so it is not waited for past the heartbeat timeout either way.
    hb = cfg.parallel.ft_heartbeat_ms
    join_ms = max(hb, int(cfg.parallel.ft_timeout_s * 1000))
    return LighthouseServer(bind="[::]:0", min_replicas=cfg.parallel.ft_min_groups,
                            join_timeout_ms=join_ms, quorum_tick_ms=20, heartbeat_timeout_ms=hb)


def run_fault_tolerant(cfg: Config, data: Any) -> dict[str, Any]:
    """Train ``cfg`` as ``parallel.dp_replicate`` fault-tolerant replica groups of
    ``parallel.nproc / dp_replicate`` local ranks each (checks already done by preflight).

    Returns:
        The summary (also ``<log.dir>/ft/summary.json``).

    Raises:
        FaultToleranceError: every group failed, or the groups disagree at the end (named).
        ValueError: torchft missing, or ranks that do not split into equal groups.
    """
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError("parallel.fault_tolerant=true needs torchft (its quorum server and "
                         "process groups): pip install 'shardwise[ft]'") from None
    par = cfg.parallel
    if par.nproc % par.dp_replicate:
        raise ValueError(f"parallel.fault_tolerant: parallel.nproc={par.nproc} local ranks do "
                         f"not split into parallel.dp_replicate={par.dp_replicate} equal "
                         f"groups")
    groups, size = par.dp_replicate, par.nproc // par.dp_replicate
    ft_dir = Path(cfg.log.dir) / "ft"
    ft_dir.mkdir(parents=True, exist_ok=True)
    for old in ft_dir.glob("*"):
        old.unlink()
    fault_log = ft_dir / "faults.jsonl"
    os.environ[LOG_ENV] = str(fault_log)
    os.environ[GROUP_RANKS_ENV] = str(size)  # every group's original size, n0
    if os.environ.get(ENV_VAR):  # a typo, or ranks= not dividing n0, fails here
        check_resize_faults(parse_faults(os.environ[ENV_VAR]), size)
    server = None
    os.environ.setdefault("RUST_LOG", "error")
    lighthouse = par.ft_lighthouse
    if not lighthouse:
        server = _lighthouse(cfg)
        lighthouse = server.address()
    print(f"fault tolerance: {groups} replica groups of {size} rank{'s' * (size > 1)}, quorum "
          f"server {lighthouse}; a step commits with at least {par.ft_min_groups} group(s)",
          flush=True)
    ctx = multiprocessing.get_context("spawn")
    agents = {}
    start = time.time()
    try:
        for g in range(groups):
            p = ctx.Process(target=_group_agent, name=f"ft-group{g}",
                            args=(cfg, data, g, size, lighthouse, str(ft_dir / f"result{g}.json")))
            p.start()
            agents[g] = p
        _supervise(agents, grace_s=par.ft_timeout_s + 10.0)
    finally:
        for p in agents.values():
            if p.is_alive():
                _kill_group(p)
        if server is not None:
            server.shutdown()
    summary = summarize(ft_dir, cfg.train.steps, time.time() - start)
    print_summary(summary)
    if summary["problems"]:
        raise FaultToleranceError("fault tolerance: " + "; ".join(summary["problems"]))
    return summary


def _kill_group(p) -> None:
    """SIGKILL a group's agent and every rank it leads (also a frozen one)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.join(timeout=10)


def _supervise(agents: dict[int, Any], grace_s: float) -> None:
    """Wait for the groups; once one has finished, the others get ``grace_s`` to finish the
    same last step (a group frozen for good, or restarting after the end, is stopped)."""
    finished_at = None
    while any(p.is_alive() for p in agents.values()):
        time.sleep(0.1)
        if finished_at is None and any(p.exitcode == 0 for p in agents.values()):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            for g, p in agents.items():
                if p.is_alive():
                    print(f"fault tolerance: group {g} did not finish within {grace_s:.0f} s "
                          f"of the others: stopped", flush=True)
                    _kill_group(p)
