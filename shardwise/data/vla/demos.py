"""Expert demonstrations of BabyAI levels, deterministic from (level, seed).

Episode ``i`` of a run with ``base_seed`` resets the level with seed ``base_seed + i`` and
follows minigrid's expert bot until the level ends (success or its step limit). Per step it
keeps the frame the agent saw, the action the expert took, and the reward / done that step
returned.

Seeds (docs: the VLA interface): training demonstrations use seeds in
``[0, EVAL_SEED_BASE)``; in-environment evaluation uses seeds from ``EVAL_SEED_BASE`` up
(:func:`eval_seeds`). :func:`check_train_seeds` refuses a training range that reaches the
evaluation seeds, so a level layout the model is scored on was never a demonstration.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from shardwise.data.vla.env import DEFAULT_TILE_SIZE, expert_bot, frame_of, make_env, reset_env

__all__ = ["TRAIN_SEED_BASE", "EVAL_SEED_BASE", "Episode", "check_train_seeds", "eval_seeds",
           "generate_episode", "generate_demos"]

TRAIN_SEED_BASE = 0
EVAL_SEED_BASE = 1_000_000


@dataclasses.dataclass
class Episode:
    """One demonstration (or one recorded rollout).

    Attributes:
        seed: the env seed of the episode.
        mission: the mission string, e.g. ``"go to the purple box"``.
        frames: ``(T, H, W, 3)`` uint8; frame t is what the agent saw before action t.
        actions: ``(T,)`` int64 action ids in ``[0, NUM_ACTIONS)``.
        rewards: ``(T,)`` float32, the reward step t returned.
        dones: ``(T,)`` bool, whether step t ended the episode (only the last can be True).
        success: the episode ended with reward > 0 before the level's step limit.
    """

    seed: int
    mission: str
    frames: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    success: bool

    @property
    def num_steps(self) -> int:
        """Number of time steps T."""
        return int(self.actions.shape[0])


def check_train_seeds(base_seed: int, episodes: int) -> None:
    """Refuse a training seed range that is empty, negative or reaches the evaluation seeds.

    Raises:
        ValueError: ``episodes`` < 1, ``base_seed`` < 0, or
            ``base_seed + episodes > EVAL_SEED_BASE``.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be a positive int, got {episodes!r}")
    if isinstance(base_seed, bool) or not isinstance(base_seed, int) or base_seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {base_seed!r}")
    if base_seed + episodes > EVAL_SEED_BASE:
        raise ValueError(
            f"training seeds [{base_seed}, {base_seed + episodes}) reach the evaluation seeds "
            f"(from {EVAL_SEED_BASE}); use a smaller seed or fewer episodes")


def eval_seeds(count: int, offset: int = 0) -> list[int]:
    """``count`` evaluation seeds, ``EVAL_SEED_BASE + offset`` upwards (never a training seed).

    Raises:
        ValueError: ``count`` < 1 or ``offset`` < 0.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int, got {offset!r}")
    return list(range(EVAL_SEED_BASE + offset, EVAL_SEED_BASE + offset + count))


def generate_episode(env, seed: int) -> Episode:  # noqa: ANN001 (a gymnasium env)
    """Reset ``env`` with ``seed`` and record the expert bot until the episode ends.

    Args:
        env: from :func:`~shardwise.data.vla.env.make_env`.
        seed: the env seed.

    Returns:
        The :class:`Episode`.
    """
    obs = reset_env(env, seed)
    bot = expert_bot(env)
    frames, actions, rewards, dones = [], [], [], []
    mission = obs["mission"]
    success = False
    while True:
        action = int(bot.replan())
        frames.append(frame_of(obs))
        obs, reward, terminated, truncated, _ = env.step(action)
        done = bool(terminated or truncated)
        actions.append(action)
        rewards.append(float(reward))
        dones.append(done)
        if done:
            success = bool(terminated and reward > 0)
            break
    return Episode(seed=seed, mission=mission, frames=np.stack(frames),
                   actions=np.asarray(actions, dtype=np.int64),
                   rewards=np.asarray(rewards, dtype=np.float32),
                   dones=np.asarray(dones, dtype=bool), success=success)


def generate_demos(level: str, episodes: int, base_seed: int = TRAIN_SEED_BASE,
                   tile_size: int = DEFAULT_TILE_SIZE) -> tuple[list[Episode], float]:
    """Expert demonstrations of ``level`` with seeds ``base_seed, base_seed + 1, ...``.

    Args:
        level: a BabyAI level id, e.g. ``"BabyAI-GoToLocal-v0"``.
        episodes: number of episodes.
        base_seed: seed of the first episode. Default 0.
        tile_size: pixels per grid cell. Default 8 (56x56 frames).

    Returns:
        ``(episodes, seconds)``: the list of :class:`Episode` and the wall time it took.

    Raises:
        ValueError: bad counts or seeds (:func:`check_train_seeds`) or level.
        ImportError: minigrid is missing.
    """
    check_train_seeds(base_seed, episodes)
    env = make_env(level, tile_size)
    start = time.perf_counter()
    try:
        out = [generate_episode(env, base_seed + i) for i in range(episodes)]
    finally:
        env.close()
    return out, time.perf_counter() - start
