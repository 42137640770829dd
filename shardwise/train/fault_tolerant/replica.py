"""One rank of one replica group under ``parallel.fault_tolerant``: the training loop with a
quorum per step (torchft's ``Manager``), the deterministic combine across groups, healing
from a live peer, and the group's record of what it committed.

    start_quorum()  -> the groups alive now; a group behind them heals first (state below)
    forward/backward over this group's slice of the step's batch (ZeRO inside the group)
    combine         -> the mean of the participants' gradients ([Note: a deterministic
                       combine across groups]); a group lost here fails the step everywhere
    should_commit() -> every group that finished the step agrees; the update runs only then

[Note: what a step is under fault tolerance] Step ``s`` is the ``s``-th committed update.
Its batch is the slices of the global batch of the data stream's position after ``s - 1``
steps that belong to the groups in its quorum (a group's slice: its data ranks'
sequences); a lost group's slice of that step is not trained on, and the step's gradient is
the mean over the groups that took part (equal tokens each). A step that does not commit
(a group was lost during it) changes nothing: the data position is rewound and the same
step is computed again by the groups in the next quorum. So no committed step is lost or
counted twice, and the learning-rate schedule, the data position and the random seed of a
step depend on ``s`` only.

The state a rejoining group heals from a peer (the same rank of a live group: the layout
inside every group is the same) is everything that step ``s`` depends on: the parameter
shards and buffers, the optimizer state, the schedule's position, the data position, and
the step itself (the random state is seeded from the step, so it follows).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from shardwise.distributed import env as dist_env
from shardwise.distributed.comm import objects as comm_objects
from shardwise.shard import clip_grads_with_norm_
from shardwise.train.config import Config
from shardwise.train.faults import GROUP_ENV, FaultPlan
from shardwise.train.fault_tolerant.combine import combine_gradients, next_lineage

__all__ = ["REPLAY_ENV", "run_replica", "state_digest", "group_config"]

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


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over this rank's parameter shards, buffers and optimizer state (bitwise)."""
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    for p in model.parameters():
        add(p)
    for b in model.buffers():
        add(b)
    for state in optimizer.state_dict()["state"].values():
        for key in sorted(state):
            v = state[key]
            add(v if torch.is_tensor(v) else torch.tensor(float(v)))
    return h.hexdigest()


class _Healable:
    """What a rejoining group copies from a peer ([Note: what a step is under fault
    tolerance]): registered with the manager, sent and loaded whole."""

    def __init__(self, model, optimizer, schedule, loader) -> None:
        self.model, self.optimizer, self.schedule, self.loader = model, optimizer, schedule, loader
        self.healed = 0
        self.lineage = 0  # [Note: lineages] in combine.py

    def state_dict(self) -> dict[str, Any]:
        return {"params": [p.detach() for p in self.model.parameters()],
                "buffers": [b.detach() for b in self.model.buffers()],
                "optimizer": self.optimizer.state_dict(),
                "schedule": {k: v for k, v in self.schedule.state_dict().items()
                             if k != "lr_lambdas"},
                "loader": self.loader.state_dict(), "lineage": self.lineage}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params, buffers = list(self.model.parameters()), list(self.model.buffers())
        if len(state["params"]) != len(params) or len(state["buffers"]) != len(buffers):
            raise ValueError(f"healing: the peer sent {len(state['params'])} parameters and "
                             f"{len(state['buffers'])} buffers, this group has {len(params)} "
                             f"and {len(buffers)}: the groups' layouts differ")
        with torch.no_grad():
            for mine, theirs in zip(params + buffers, state["params"] + state["buffers"]):
                mine.copy_(theirs)
        self.optimizer.load_state_dict(state["optimizer"])
        sched = self.schedule.state_dict()
        sched.update(state["schedule"])
        self.schedule.load_state_dict(sched)
        self.loader.load_state_dict(state["loader"])
        self.lineage = int(state["lineage"])
        self.healed += 1


def _step_seed(seed: int, step: int, data_rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + data_rank) % (2**63 - 1)


class _Journal:
    """The group's record (rank 0 writes it): one JSON line per attempted step, flushed, so
    the launcher can tell what committed even when this process is killed next."""

    def __init__(self, path: Path | None) -> None:
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _build_pg(env: dist_env.DistEnv, timeout_s: float):
    """The cross-group process group torchft reconfigures at every quorum change."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=timeout_s)
    return ProcessGroupNCCL(timeout=timeout) if env.device.type == "cuda" else \
        ProcessGroupGloo(timeout=timeout)


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
    from torchft import Manager

    from shardwise.data import TokenLoader
    from shardwise.train.parallelize import build_loss_scaler, build_parallel_model
    from shardwise.train.pipeline import grad_norm
    from shardwise.train.preflight import build_model_config
    from shardwise.train.step import _forward_backward
    from shardwise.train.stats import gather_stats
    from shardwise.train.trainer import build_env, build_lr_schedule, build_optimizer

    os.environ[GROUP_ENV] = str(group)
    _quiet_torchft()
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
        params = [p for p in model.parameters() if p.requires_grad]
        healable = _Healable(model, optimizer, schedule, loader)
        timeout = timedelta(seconds=par.ft_timeout_s)
        pg = _build_pg(env, par.ft_timeout_s)
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None,
            min_replica_size=par.ft_min_groups, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=max(60.0, 6 * par.ft_timeout_s)),
            connect_timeout=timeout, rank=env.rank, world_size=size,
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse, replica_id=f"shardwise_group{group}",
            heartbeat_interval=timedelta(milliseconds=100), max_retries=_MAX_FAILED_STEPS)
        manager.register_state_dict_fn("train", healable.load_state_dict, healable.state_dict)
        script = _replay_script()
        faults = FaultPlan.from_env(env.rank, cfg.train.steps)
        if faults is not None:
            faults.arm(model)
        journal = _Journal(Path(cfg.log.dir) / "ft" / f"group{group}.jsonl"
                           if env.is_main else None)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        journal.write(event="start", group=group, pid=os.getpid(), attempt=attempt,
                      time=time.time())
        try:
            _loop(cfg, gcfg, env, group, model, optimizer, schedule, scaler, loader, params,
                  manager, pg, healable, faults, journal, script, _forward_backward,
                  grad_norm, gather_stats)
            digest = state_digest(model, optimizer)
            digests = comm_objects.all_gather_object(digest, label="ft.digest")
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


def _membership_change(before: list[int], now: list[int], failed: list[tuple[int, str]],
                       par: Any) -> dict[str, Any]:
    """Which groups left and joined since the last committed step, and why they were
    dropped: the collective they did not answer in, or their silence to the quorum server."""
    left = sorted(set(before) - set(now))
    joined = sorted(set(now) - set(before))
    if failed:
        step, error = failed[-1]
        why = (f"they did not answer the combine across groups (all-gather of the gradients) "
               f"of step {step} within parallel.ft_timeout_s={par.ft_timeout_s:g} s or died "
               f"during it ({error[:160]})")
    else:
        why = (f"no heartbeat to the quorum server for parallel.ft_heartbeat_ms="
               f"{par.ft_heartbeat_ms} ms before the quorum of this step")
    return {"left": left, "joined": joined, "why": why if left else ""}


class _PeerLost(RuntimeError):
    """The combine across groups failed: a group died or froze during it."""


def _all_gather(pg, world: int):
    """``flat`` from the same rank of every group in the quorum, through torchft's group."""
    from torch._C._distributed_c10d import AllgatherOptions

    def gather(flat: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(flat) for _ in range(world)]
        try:
            pg.allgather([out], [flat], AllgatherOptions()).wait()
        except Exception as exc:  # a peer lost or frozen mid-combine: named, not a crash
            raise _PeerLost(f"{type(exc).__name__}: {exc}") from exc
        return out

    return gather


def _loop(cfg, gcfg, env, group, model, optimizer, schedule, scaler, loader, params, manager,
          pg, healable, faults, journal, script, forward_backward, grad_norm, gather_stats) -> None:
    steps, seed = cfg.train.steps, cfg.data.seed
    tokens_per_group = env.world_size * cfg.train.batch_size * cfg.train.grad_accum \
        * cfg.data.seq_len
    last_ids: list[int] | None = None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    failed: list[tuple[int, str]] = []  # steps that did not commit since the last one that did
    while manager.current_step() < steps:
        start = time.perf_counter()
        healed_before = healable.healed
        manager.start_quorum()  # heals this group first when it is behind
        step = manager.current_step() + 1
        if healable.healed != healed_before:
            journal.write(event="healed", step=step, time=time.time())
        torch.manual_seed(_step_seed(seed, step, group * env.world_size + env.rank))
        position = loader.state_dict()
        if faults is not None:
            faults.at_step(step)
        lr = optimizer.param_groups[0]["lr"]
        loss_sum, _ = forward_backward(model, loader, gcfg, env, scaler, None)
        ids: list[int] = []
        error = None
        if faults is not None:
            faults.fire("reduction")
        lineage = healable.lineage
        if manager.errored() is None:
            try:
                world = manager.num_participants()
                decision = combine_gradients(
                    params, group, True, _all_gather(pg, world),
                    None if script is None else script.get(step, []), lineage)
                ids = decision.participants
                if not decision.kept:  # [Note: lineages]: behind by one, healed next quorum
                    error = (f"this group's history differs from groups {ids}' (they "
                             f"committed the same steps apart): it heals from them")
                    manager.report_error(RuntimeError(error))
                    manager.load_state_dict({"step": manager.current_step() - 1,
                                             "batches_committed": manager.batches_committed()})
            except _PeerLost as exc:  # a group lost mid-combine: this step does not commit
                error = str(exc)
                manager.report_error(exc)
        if restarted and ids and len(ids) < min(2, cfg.parallel.dp_replicate) \
                and manager.errored() is None:
            # A restarted group joins the run's history; alone (the others not in this
            # quorum yet, or gone) it would start one of its own.
            error = f"a restarted group commits only with a live group; quorum had {ids}"
            manager.report_error(RuntimeError(error))
        norm = grad_norm(model)
        stats = gather_stats([loss_sum, norm], env)
        committed = manager.should_commit()
        if committed:
            if faults is not None:
                faults.fire("optimizer")
            clip_grads_with_norm_(model, cfg.optim.grad_clip or math.inf, norm)
            optimizer.step()
            schedule.step()
            healable.lineage = next_lineage(lineage, step, ids)
        else:
            loader.load_state_dict(position)  # the same step again, in the next quorum
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        loss = float(stats[:, 0].mean())
        record = {"event": "step", "step": step, "committed": committed, "participants": ids,
                  "loss": loss, "lr": lr, "grad_norm": float(stats[0, 1]),
                  "tokens": tokens_per_group * len(ids) if committed else 0,
                  "step_time_s": elapsed, "time": time.time(), "lineage_before": lineage,
                  "lineage": healable.lineage}
        if error is not None:
            record["error"] = error[:300]
        if not committed:
            failed.append((step, error or "the step did not commit in every group"))
        elif last_ids is not None and ids != last_ids:
            record.update(_membership_change(last_ids, ids, failed, cfg.parallel))
        journal.write(**record)
        if env.is_main and "left" in record and record["left"]:
            print(f"group {group}: groups {record['left']} dropped at step {step}: "
                  f"{record['why']}", flush=True)
        if env.is_main and committed and (ids != last_ids or step % cfg.train.log_interval == 0
                                          or step == steps):
            change = "" if ids == last_ids or last_ids is None else \
                f" (groups {last_ids} -> {ids})"
            print(f"group {group} step {step}/{steps} loss {loss:.4f} groups {ids}"
                  f"{change} {elapsed * 1e3:.0f} ms", flush=True)
        if committed:
            last_ids, failed, restarted = ids, [], False
