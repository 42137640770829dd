"""Run training however the process was started: local ranks, torchrun, or SLURM.

    shardwise train                                    # launches parallel.nproc local ranks
    shardwise train --nproc 1                          # one rank, in this process
    torchrun --nproc_per_node 4 -m shardwise.train.cli train    # each rank runs in-process
    srun shardwise train                               # SLURM: same, ranks from SLURM_*

Local ranks are started with PyTorch's own launcher API (``torch.distributed.launcher.api.
elastic_launch``, what torchrun uses inside), never by hand. In that mode every check on user
input runs once, in this process, before any rank exists (:func:`shardwise.train.preflight.
preflight`), and the prepared tokens are handed to the ranks. Under torchrun / SLURM each
rank runs the checks itself and the ranks agree on the outcome before training starts.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any


from shardwise.distributed.comm import objects as comm_objects
from shardwise.distributed import env as dist_env
from shardwise.train.config import Config, resolve_world
from shardwise.train.doctor import check_ranks
from shardwise.train.preflight import TokenData, announce, preflight, save_tokenizer
from shardwise.train.rank_server import run_rank, start_rank_server, stop_rank_server
from shardwise.train.replan import train_planned
from shardwise.train.trainer import build_env

__all__ = ["RankFailure", "launch_local", "run_training"]


class RankFailure(RuntimeError):
    """A launched rank failed; the message names the rank, its exit code and its error.

    Attributes:
        failures: ``{global_rank: (exit_code, error message)}``.
    """

    def __init__(self, failures: dict[int, tuple[int, str]]) -> None:
        self.failures = dict(sorted(failures.items()))
        parts, reports = [], []
        for rank, (code, message) in self.failures.items():
            if message.startswith("shardwise watchdog:"):
                if message not in reports:  # every rank raises the same report: show it once
                    reports.append(message)
            else:
                parts.append(f"rank {rank} failed (exit code {code}): {message}")
        super().__init__("\n".join(["; ".join(parts)] * bool(parts) + reports))


def _failure_message(failure: Any) -> str:
    """The one-line error of an elastic ``ProcessFailure`` (the exception, or the signal)."""
    message = failure.message
    if isinstance(message, dict):  # the error file written by the worker's @record wrapper
        message = message.get("message", str(message))
    if failure.exitcode < 0 or not message or "To enable traceback" in str(message):
        return f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else \
            "exited without an error report (see the rank's output above)"
    text = str(message).strip()
    if text.startswith("CollectiveError: shardwise watchdog:"):  # the whole report
        return text.removeprefix("CollectiveError: ")
    return text.splitlines()[-1]


def launch_local(fn: Callable[..., Any], nproc: int, args: Sequence[Any] = (),
                 monitor_interval_s: float = 0.1) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` new local processes that form one c10d job.

    Each process gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT, TORCHELASTIC_RUN_ID), so :func:`shardwise.distributed.env.init` sees a
    torchrun launch. The rendezvous listens on a port the OS picks; no restarts.

    Args:
        fn: a module-level (picklable) function; processes fork from a server that has
            imported its module once (:mod:`shardwise.train.rank_server`), or are started
            with "spawn" where this process already runs a forkserver of its own.
        nproc: number of local ranks (>= 1).
        args: positional arguments for ``fn``, pickled to every rank (tensors travel through
            shared memory).
        monitor_interval_s: how often the launcher polls its ranks, in seconds.

    Returns:
        ``{rank: return value of fn}``.

    Raises:
        RankFailure: naming each failed rank, its exit code and its exception.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    method = start_rank_server(fn)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"shardwise-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=monitor_interval_s, start_method=method)
    try:
        return elastic_launch(config, run_rank)(fn, *args)
    except ChildFailedError as exc:
        raise RankFailure({rank: (f.exitcode, _failure_message(f))
                           for rank, f in exc.failures.items()}) from None
    finally:
        stop_rank_server()


def _rank_main(cfg: Config, data: TokenData) -> dict[str, Any] | None:
    """Entry point of one locally launched rank (checks already done by the launcher)."""
    env = build_env(cfg)
    try:
        check_ranks(cfg, env)
        return train_planned(cfg, data, env)
    finally:
        dist_env.destroy()


def _agree_on_preflight(error: str | None, env: dist_env.DistEnv,
                        log_dir: str | None = None) -> str | None:
    """Share each rank's preflight outcome; raise the same ValueError everywhere if any failed.

    Returns:
        Rank 0's ``log_dir``: the folder every rank writes to (rank 0 alone writes it, and
        only its view of which folders hold earlier runs counts).
    """
    outcomes = comm_objects.all_gather_object((error, log_dir), label="preflight.outcomes")
    errors = [e for e, _ in outcomes]
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        same_everywhere = len(failed) == env.world_size and len(set(errors)) == 1
        raise ValueError(message if same_everywhere else f"on rank {rank}: {message}")
    return outcomes[0][1]


def _replica_here(cfg: Config) -> dict[str, Any] | None:
    """This process is one rank of one fault-tolerant replica group that torchrun (or SLURM)
    started: the group id comes from ``$SHARDWISE_FT_GROUP``, the quorum server from
    ``parallel.ft_lighthouse`` (docs/failures.md, "On a cluster")."""
    import os

    from shardwise.train.faults import GROUP_ENV
    from shardwise.train.fault_tolerant.replica import run_replica

    par = cfg.parallel
    group = os.environ.get(GROUP_ENV, "")
    if not group.isdigit() or int(group) >= par.dp_replicate:
        raise ValueError(f"parallel.fault_tolerant under a launcher: set {GROUP_ENV} to this "
                         f"replica group's id in 0..{par.dp_replicate - 1} (one launch per "
                         f"group), got {group!r}")
    if not par.ft_lighthouse:
        raise ValueError("parallel.fault_tolerant under a launcher: set parallel.ft_lighthouse "
                         "to the address of the job's quorum server (start one with "
                         "`torchft_lighthouse --min_replicas 1`), got ''")
    import tempfile
    from pathlib import Path

    env = build_env(cfg)
    world = par.dp_replicate * env.world_size
    # Every group, and every restart of one, runs the checks; the run folder they share
    # already holds this run once the first group started, which is not an earlier run.
    run_dir = cfg.log.dir
    with tempfile.TemporaryDirectory() as scratch:
        probe = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, dir=scratch))
        cfg, data = preflight(probe, world, verify_checkpoint=False)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, dir=run_dir))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if env.is_main and group == "0":
        save_tokenizer(cfg, data)
    return run_replica(cfg, data, int(group), par.ft_lighthouse, env)


def _train_here(cfg: Config) -> dict[str, Any] | None:
    """This process is one rank (torchrun, SLURM, or a world of one)."""
    if cfg.parallel.fault_tolerant:
        return _replica_here(cfg)
    env = build_env(cfg)
    try:
        check_ranks(cfg, env)  # another version or config on some rank: named, before all else
        requested, error, data = cfg, None, None
        try:
            cfg, data = preflight(cfg, env.world_size, verify_checkpoint=False)
        except ValueError as exc:
            error = str(exc)
        log_dir = _agree_on_preflight(error, env, cfg.log.dir)
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, dir=log_dir))
        if env.is_main:
            announce(cfg, requested)
            save_tokenizer(cfg, data)
        return train_planned(cfg, data, env)
    finally:
        dist_env.destroy()


def _doctor_rank(cfg: Config) -> dict[str, Any] | None:
    """One rank of ``shardwise doctor``: the outcome on rank 0, None elsewhere."""
    env = build_env(cfg)
    try:
        outcome = check_ranks(cfg, env)
        return outcome if env.is_main else None
    finally:
        dist_env.destroy()


def run_doctor(cfg: Config) -> dict[str, Any] | None:
    """``shardwise doctor``: :func:`shardwise.train.doctor.check_ranks` on the job's ranks.

    Returns:
        Rank 0's outcome (reports and the test all-reduce) where this process is (or launched)
        rank 0, else None.

    Raises:
        ValueError: ranks that differ (named), or a wrong test all-reduce.
        RankFailure: a locally launched rank failed.
    """
    if dist_env.detect_launcher() == "single" and cfg.parallel.nproc > 1:
        cfg = resolve_world(cfg, cfg.parallel.nproc)
        try:
            return launch_local(_doctor_rank, cfg.parallel.nproc, (cfg,))[0]
        except RankFailure as exc:  # the same mismatch on every rank: say it once
            messages = {m for _, m in exc.failures.values()}
            if len(messages) == 1 and next(iter(messages)).startswith("ValueError: "):
                raise ValueError(next(iter(messages)).removeprefix("ValueError: ")) from None
            raise
    return _doctor_rank(cfg)


def run_training(cfg: Config) -> dict[str, Any] | None:
    """Train with ``cfg``, launching local ranks unless a launcher already started this rank.

    Args:
        cfg: a validated config (:func:`shardwise.train.config.load_config`).

    Returns:
        The run summary where this process is (or launched) rank 0, else None.

    Raises:
        ValueError: a check on user input failed (before any rank trained).
        RankFailure: a locally launched rank failed, named with its error.
    """
    if dist_env.detect_launcher() == "single" and (cfg.parallel.nproc > 1
                                                   or cfg.parallel.fault_tolerant):
        requested = cfg
        cfg, data = preflight(cfg, cfg.parallel.nproc)
        announce(cfg, requested)
        save_tokenizer(cfg, data)
        if cfg.parallel.fault_tolerant:
            from shardwise.train.fault_tolerant.launch import run_fault_tolerant

            return run_fault_tolerant(cfg, data)
        return launch_local(_rank_main, cfg.parallel.nproc, (cfg, data))[0]
    return run_rank(_train_here, cfg)  # [Note: the launcher names a dead rank]
