"""The steps of one replica group's rank: a quorum, the group's forward and backward, the
combine across groups, and a commit that every group that finished the step agrees on.

    start_quorum()  -> the groups alive now; a group behind them heals first (heal.py)
    forward/backward over this group's slice of the step's batch (ZeRO inside the group)
    combine         -> the mean of the participants' gradients ([Note: a deterministic
                       combine across groups] in combine.py); a group lost here fails the
                       step everywhere
    should_commit() -> the update runs only then

[Note: what a step is under fault tolerance] Step ``s`` is the ``s``-th committed update.
Its batch is the slices of the global batch of the data stream's position after ``s - 1``
steps that belong to the groups in its quorum (a group's slice: its data ranks'
sequences); a lost group's slice of that step is not trained on, and the step's gradient is
the mean over the groups that took part (equal tokens each). A step that does not commit
(a group was lost during it) changes nothing: the data position is rewound and the same
step is computed again by the groups in the next quorum. So no committed step is lost or
counted twice, and the learning-rate schedule, the data position and the random seed of a
step depend on ``s`` only.

The state a group behind heals from a live one (heal.py, in any two layouts) is everything
that step ``s`` depends on: the parameters and buffers, the optimizer state, the schedule's
position, the data position, and the step itself (the random state is seeded from the step,
so it follows).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.shard import clip_grads_with_norm_
from shardwise.train.attempts import ft_attempt
from shardwise.train.config import Config
from shardwise.train.fault_tolerant.combine import combine_gradients, next_lineage
from shardwise.train.fault_tolerant.exchange import GradientExchange
from shardwise.train.fault_tolerant.heal import heal_behind
from shardwise.train.fault_tolerant.resize import GroupShare
from shardwise.train.fault_tolerant.state import CheckpointSaver, HealableState, Journal
from shardwise.train.fault_tolerant.wide import PeerLost, Roster, WideGroup
from shardwise.train.faults import FaultPlan
from shardwise.train.pipeline import grad_norm
from shardwise.train.stats import gather_stats
from shardwise.train.parallelize import cross_entropy
from shardwise.train.step import forward_backward

__all__ = ["ReplicaSteps"]


def _step_seed(seed: int, step: int, data_rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + data_rank) % (2**63 - 1)


def _since(mark: float) -> tuple[float, float]:
    """Seconds since ``mark``, and now (the next mark)."""
    now = time.perf_counter()
    return now - mark, now


def membership_change(before: list[int], now: list[int], failed: list[tuple[int, str]],
                      par: Any) -> dict[str, Any]:
    """Which groups left and joined since the last committed step, and why they were
    dropped: the collective they did not answer in, or their silence to the quorum server."""
    left = sorted(set(before) - set(now))
    joined = sorted(set(now) - set(before))
    if failed:
        step, error = failed[-1]
        why = (f"they did not answer the combine across groups (the exchange of the gradients) "
               f"of step {step} within parallel.ft_timeout_s={par.ft_timeout_s:g} s or died "
               f"during it ({error[:160]})")
    else:
        why = (f"no heartbeat to the quorum server for parallel.ft_heartbeat_ms="
               f"{par.ft_heartbeat_ms} ms before the quorum of this step")
    return {"left": left, "joined": joined, "why": why if left else ""}


@dataclass
class ReplicaSteps:
    """Everything one rank's steps use; :meth:`run` trains until ``train.steps`` commit.

    Attributes:
        cfg: the job's config; ``gcfg``: the group's own (one replica over its ranks).
        script: a replay's ``{step: [group ids]}`` (``SHARDWISE_FT_REPLAY``), else None.
        share: the data ranks this rank stands for (default: its own, the group at its
            original size; [Note: a resized group trains the same data] in resize.py).
    """

    cfg: Config
    gcfg: Config
    env: Any
    group: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    scaler: Any
    loader: Any
    val_ids: torch.Tensor
    manager: Any
    wide: WideGroup
    healable: HealableState
    faults: FaultPlan | None
    journal: Journal
    saver: CheckpointSaver
    script: dict[int, list[int]] | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)
    exchange: GradientExchange | None = None
    last_ids: list[int] | None = None
    failed: list[tuple[int, str]] = field(default_factory=list)
    restarted: bool = field(default_factory=lambda: ft_attempt() > 0)
    share: GroupShare | None = None

    def __post_init__(self) -> None:
        every = list(self.model.parameters())
        self.trainable = [i for i, p in enumerate(every) if p.requires_grad]
        self.params = [every[i] for i in self.trainable]
        if self.share is None:
            size = self.env.world_size
            self.share = GroupShare(self.group, self.cfg.parallel.dp_replicate, size, size,
                                    self.env.rank)

    def run(self) -> None:
        """Attempt steps until ``train.steps`` have committed."""
        if not self.restarted and self.manager.current_step() == 0:
            self._wait_for_every_group()
        while self.manager.current_step() < self.cfg.train.steps:
            self.attempt()

    def _wait_for_every_group(self) -> None:
        """A fresh run's groups start together: until every group is in the quorum (or
        ``6 x parallel.ft_timeout_s`` have passed), a group asks for quorums without
        training. Otherwise the first group up trains alone while the others still start
        (seen: 3 s apart under load), its steps are healed over when the others join, and
        a fault meant for a step both groups train hits a group that is still alone."""
        want = self.cfg.parallel.dp_replicate
        start = time.monotonic()
        deadline = start + 6 * self.cfg.parallel.ft_timeout_s
        while True:
            self.manager.start_quorum(allow_heal=False)
            seen = self.wide.groups_in_last_quorum()
            if seen >= want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.journal.write(event="ready", groups=seen, waited_s=round(time.monotonic() - start,
                                                                       3), time=time.time())

    def _fire(self, phase: str) -> None:
        if self.faults is not None:
            self.faults.fire(phase)

    def attempt(self) -> None:
        """One attempt at the next step: committed by every group that finishes it, or by
        none ([Note: what a step is under fault tolerance])."""
        start = time.perf_counter()
        healed = self.healable.healed
        # torchft's own healing is off: it pairs rank r with rank r of a peer, which only
        # holds in groups laid out alike ([Note: one group across all ranks] in wide.py).
        self.manager.start_quorum(allow_heal=False)
        roster, quorum_error = self._quorum()  # a group behind heals here, in any layout
        phases = {"quorum_s": time.perf_counter() - start}
        step = self.manager.current_step() + 1
        if self.healable.healed != healed:
            self.journal.write(event="healed", step=step, time=time.time())
        env = self.env
        torch.manual_seed(_step_seed(self.cfg.data.seed, step, self.share.first_data_rank))
        position = self.loader.state_dict()
        if self.faults is not None:
            self.faults.at_step(step)
        lr = self.optimizer.param_groups[0]["lr"]
        mark = time.perf_counter()
        loss_sum, _ = forward_backward(self.model, self.loader, self.gcfg, env, self.scaler,
                                        None)
        self._fire("reduction")
        phases["compute_s"], mark = _since(mark)
        lineage = self.healable.lineage
        ids, error, loss = self._combine(step, lineage, loss_sum, roster, quorum_error)
        norm = self._agreed_norm(grad_norm(self.model), ids)
        stats = gather_stats([loss, norm], env)  # the participants' mean loss, all ranks
        phases["combine_s"], mark = _since(mark)
        committed = self.manager.should_commit()
        phases["commit_s"], _ = _since(mark)
        if committed:
            self._update(step, ids, lineage, norm)
        else:
            self.loader.load_state_dict(position)  # the same step again, next quorum
        self.optimizer.zero_grad(set_to_none=True)
        self._record(step, committed, ids, error, lineage, lr, stats,
                     time.perf_counter() - start, phases)

    def _quorum(self) -> tuple[Roster | None, str | None]:
        """The wide group of this quorum, and this group healed when it is behind; an error
        (reported, so the step does not commit) when a group was lost meanwhile."""
        try:
            roster = self.wide.after_quorum(self.manager.current_step(), self.healable.lineage)
            heal_behind(self.wide, roster, self.healable, self.manager)
        except PeerLost as exc:
            self.manager.report_error(exc)
            return None, str(exc)
        if self.exchange is None or self.exchange.roster is not roster:
            self.exchange = GradientExchange(self.wide, roster, self.trainable)
        return roster, None

    def _combine(self, step: int, lineage: int, loss: torch.Tensor, roster: Roster | None,
                 quorum_error: str | None) -> tuple[list[int], str | None, torch.Tensor]:
        """The gradients across groups; an error (reported to the manager, so the step does
        not commit) when a group was lost, this group's history lost, or a restarted group
        would commit alone. The loss comes back as the participants' mean where it could."""
        manager = self.manager
        if roster is None or manager.errored() is not None:
            return [], quorum_error or str(manager.errored()), loss
        try:
            decision = combine_gradients(
                self.params, self.group, True, self.exchange,
                None if self.script is None else self.script.get(step, []), lineage, loss)
        except PeerLost as exc:
            manager.report_error(exc)
            return [], str(exc), loss
        ids, error = decision.participants, None
        if not decision.kept:  # [Note: lineages]: one step behind, healed next quorum
            error = (f"this group's history differs from groups {ids}' (they committed the "
                     f"same steps apart): it heals from them")
            manager.report_error(RuntimeError(error))
            manager.load_state_dict({"step": manager.current_step() - 1,
                                     "batches_committed": manager.batches_committed()})
        elif self.restarted and len(ids) < min(2, self.cfg.parallel.dp_replicate):
            # A restarted group joins the run's history; alone (the others not in this
            # quorum yet, or gone) it would start one of its own.
            error = f"a restarted group commits only with a live group; quorum had {ids}"
            manager.report_error(RuntimeError(error))
        return ids, error, loss if decision.loss is None else decision.loss

    def _agreed_norm(self, norm: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """The gradient norm every group clips with: its own where all groups are laid out
        alike (the same shards reduce to the same bits), else the lowest participant's
        ([Note: one clipping norm across layouts] in exchange.py). Every rank whose combine
        ran takes part (``ids`` is empty only where it failed, on every rank)."""
        exchange = self.exchange
        if exchange is None or exchange.alike or not ids:
            return norm
        try:
            return exchange.agreed_norm(norm, ids[0])
        except PeerLost as exc:  # the step cannot commit; the next quorum says who is left
            self.manager.report_error(exc)
            return norm

    def _update(self, step: int, ids: list[int], lineage: int, norm: torch.Tensor) -> None:
        self._fire("optimizer")
        clip_grads_with_norm_(self.model, self.cfg.optim.grad_clip or math.inf, norm)
        self.optimizer.step()
        self.schedule.step()
        self.healable.lineage = next_lineage(lineage, step, ids)
        self.saver.after_commit(step, ids)
        if self._eval_due(step):
            result = self._evaluate(step)
            self.journal.write(event="eval", **result, time=time.time())
            if self.env.is_main and self.group == ids[0]:
                print(f"group {self.group} step {step}/{self.cfg.train.steps} val loss "
                      f"{result['val_loss']:.4f} (this group's share of the batches)",
                      flush=True)

    @torch.no_grad()
    def _evaluate(self, step: int) -> dict[str, Any]:
        """This group's share of the validation batches: each of its ranks takes those of its
        data ranks in the whole job (one, unless the group was resized), as without fault
        tolerance, so the groups' means averaged (the summary's ``metrics.jsonl``) are the
        same validation loss a run without fault tolerance logs (with every group there)."""
        cfg, env = self.cfg, self.env
        batches = self.share.eval_batches(self.val_ids, cfg)
        self.model.eval()
        total, count = 0.0, 0
        for inputs, targets in batches:
            logits = self.model(inputs.to(env.device))
            total += cross_entropy(self.model, logits, targets.to(env.device)).item()
            count += 1
        self.model.train()
        mean = gather_stats([total / count], env)[:, 0].mean().item()
        return {"step": step, "val_loss": mean,
                "val_tokens": env.world_size * count * cfg.train.batch_size * cfg.data.seq_len}

    def _eval_due(self, step: int) -> bool:
        interval = self.cfg.train.eval_interval
        return step == self.cfg.train.steps or (interval > 0 and step % interval == 0)

    def _record(self, step: int, committed: bool, ids: list[int], error: str | None,
                lineage: int, lr: float, stats: torch.Tensor, elapsed: float,
                phases: dict[str, float]) -> None:
        """The journal line of this attempt (with where its time went: the quorum, healing
        included; this group's forward and backward; the combine across groups; the commit
        vote), and the group's console lines."""
        cfg, env = self.cfg, self.env
        # The group's n0 data ranks' sequences, whatever its size now
        tokens = self.share.n0 * cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
        loss = float(stats[:, 0].mean())
        record = {"event": "step", "step": step, "committed": committed, "participants": ids,
                  "loss": loss, "lr": lr, "grad_norm": float(stats[0, 1]),
                  "tokens": tokens * len(ids) if committed else 0, "step_time_s": elapsed,
                  **{k: round(v, 4) for k, v in phases.items()},
                  "time": time.time(), "lineage_before": lineage,
                  "lineage": self.healable.lineage}
        if error is not None:
            record["error"] = error[:300]
        last = self.last_ids
        if not committed:
            self.failed.append((step, error or "the step did not commit in every group"))
        elif last is not None and ids != last:
            record.update(membership_change(last, ids, self.failed, cfg.parallel))
        self.journal.write(**record)
        if env.is_main and record.get("left"):
            print(f"group {self.group}: groups {record['left']} dropped at step {step}: "
                  f"{record['why']}", flush=True)
        if env.is_main and committed and (ids != last or step % cfg.train.log_interval == 0
                                          or step == cfg.train.steps):
            change = "" if ids == last or last is None else f" (groups {last} -> {ids})"
            print(f"group {self.group} step {step}/{cfg.train.steps} loss {loss:.4f} groups "
                  f"{ids}{change} {elapsed * 1e3:.0f} ms", flush=True)
        if committed:
            self.last_ids, self.failed, self.restarted = ids, [], False
