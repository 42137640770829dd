"""One rank of one replica group under ``parallel.fault_tolerant``: everything built before
the first step (the group's model, optimizer, data, torchft's manager on a store of this
attempt, a checkpoint to resume), then :class:`~shardwise.train.fault_tolerant.loop.
ReplicaSteps`, then the final state's digest for the launcher's check.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from shardwise.distributed import env as dist_env
from shardwise.train.config import Config
from shardwise.train.faults import GROUP_ENV, FaultPlan
from shardwise.train.fault_tolerant.combine import next_lineage
from shardwise.train.fault_tolerant.digest import group_state_digest
from shardwise.train.fault_tolerant.pieces import holding_of
from shardwise.train.fault_tolerant.wide import WideGroup, replica_id
from shardwise.train.fault_tolerant.state import CheckpointSaver, HealableState, Journal

__all__ = ["REPLAY_ENV", "run_replica", "group_config"]

#: A membership script (JSON ``{step: [group ids]}``): the groups whose gradients count at
#: each step come from it instead of the quorum (the replay reference of bench/elastic_soak.py).
REPLAY_ENV = "SHARDWISE_FT_REPLAY"

#: Steps in a row that may fail to commit before this rank gives up (raises): each one lost a
#: group; this many in a row is a fault that healing does not cure.
_MAX_FAILED_STEPS = 20


def group_config(cfg: Config, group_size: int) -> Config:
    """The config one group trains with: one replica, sharded over the group's ranks."""
    import dataclasses

    par = dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=group_size)
    return dataclasses.replace(cfg, parallel=par)


def _manager_pg():
    """The process group torchft's manager keeps: one that does nothing, since the combine
    and the healing run over the wide group ([Note: one group across all ranks] in wide.py);
    the manager keeps the quorum, the step count and the commit vote."""
    from torchft.process_group import ProcessGroupDummy

    return ProcessGroupDummy(0, 1)


def run_replica(cfg: Config, data: Any, group: int, lighthouse: str,
                env: dist_env.DistEnv | None = None) -> dict[str, Any] | None:
    """Train as one rank of replica group ``group`` (launched by
    :func:`shardwise.train.fault_tolerant.launch.run_fault_tolerant`, or by torchrun with the
    same environment on a cluster: docs/failures.md).

    Args:
        env: this rank's place in its group (default: joined here, from the torchrun
            environment of the group's own launch).

    Returns:
        On the group's rank 0: ``{"group", "step", "digests", "healed", "pid"}``; else None.
    """
    from shardwise.data import TokenLoader
    from shardwise.train.fault_tolerant.loop import ReplicaSteps
    from shardwise.train.parallelize import build_loss_scaler, build_parallel_model
    from shardwise.train.preflight import build_model_config
    from shardwise.train.trainer import build_env, build_lr_schedule, build_optimizer

    launched = time.time()  # the process is up; "start" below is when it can train
    os.environ[GROUP_ENV] = str(group)
    _quiet_torchft()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not _may_rejoin(cfg, group, attempt):
        return ({"group": group, "left": True, "attempt": attempt, "pid": os.getpid()}
                if int(os.environ.get("RANK", "0")) == 0 else None)
    env = env if env is not None else build_env(cfg)
    par = cfg.parallel
    groups, size = par.dp_replicate, env.world_size
    gcfg = group_config(cfg, size)
    try:
        model = build_parallel_model(gcfg, build_model_config(gcfg, data.vocab_size), env)
        optimizer = build_optimizer(model, cfg.optim)
        schedule = build_lr_schedule(optimizer, cfg.optim, cfg.train.steps)
        scaler = build_loss_scaler(gcfg)
        data_rank = group * size + env.rank
        loader = TokenLoader(data.train_ids, seq_len=cfg.data.seq_len,
                             batch_size=cfg.train.batch_size, rank=data_rank,
                             world_size=groups * size, seed=cfg.data.seed)
        healable = HealableState(model, optimizer, schedule, loader)
        stateful = {"schedule": schedule, "scaler": scaler, "loader": loader}
        ckpt, done = _resume(gcfg, model, optimizer, stateful, env)
        manager, store = _build_manager(par, env, group, lighthouse,  # noqa: F841 - alive
                                        _manager_pg())
        holding = holding_of(model, group, env.rank, size)
        wide = WideGroup(manager, holding, env.device, par.ft_timeout_s)
        if done:  # every group that resumes from the same checkpoint holds the same history
            manager.load_state_dict({"step": done, "batches_committed": 0})
            healable.lineage = next_lineage(0, done, [])
        script = _replay_script()
        faults = FaultPlan.from_env(env.rank, cfg.train.steps)
        if faults is not None:
            faults.arm(model)
        journal = Journal(Path(cfg.log.dir) / "ft" / f"group{group}.jsonl"
                           if env.is_main else None)
        journal.write(event="start", group=group, pid=os.getpid(), attempt=attempt,
                      time=time.time(), launched=launched, threads=torch.get_num_threads())
        try:
            ReplicaSteps(cfg, gcfg, env, group, model, optimizer, schedule, scaler, loader,
                         data.val_ids, manager, wide, healable, faults, journal,
                         CheckpointSaver(ckpt, cfg, group, model, optimizer, stateful),
                         script).run()
            ckpt.close()
            digests = [group_state_digest(model, optimizer, holding)]
            record = {"group": group, "step": manager.current_step(), "digests": digests,
                      "healed": healable.healed, "pid": os.getpid(), "attempt": attempt,
                      "lineage": healable.lineage}
            journal.write(event="finish", time=time.time(), **record)
        finally:
            journal.close()
            if faults is not None:
                faults.disarm()
            manager.shutdown(wait=False)
        return record if env.is_main else None
    finally:
        dist_env.destroy()


def _may_rejoin(cfg: Config, group: int, attempt: int) -> bool:
    """Hold a restarted group until its fault's ``rejoin`` step, before it builds anything or
    joins a process group (shardwise/train/fault_tolerant/rejoin.py). False: it leaves the run
    for good (its rank 0 journals when)."""
    from shardwise.train.fault_tolerant.rejoin import hold_until_rejoin

    if hold_until_rejoin(group, attempt):
        return True
    if int(os.environ.get("RANK", "0")) == 0:
        journal = Journal(Path(cfg.log.dir) / "ft" / f"group{group}.jsonl")
        journal.write(event="left", group=group, attempt=attempt, pid=os.getpid(),
                      time=time.time())
        journal.close()
        print(f"group {group} left the run for good (its fault said rejoin=never, or the run "
              f"ended first); the others finish without it", flush=True)
    return False


def _build_manager(par: Any, env: dist_env.DistEnv, group: int, lighthouse: str,
                   pg: Any) -> tuple[Any, Any]:
    """torchft's manager of this rank: the quorum of every step (synchronous, so a group
    that heals does so before its forward), on a store of this attempt.

    Returns:
        ``(the manager, the store rank 0 serves: keep it alive)``.
    """
    from torchft import Manager

    timeout = timedelta(seconds=par.ft_timeout_s)
    store, store_addr, store_port = _attempt_store(env, timeout)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=par.ft_min_groups,
        use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=max(60.0, 6 * par.ft_timeout_s)),
        connect_timeout=timeout, rank=env.rank, world_size=env.world_size,
        store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse,
        replica_id=replica_id(group, env.world_size),
        heartbeat_interval=timedelta(milliseconds=100), max_retries=_MAX_FAILED_STEPS)
    return manager, store


def _attempt_store(env, timeout: timedelta) -> tuple[Any, str, int]:
    """A store of this attempt's own for torchft's manager, served by the group's rank 0.

    torchft publishes the group's manager address under a fixed key of the store it is
    given; torchrun's agent store outlives a restart, so a restarted rank 1 could read the
    address of the dead rank 0 of the attempt before and fail to connect (seen in 1 of 5
    runs; the same trap as [Note: restart attempts] in shardwise/distributed/env.py). Rank 0
    starts a fresh store and publishes its address under a key of this attempt.

    Returns:
        ``(the store rank 0 serves, or None elsewhere; its host; its port)``.
    """
    import socket

    from torch.distributed import PrefixStore, TCPStore

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=max(60.0, timeout.total_seconds())))
    keys = PrefixStore(f"shardwise/ft/attempt_{attempt}", agent)
    served = None
    if env.rank == 0:
        served = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        keys.set("manager_store", f"{socket.gethostname()}:{served.port}")
    host, port = keys.get("manager_store").decode().rsplit(":", 1)
    return served, host, int(port)


def _resume(gcfg: Config, model, optimizer, stateful: dict[str, Any], env) -> tuple[Any, int]:
    """The group's Checkpointer, and the step resumed from. A restarted group always looks
    for the run's latest checkpoint: it heals from a live group when there is one, and when
    every group was lost at once the checkpoint is what is left (the last line of defence)."""
    import dataclasses

    from shardwise.train.trainer import resume_or_import

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        gcfg = dataclasses.replace(gcfg, checkpoint=dataclasses.replace(
            gcfg.checkpoint, resume="auto"))
    ckpt, done, note = resume_or_import(gcfg, model, optimizer, stateful, env)
    if note and env.is_main:
        print(note, flush=True)
    return ckpt, done


def _quiet_torchft() -> None:
    """torchft narrates every quorum, reconfiguration and checkpoint request; the groups'
    own lines (and ``<log.dir>/ft``) say what happened, its errors still print."""
    import http.server
    import logging
    import warnings

    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # The healing transport's HTTP server logs each request to stderr; nothing else in a
    # rank serves HTTP.
    http.server.BaseHTTPRequestHandler.log_message = lambda self, *args: None
    # Received checkpoints are read-only buffers; the state is copied into place at once.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _replay_script() -> dict[int, list[int]] | None:
    path = os.environ.get(REPLAY_ENV)
    if not path:
        return None
    return {int(k): v for k, v in json.loads(Path(path).read_text()).items()}


