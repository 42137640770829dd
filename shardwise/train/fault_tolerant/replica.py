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
from shardwise.train.attempts import ATTEMPT_BASE_ENV, ft_attempt
from shardwise.train.config import Config
from shardwise.train.faults import GROUP_ENV, FaultPlan
from shardwise.train.fault_tolerant.combine import next_lineage
from shardwise.train.fault_tolerant.digest import group_state_digest
from shardwise.train.fault_tolerant.pieces import holding_of
from shardwise.train.fault_tolerant.resize import (GroupShare, check_group_size, group_ranks,
                                                   resize_due)
from shardwise.train.fault_tolerant.wide import WideGroup, replica_id
from shardwise.train.fault_tolerant.state import CheckpointSaver, HealableState, Journal

__all__ = ["REPLAY_ENV", "run_replica", "group_config"]

#: A membership script (JSON ``{step: [group ids]}``): the groups whose gradients count at
#: each step come from it instead of the quorum (the replay reference of bench/elastic_soak.py).
REPLAY_ENV = "SHARDWISE_FT_REPLAY"

#: Steps in a row that may fail to commit before this rank gives up (raises): each one lost a
#: group; this many in a row is a fault that healing does not cure.
_MAX_FAILED_STEPS = 20


def group_config(cfg: Config, model_cfg: Any, ranks: int, n0: int) -> Config:
    """The config one group of ``ranks`` ranks (``n0`` originally) trains with: one replica,
    sharded over the group's ranks, the group's tokens per step those of its ``n0`` data
    ranks; its layout planned for these ranks with ``parallel.plan = "auto"``
    (:func:`shardwise.train.plan_layout.plan_group`)."""
    from shardwise.train.plan_layout import plan_group

    return plan_group(cfg, model_cfg, ranks, n0)


def _manager_pg():
    """The process group torchft's manager keeps: one that does nothing, since the combine
    and the healing run over the wide group ([Note: one group across all ranks] in wide.py);
    the manager keeps the quorum, the step count and the commit vote."""
    from torchft.process_group import ProcessGroupDummy

    return ProcessGroupDummy(0, 1)


def run_replica(cfg: Config, data: Any, group: int, lighthouse: str,
                env: dist_env.DistEnv | None = None,
                attempt_base: int | None = None) -> dict[str, Any] | None:
    """Train as one rank of replica group ``group`` (launched by
    :func:`shardwise.train.fault_tolerant.launch.run_fault_tolerant`, or by torchrun with the
    same environment on a cluster: docs/failures.md).

    Args:
        env: this rank's place in its group (default: joined here, from the torchrun
            environment of the group's own launch).
        attempt_base: attempts of this group before its agent's current launch (the
            fault-tolerant launcher's; shardwise/train/attempts.py).

    Returns:
        On the group's rank 0: ``{"group", "step", "digests", "healed", "pid"}``, or
        ``{"resize": M, ...}`` when this attempt must run with M ranks instead (returned
        before anything is built: the agent relaunches the group); else None.
    """
    from shardwise.train.fault_tolerant.loop import ReplicaSteps
    from shardwise.train.parallelize import build_loss_scaler, build_parallel_model
    from shardwise.train.preflight import build_model_config
    from shardwise.train.trainer import build_env, build_lr_schedule, build_optimizer

    launched = time.time()  # the process is up; "start" below is when it can train
    os.environ[GROUP_ENV] = str(group)
    if attempt_base is not None:
        os.environ[ATTEMPT_BASE_ENV] = str(attempt_base)
    _quiet_torchft()
    attempt = ft_attempt()
    main = int(os.environ.get("RANK", "0")) == 0
    resize = resize_due(group, attempt, env.world_size if env is not None
                        else int(os.environ.get("WORLD_SIZE", "1")))
    if resize is not None:  # every rank returns at once; the agent relaunches M of them
        return ({"group": group, "resize": resize, "attempt": attempt, "pid": os.getpid()}
                if main else None)
    if not _may_rejoin(cfg, group, attempt):
        return ({"group": group, "left": True, "attempt": attempt, "pid": os.getpid()}
                if main else None)
    env = env if env is not None else build_env(cfg)
    par = cfg.parallel
    try:
        n0 = group_ranks(env.world_size)
        check_group_size(env.world_size, n0)
        share = GroupShare(group, par.dp_replicate, n0, env.world_size, env.rank)
        model_cfg = build_model_config(cfg, data.vocab_size)
        gcfg = group_config(cfg, model_cfg, env.world_size, n0)
        model = build_parallel_model(gcfg, model_cfg, env)
        optimizer = build_optimizer(model, cfg.optim)
        schedule = build_lr_schedule(optimizer, cfg.optim, cfg.train.steps)
        scaler = build_loss_scaler(gcfg)
        loader = share.loader(data.train_ids, cfg, gcfg)
        healable = HealableState(model, optimizer, schedule, loader)
        stateful = {"schedule": schedule, "scaler": scaler, "loader": loader}
        ckpt, done = _resume(gcfg, model, optimizer, stateful, env)
        manager, store = _build_manager(par, env, group, lighthouse,  # noqa: F841 - alive
                                        _manager_pg())
        holding = holding_of(model, group, env.rank, env.world_size)
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
        layout = _announce_layout(gcfg, share, env)
        journal.write(event="start", group=group, pid=os.getpid(), attempt=attempt,
                      time=time.time(), launched=launched, threads=torch.get_num_threads(),
                      ranks=env.world_size, layout=layout)
        try:
            ReplicaSteps(cfg, gcfg, env, group, model, optimizer, schedule, scaler, loader,
                         data.val_ids, manager, wide, healable, faults, journal,
                         CheckpointSaver(ckpt, cfg, group, model, optimizer, stateful),
                         script, share=share).run()
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


def _announce_layout(gcfg: Config, share: GroupShare, env: dist_env.DistEnv) -> str:
    """The group's layout in a few words (journalled in its ``start`` record); its rank 0
    prints it when it was planned or the group was resized."""
    from shardwise.train.plan_layout import describe, layout_of

    layout = describe(layout_of(gcfg))
    if env.is_main and (gcfg.parallel.plan == "auto" or share.ranks != share.n0):
        print(f"group {share.group}: {share.ranks} of {share.n0} ranks, each taking "
              f"{share.per_rank} data rank(s); layout {layout}", flush=True)
    return layout


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

    attempt = ft_attempt()
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

    if ft_attempt() > 0:
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


