"""Validation of a vision-language-action run (issue 34): loss and action accuracy on
held-out demonstrations, and the success rate of the greedy policy acting in the environment
on held-out seeds, with a PNG strip of one episode (``<log.dir>/rollout.png``).

[Note: lockstep rollouts] Under sharding every forward is a collective (ZeRO-3 gathers,
tensor-parallel all-reduces, expert all-to-alls), but episodes end when they end: each data
rank acts in its own share of the seeds, and a rank whose episodes are over must still join
the forwards of the ranks still acting. Before each forward the ranks agree, in one small
all-reduce, how many of them still act; a rank that is done runs a one-sample forward with no
frame until none is left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed import env as dist_env
from shardwise.train.config import Config
from shardwise.train.pipeline import pipeline_of
from shardwise.train.stats import gather_stats
from shardwise.train.vla import sample_spec, whole_logits
from shardwise.train.vla_pipeline import PipelineLogits, is_last_stage, pipeline_accuracy

__all__ = ["evaluate_vla"]

STRIP_NAME = "rollout.png"


@torch.no_grad()
def _accuracy(model: nn.Module, loader: Any, spec: Any, env: dist_env.DistEnv,
              max_batches: int) -> tuple[float, float, float, int]:
    """(loss sum, correct, counted, batches) of this rank's validation batches."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    correct = torch.zeros((), dtype=torch.float64, device=env.device)
    counted = torch.zeros((), dtype=torch.float64, device=env.device)
    batches = 0
    pipe = pipeline_of(model)
    for batch in loader.val_batches(max_batches):
        batches += 1
        if pipe is not None:  # the schedule's forward-only path; the counts on its last stage
            loss, right, seen = pipeline_accuracy(pipe, batch, spec.text_limit, env.device)
            loss_sum, correct, counted = loss_sum + loss, correct + right, counted + seen
            continue
        batch = batch.to(env.device)
        logits = whole_logits(model, batch.tokens, batch.images).float()
        at = batch.labels != -100  # (B, T): the ACT positions
        loss_sum += F.cross_entropy(logits[at], batch.labels[at])
        first = spec.text_limit
        guess = logits[at][:, first:].argmax(dim=-1) + first
        correct += (guess == batch.labels[at]).sum()
        counted += at.sum()
    return loss_sum, correct, counted, batches


class _Lockstep:
    """A greedy policy whose forwards every rank joins ([Note: lockstep rollouts])."""

    def __init__(self, model: nn.Module, spec: Any, env: dist_env.DistEnv) -> None:
        from shardwise.data.vla import GreedyActionPolicy

        from shardwise.data.vla import ACT_ID, BOS_ID

        self.model, self.env = model, env
        pipe = pipeline_of(model)
        if pipe is not None:  # [Note: the pipelined policy] in vla_pipeline.py
            self.forward = PipelineLogits(pipe, model.config.vocab_size, ACT_ID, BOS_ID)
        else:
            self.forward = lambda tokens, images: whole_logits(model, tokens, images)
        self.greedy = GreedyActionPolicy(self.forward, spec=spec, device=env.device)

    def _acting(self, acting: bool) -> int:
        flag = torch.tensor([1.0 if acting else 0.0], device=self.env.device)
        comm.all_reduce(flag, label="vla.rollout")
        return int(flag.item())

    def __call__(self, batch: Any, envs: Any) -> torch.Tensor:
        self._acting(True)
        return self.greedy(batch, envs)

    @torch.no_grad()
    def drain(self, spec: Any) -> None:
        """Join the forwards of the ranks still acting, with one frameless sample."""
        from shardwise.data.vla import ACT_ID, BOS_ID

        tokens = torch.tensor([[BOS_ID, ACT_ID]], device=self.env.device)
        images = torch.zeros(0, 3, spec_image_size(self.model), spec_image_size(self.model),
                             device=self.env.device)
        while self._acting(False):
            self.forward(tokens, images)


def spec_image_size(model: nn.Module) -> int:
    """The frame side the model's vision tower takes."""
    return model.config.image_size


def _rollout(model: nn.Module, cfg: Config, spec: Any, env: dist_env.DistEnv,
             rank: int, ranks: int, record: bool) -> tuple[int, int, Any]:
    """This data rank's share of the held-out seeds, acted in lockstep with every rank."""
    from shardwise.data.vla import eval_seeds, rollout

    seeds = eval_seeds(cfg.vla.eval_episodes)[rank::ranks]
    policy = _Lockstep(model, spec, env)
    result = None
    if seeds:
        result = rollout(policy, cfg.vla.level, seeds, frames=cfg.vla.frames, record=record,
                         spec=spec, num_envs=min(len(seeds), 32))
    policy.drain(spec)
    if result is None:
        return 0, 0, None
    return sum(result.successes), len(seeds), result.episode


def evaluate_vla(model: nn.Module, loader: Any, model_cfg: Any, cfg: Config,
                 env: dist_env.DistEnv, step: int, rank: int, ranks: int,
                 leader: bool = True) -> dict[str, Any]:
    """Validation of a VLA run: loss and action accuracy on held-out demonstrations, and the
    success rate of the greedy policy acting on ``vla.eval_episodes`` held-out seeds.

    Args:
        rank, ranks: this data rank and the number of data ranks (each acts on its share of
            the seeds).
        leader: whether this rank speaks for its data rank (its tensor-parallel peers see
            the same batches and seeds and are not counted again).
    """
    spec = sample_spec(model_cfg)
    model.eval()
    try:
        loss_sum, correct, counted, batches = _accuracy(model, loader, spec, env,
                                                        cfg.train.eval_batches)
        wins, episodes, episode = _rollout(model, cfg, spec, env, rank, ranks,
                                           record=cfg.vla.strip and rank == 0)
    finally:
        model.train()
    pipe = pipeline_of(model)
    if pipe is not None:  # the pipeline's last stage counts; the other stages hold zeros
        leader = leader and is_last_stage(pipe)
    weight = 1.0 if leader else 0.0  # tensor peers repeat their data rank's numbers
    stats = gather_stats([weight * loss_sum / max(batches, 1), weight * correct,
                          weight * counted, weight * wins, weight * episodes, weight], env)
    rows = stats[stats[:, 5] > 0]
    record = {"step": step, "val_loss": float(rows[:, 0].mean()),
              "action_accuracy": float(rows[:, 1].sum() / rows[:, 2].sum().clamp_min(1)),
              "success_rate": float(rows[:, 3].sum() / rows[:, 4].sum().clamp_min(1)),
              "val_tokens": int(rows[:, 2].sum())}
    if episode is not None and env.is_main:
        from shardwise.data.vla import save_strip_png

        save_strip_png(episode, Path(cfg.log.dir) / STRIP_NAME)
    return record
