"""In-environment evaluation: roll a policy out on BabyAI seeds, score success, draw a strip.

A policy is a callable ``policy(batch, envs) -> actions``: ``batch`` is a :class:`VLABatch`
with one row per live episode (the same sample layout as training, labels all -100) and
``envs`` the rows' unwrapped environments (for policies that read the true state, like the
expert). It returns one action id per row. If it has a ``reset(env)`` method, that is called
after each episode's reset. So a trained model plugs in as
``GreedyActionPolicy(model, spec)`` (its argmax over the reserved action tokens at each
row's ``ACT`` position), and the expert and a random baseline as :class:`ExpertPolicy` and
:class:`RandomPolicy`. Up to ``num_envs`` episodes step together, one policy call per step.

[Note: rollout collectives] A model call inside a sharded model is a collective; every rank
must make the same calls. Give every rank the same seeds: the episodes, and so the number of
calls, then agree as long as the ranks' logits pick the same actions (they see the same
gathered weights and inputs).
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shardwise.data.vla.batch import VLABatch, collate
from shardwise.data.vla.demos import Episode
from shardwise.data.vla.env import (ACTION_NAMES, DEFAULT_TILE_SIZE, NUM_ACTIONS, expert_bot,
                                    frame_of, make_env, reset_env)
from shardwise.data.vla.samples import SampleSpec, build_sample
from shardwise.data.vla.tokens import ACT_ID, MissionTokenizer

__all__ = ["RolloutResult", "ExpertPolicy", "RandomPolicy", "GreedyActionPolicy", "rollout",
           "save_strip_png"]

Policy = Callable[[VLABatch, Sequence[Any]], Any]


@dataclasses.dataclass
class RolloutResult:
    """What :func:`rollout` measured.

    Attributes:
        success_rate: share of episodes that ended with reward > 0 before the step limit.
        mean_steps: mean steps per episode (a failure counts the steps it ran).
        seeds, successes, steps: per episode, in the order of the seeds given.
        episode: the first seed's episode (frames, mission, actions) when ``record=True``.
    """

    success_rate: float
    mean_steps: float
    seeds: list[int]
    successes: list[bool]
    steps: list[int]
    episode: Episode | None = None


class ExpertPolicy:
    """minigrid's BabyAI expert bot as a policy (reads the true env state)."""

    def __init__(self) -> None:
        self._bots: dict[int, Any] = {}

    def reset(self, env: Any) -> None:
        self._bots[id(env)] = expert_bot(env)

    def __call__(self, batch: VLABatch, envs: Sequence[Any]) -> list[int]:
        return [int(self._bots[id(env)].replan()) for env in envs]


class RandomPolicy:
    """Uniformly random actions over ``actions`` (default all 7), from a seeded generator."""

    def __init__(self, seed: int = 0, actions: Sequence[int] = tuple(range(NUM_ACTIONS))) -> None:
        self._rng = np.random.default_rng(seed)
        self._actions = np.asarray(actions)

    def __call__(self, batch: VLABatch, envs: Sequence[Any]) -> list[int]:
        return [int(a) for a in self._rng.choice(self._actions, size=len(envs))]


class GreedyActionPolicy:
    """A model's greedy action: argmax of its logits at each row's ``ACT`` position,
    restricted to the reserved action ids (``spec.text_limit + a``, a < ``num_actions``).

    Args:
        model: ``model(tokens, images) -> logits (B, T, vocab_size)``.
        spec: the vocabulary layout the model was trained with. Default debug-vla's.
        num_actions: actions the env accepts. Default 7 (BabyAI).
        device: where the batch goes before the call; None keeps it on the CPU.
    """

    def __init__(self, model: Callable[..., torch.Tensor], spec: SampleSpec | None = None,
                 num_actions: int = NUM_ACTIONS, device: torch.device | str | None = None):
        self.model, self.spec = model, spec or SampleSpec()
        self.num_actions, self.device = num_actions, device

    @torch.no_grad()
    def __call__(self, batch: VLABatch, envs: Sequence[Any]) -> torch.Tensor:
        if self.device is not None:
            batch = batch.to(self.device)
        logits = self.model(batch.tokens, batch.images)  # (B, T, vocab)
        at_act = logits[batch.tokens == ACT_ID]  # (B, vocab): one ACT per row
        first = self.spec.text_limit
        return at_act[:, first:first + self.num_actions].argmax(dim=-1).cpu()


@dataclasses.dataclass
class _Slot:
    """One live episode of a rollout."""

    env: Any
    index: int = -1
    mission: str = ""
    history: deque = dataclasses.field(default_factory=deque)
    steps: int = 0
    recorded: list | None = None  # (frame, action, reward, done) rows when recording


def _start(slot: _Slot, policy: Any, index: int, seed: int, frames: int, record: bool) -> None:
    obs = reset_env(slot.env, seed)
    slot.index, slot.mission, slot.steps = index, obs["mission"], 0
    slot.history = deque([frame_of(obs)], maxlen=max(frames, 1))
    slot.recorded = [] if record else None
    if hasattr(policy, "reset"):
        policy.reset(slot.env.unwrapped)


def _actions(policy: Any, batch: VLABatch, slots: list[_Slot]) -> list[int]:
    out = policy(batch, [s.env.unwrapped for s in slots])
    actions = [int(a) for a in (out.tolist() if isinstance(out, torch.Tensor) else out)]
    bad = [a for a in actions if not 0 <= a < NUM_ACTIONS]
    if len(actions) != len(slots) or bad:
        raise ValueError(f"policy returned {actions} for {len(slots)} episodes; expected one "
                         f"action in [0, {NUM_ACTIONS}) per episode")
    return actions


def rollout(policy: Policy, level: str, seeds: Sequence[int], frames: int = 1,
            tile_size: int = DEFAULT_TILE_SIZE, record: bool = False, *, num_envs: int = 16,
            spec: SampleSpec | None = None) -> RolloutResult:
    """Run ``policy`` on ``level`` once per seed; an episode succeeds when the env returns
    reward > 0 before the level's step limit (``env.unwrapped.max_steps``).

    Args:
        policy: ``policy(batch, envs) -> actions`` (see the module docstring).
        level: a BabyAI level id, e.g. ``"BabyAI-GoToLocal-v0"``.
        seeds: env seeds (use :func:`~shardwise.data.vla.demos.eval_seeds`).
        frames: frames per sample given to the policy (0 = text only), as in training.
        tile_size: pixels per grid cell. Default 8.
        record: keep the first seed's episode in the result.
        num_envs: episodes stepped together (rows per policy call). Default 16.
        spec: vocabulary / patch layout of the batches. Default debug-vla's.

    Returns:
        The :class:`RolloutResult`.

    Raises:
        ValueError: no seeds, ``frames`` < 0, ``num_envs`` < 1, a policy that returns a
            wrong number of actions or one outside ``[0, 7)``.
        ImportError: minigrid is missing.
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("rollout needs at least one seed")
    for name, value, low in (("frames", frames, 0), ("num_envs", num_envs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    spec, tok = spec or SampleSpec(), MissionTokenizer()
    slots = [_Slot(make_env(level, tile_size)) for _ in range(min(num_envs, len(seeds)))]
    successes, steps = [False] * len(seeds), [0] * len(seeds)
    episode, pending = None, deque(range(len(seeds)))
    for slot in slots:
        i = pending.popleft()
        _start(slot, policy, i, seeds[i], frames, record and i == 0)
    live = list(slots)
    try:
        while live:
            samples = [build_sample(tok, spec, np.stack(list(s.history)[-frames:]) if frames
                                    else np.zeros((0, *s.history[0].shape), np.uint8),
                                    s.mission, None) for s in live]
            actions = _actions(policy, collate(samples), live)
            for slot, action in zip(list(live), actions):
                obs, reward, terminated, truncated, _ = slot.env.step(action)
                slot.steps += 1
                done = terminated or truncated
                if slot.recorded is not None:
                    slot.recorded.append((slot.history[-1], action, reward, done))
                slot.history.append(frame_of(obs))
                if not done:
                    continue
                successes[slot.index] = bool(terminated and reward > 0)
                steps[slot.index] = slot.steps
                if slot.recorded is not None:
                    episode = _as_episode(seeds[slot.index], slot, successes[slot.index])
                if pending:
                    i = pending.popleft()
                    _start(slot, policy, i, seeds[i], frames, record and i == 0)
                else:
                    live.remove(slot)
    finally:
        for slot in slots:
            slot.env.close()
    return RolloutResult(success_rate=sum(successes) / len(seeds),
                         mean_steps=sum(steps) / len(seeds), seeds=seeds,
                         successes=successes, steps=steps, episode=episode)


def _as_episode(seed: int, slot: _Slot, success: bool) -> Episode:
    rows = slot.recorded or []
    return Episode(seed=seed, mission=slot.mission, frames=np.stack([r[0] for r in rows]),
                   actions=np.asarray([r[1] for r in rows], np.int64),
                   rewards=np.asarray([r[2] for r in rows], np.float32),
                   dones=np.asarray([r[3] for r in rows], bool), success=success)


def save_strip_png(episode: Episode, path: str | os.PathLike, max_frames: int = 12) -> str:
    """Draw ``episode`` as one row of frames, each titled with its step and action, under
    the mission and the outcome; long episodes show ``max_frames`` evenly spaced steps.

    Args:
        episode: e.g. ``rollout(..., record=True).episode`` or a stored demonstration.
        path: the PNG file to write.
        max_frames: at most this many frames in the strip. Default 12.

    Returns:
        ``str(path)``.

    Raises:
        ValueError: the episode has no frames, or ``max_frames`` < 1.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if episode.num_steps == 0:
        raise ValueError("the episode has no frames to draw")
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a positive int, got {max_frames!r}")
    shown = np.unique(np.linspace(0, episode.num_steps - 1, min(max_frames, episode.num_steps))
                      .round().astype(int))
    fig = Figure(figsize=(1.3 * len(shown), 1.9))
    FigureCanvasAgg(fig)
    for k, t in enumerate(shown):
        ax = fig.add_subplot(1, len(shown), k + 1)
        ax.imshow(episode.frames[t], interpolation="nearest")
        ax.set_title(f"{t}: {ACTION_NAMES[int(episode.actions[t])]}", fontsize=7)
        ax.axis("off")
    outcome = "success" if episode.success else "failure"
    fig.suptitle(f"{episode.mission}  (seed {episode.seed}, {episode.num_steps} steps, "
                 f"{outcome})", fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return str(path)
