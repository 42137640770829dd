"""A vision-language-action policy acting in its environment in real time, timed per action.

    shardwise act --checkpoint runs/vla                       # 32 held-out episodes, batch 1
    shardwise act --checkpoint runs/vla --batch 8 --json act.json --strip act.png

    from shardwise.inference.act import act
    report = act("runs/vla", episodes=32)       # an ActReport
    print(report.table())                       # success rate, latency p50 / p99 / max, actions/s

The policy is the trainer's greedy policy (``shardwise.data.vla.GreedyActionPolicy``: the
argmax over the reserved action ids at each row's ``ACT`` position) and the episodes are
scheduled as :func:`shardwise.data.vla.rollout` schedules them (``batch`` episodes step
together; a finished one is replaced by the next seed), so for the same seeds and batch it
takes the same actions as the trainer's validation. Seeds start at ``EVAL_SEED_BASE``
(1,000,000), where no training demonstration is drawn from.

[Note: what a control step costs] Two clocks, both ``time.perf_counter``: the *policy
latency* runs from the moment the observations are in hand to the chosen actions (filling
the model's inputs, the forward, the argmax, the copy to the host), once per forward of
``batch`` episodes; the *env step* is ``env.step`` plus reading its frame, per action. The
control rate is actions per second of policy time (``batch / latency`` per forward), the
loop rate actions per second of wall time with the environment included. One forward before
the clocks start warms the allocator and is not counted. The inputs are preallocated: the
token rows are rebuilt only when an episode starts (the mission is fixed within an episode),
and each step copies the new frames into one uint8 buffer and converts them in place.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections import deque
from typing import Any

import numpy as np
import torch
from torch import nn

from shardwise.data.vla import EVAL_SEED_BASE, NUM_ACTIONS, Episode, collate, save_strip_png
from shardwise.data.vla.env import frame_of, make_env, reset_env
from shardwise.data.vla.samples import SampleSpec, build_sample
from shardwise.data.vla.tokens import ACT_ID, MissionTokenizer
from shardwise.inference.checkpoint import LoadedModel, load_model
from shardwise.models import VLAConfig

__all__ = ["ActReport", "Latency", "act", "run_settings", "DEFAULT_LEVEL"]

DEFAULT_LEVEL = "BabyAI-GoToLocal-v0"
_VIEW = 7  # minigrid's partial view is 7 x 7 cells: frames are 7 * tile_size pixels square


@dataclasses.dataclass(frozen=True)
class Latency:
    """Milliseconds of one timed thing: median, 99th percentile, max, mean, count."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        """The figures of ``seconds`` (at least one)."""
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        return cls(float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                   float(ms.max()), float(ms.mean()), int(ms.size))


@dataclasses.dataclass
class ActReport:
    """What :func:`act` measured ([Note: what a control step costs]).

    Attributes:
        level, episodes, batch, seed: what ran (seeds ``seed .. seed + episodes - 1``).
        success_rate: share of episodes ending with reward > 0 within the level's limit.
        mean_steps: mean actions per episode.
        actions, forwards: actions taken and model forwards made.
        policy: latency per forward, observation to chosen actions.
        env_step: latency per action of ``env.step`` and its frame.
        actions_per_s: control rate, actions per second of policy time.
        loop_actions_per_s: actions per second of wall time, environment included.
        params, threads, device: the model's parameters, torch's intra-op threads, device.
        checkpoint, step: where the model came from (None for a model passed in).
        successes, steps, trajectories: per episode, in seed order (its action ids).
    """

    level: str
    episodes: int
    batch: int
    seed: int
    success_rate: float
    mean_steps: float
    actions: int
    forwards: int
    policy: Latency
    env_step: Latency
    actions_per_s: float
    loop_actions_per_s: float
    params: int
    threads: int
    device: str
    checkpoint: str | None
    step: int | None
    successes: list[bool]
    steps: list[int]
    trajectories: list[list[int]]

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-able data (what ``--json`` writes)."""
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The figures as a small text table (what ``shardwise act`` prints)."""
        p, e = self.policy, self.env_step
        wins = sum(self.successes)
        rows = [("success rate", f"{self.success_rate:.3f}  ({wins} / {self.episodes})"),
                ("mean steps", f"{self.mean_steps:.1f}"),
                ("actions", f"{self.actions} in {self.forwards} forwards of <= {self.batch}"),
                ("policy latency", f"p50 {p.p50_ms:.2f} ms  p99 {p.p99_ms:.2f} ms  max "
                                   f"{p.max_ms:.2f} ms  (observation -> action, per forward)"),
                ("env step", f"p50 {e.p50_ms:.2f} ms  p99 {e.p99_ms:.2f} ms  max "
                             f"{e.max_ms:.2f} ms  (per action)"),
                ("control rate", f"{self.actions_per_s:.1f} actions/s (policy time); "
                                 f"{self.loop_actions_per_s:.1f} actions/s with the env"),
                ("model", f"{self.params:,} params, {self.device}, {self.threads} threads")]
        head = (f"level {self.level}, {self.episodes} episodes (seeds {self.seed}.."
                f"{self.seed + self.episodes - 1}), batch {self.batch}")
        return "\n".join([head] + [f"  {k:<15} {v}" for k, v in rows])


def run_settings(run_dir: str | os.PathLike | None) -> dict[str, Any]:
    """The ``[vla]`` section of a run's ``config.toml`` (``{}`` when there is none)."""
    from shardwise.compat import tomllib

    if run_dir is None or not os.path.exists(os.path.join(run_dir, "config.toml")):
        return {}
    with open(os.path.join(run_dir, "config.toml"), "rb") as f:
        return dict(tomllib.load(f).get("vla") or {})


@dataclasses.dataclass
class _Slot:
    """One live episode."""

    env: Any
    index: int = -1
    mission: str = ""
    history: deque = dataclasses.field(default_factory=deque)
    steps: int = 0
    actions: list = dataclasses.field(default_factory=list)
    recorded: list | None = None  # (frame, action, reward, done) when recording


class _Inputs:
    """The model's inputs for the live episodes, in preallocated buffers: token rows rebuilt
    only when the episodes or their frame counts change, frames copied in place."""

    def __init__(self, spec: SampleSpec, frames: int, batch: int, side: int,
                 device: torch.device) -> None:
        self.spec, self.frames, self.device = spec, frames, device
        self.tok = MissionTokenizer()
        n = max(batch * frames, 1)
        self.u8 = torch.empty(n, side, side, 3, dtype=torch.uint8)
        self.images = torch.empty(n, 3, side, side, device=device)
        self._key: tuple | None = None
        self.tokens = self.rows = self.at = None

    def _layout(self, live: list[_Slot]) -> None:
        samples = [build_sample(self.tok, self.spec, np.zeros(
            (len(self._shown(s)), *self.u8.shape[1:]), np.uint8), s.mission, None)
            for s in live]
        tokens = collate(samples).tokens  # the padding of rollout's batches
        self.rows, self.at = (tokens == ACT_ID).nonzero(as_tuple=True)
        self.tokens = tokens.to(self.device)
        self.rows, self.at = self.rows.to(self.device), self.at.to(self.device)

    def _shown(self, slot: _Slot) -> list[np.ndarray]:
        return list(slot.history)[-self.frames:] if self.frames else []

    def fill(self, live: list[_Slot]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens (B, T), images (N, 3, H, W))`` of the live episodes' current step."""
        key = tuple((s.index, min(len(s.history), self.frames)) for s in live)
        if key != self._key:
            self._layout(live)
            self._key = key
        n = 0
        for slot in live:
            for frame in self._shown(slot):
                self.u8[n].copy_(torch.from_numpy(frame))
                n += 1
        images = self.images[:n]
        if n:  # frames_to_tensor's arithmetic: (k, H, W, 3) uint8 -> (k, 3, H, W) / 255
            images.copy_(self.u8[:n].permute(0, 3, 1, 2), non_blocking=True)
            images.div_(255.0)
        return self.tokens, images


def _load(source: Any, device: torch.device) -> LoadedModel:
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, nn.Module):
        cfg = getattr(source, "config", None)
        return LoadedModel(source, cfg, None, "module", None, None)
    return load_model(source, device=device)


def _greedy(model: nn.Module, inputs: _Inputs, live: list[_Slot], first: int) -> list[int]:
    tokens, images = inputs.fill(live)
    logits = model(tokens, images)  # (B, T, vocab)
    at_act = logits[inputs.rows, inputs.at]  # (B, vocab): one ACT per row
    return at_act[:, first:first + NUM_ACTIONS].argmax(dim=-1).tolist()


def _start(slot: _Slot, index: int, seed: int, frames: int, record: bool) -> None:
    obs = reset_env(slot.env, seed)
    slot.index, slot.mission, slot.steps, slot.actions = index, obs["mission"], 0, []
    slot.history = deque([frame_of(obs)], maxlen=max(frames, 1))
    slot.recorded = [] if record else None


class _Episodes:
    """Episodes scheduled as ``rollout`` schedules them, each action timed."""

    def __init__(self, level: str, seeds: list[int], batch: int, frames: int, tile: int,
                 record: bool) -> None:
        self.seeds, self.frames, self.record = seeds, frames, record
        self.slots = [_Slot(make_env(level, tile)) for _ in range(min(batch, len(seeds)))]
        self.successes, self.steps = [False] * len(seeds), [0] * len(seeds)
        self.trajectories: list[list[int]] = [[] for _ in seeds]
        self.pending = deque(range(len(seeds)))
        self.env_s: list[float] = []
        self.episode: Episode | None = None
        for slot in self.slots:
            self._next(slot)
        self.live = list(self.slots)

    def _next(self, slot: _Slot) -> bool:
        if not self.pending:
            return False
        i = self.pending.popleft()
        _start(slot, i, self.seeds[i], self.frames, self.record and i == 0)
        return True

    def step(self, actions: list[int]) -> None:
        """Apply one action per live episode; refill finished slots from the seeds left."""
        for slot, action in zip(list(self.live), actions):
            t0 = time.perf_counter()
            obs, reward, terminated, truncated, _ = slot.env.step(action)
            frame = frame_of(obs)
            self.env_s.append(time.perf_counter() - t0)
            slot.steps += 1
            slot.actions.append(action)
            done = terminated or truncated
            if slot.recorded is not None:
                slot.recorded.append((slot.history[-1], action, reward, done))
            slot.history.append(frame)
            if done:
                self._finish(slot, bool(terminated and reward > 0))

    def _finish(self, slot: _Slot, success: bool) -> None:
        i = slot.index
        self.successes[i], self.steps[i], self.trajectories[i] = success, slot.steps, slot.actions
        if slot.recorded is not None:
            rows = slot.recorded
            self.episode = Episode(self.seeds[i], slot.mission, np.stack([r[0] for r in rows]),
                                   np.asarray([r[1] for r in rows], np.int64),
                                   np.asarray([r[2] for r in rows], np.float32),
                                   np.asarray([r[3] for r in rows], bool), success)
        if not self._next(slot):
            self.live.remove(slot)

    def close(self) -> None:
        for slot in self.slots:
            slot.env.close()


def _check(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"act: {name}={value!r}, expected an int >= {low}")


def _settings(loaded: LoadedModel, level: str | None, frames: int | None
              ) -> tuple[VLAConfig, str, int]:
    cfg = loaded.config
    if not isinstance(cfg, VLAConfig):
        raise ValueError(f"act needs a vision-language-action model (a VLAConfig); "
                         f"{loaded.path or 'the model given'} holds a "
                         f"{type(loaded.model).__name__}")
    saved = run_settings(loaded.run_dir)  # the level and frames the run trained on
    frames = saved.get("frames", 1) if frames is None else frames
    _check("frames", frames, 0)
    if cfg.image_size % _VIEW:
        raise ValueError(f"act: the model's image_size={cfg.image_size} is not a multiple of "
                         f"minigrid's {_VIEW}-cell view")
    return cfg, level or saved.get("level", DEFAULT_LEVEL), frames


@torch.inference_mode()
def act(source: Any, *, level: str | None = None, episodes: int = 32, batch: int = 1,
        seed: int = EVAL_SEED_BASE, frames: int | None = None,
        device: str | torch.device = "cpu", threads: int | None = None,
        strip: str | os.PathLike | None = None) -> ActReport:
    """Run a VLA policy greedily in its BabyAI level and time every action.

    Args:
        source: a run directory, checkpoint folder (see
            :func:`~shardwise.inference.checkpoint.load_model`), a :class:`LoadedModel`, or
            a ``VisionLanguageAction`` module (used as is: put it in eval mode yourself).
        level: the BabyAI level (default: the run's ``[vla] level`` from its config.toml,
            else ``BabyAI-GoToLocal-v0``).
        episodes: episodes to run (default 32), seeds ``seed, seed + 1, ...``.
        batch: episodes stepped together, one forward per step (default 1).
        seed: the first env seed (default ``EVAL_SEED_BASE``; below it lie training seeds).
        frames: frames per sample (default: the run's ``[vla] frames``, else 1).
        device: where the model runs (default ``"cpu"``).
        threads: torch intra-op threads while acting (default: torch's current setting).
        strip: write the first episode as a PNG strip here (default None).

    Returns:
        An :class:`ActReport`.

    Raises:
        ValueError: a bad count, a level that is not a BabyAI level, a model that is not a
            VLA, or a checkpoint path that is none (see ``load_model``).
        ImportError: minigrid is missing.
    """
    for name, value, low in (("episodes", episodes, 1), ("batch", batch, 1), ("seed", seed, 0)):
        _check(name, value, low)
    if seed < EVAL_SEED_BASE:
        warnings.warn(f"act: seed {seed} is below {EVAL_SEED_BASE}: training demonstrations "
                      f"are drawn from those seeds", stacklevel=2)
    device = torch.device(device)
    loaded = _load(source, device)
    cfg, level, frames = _settings(loaded, level, frames)
    before = torch.get_num_threads()
    if threads is not None:
        _check("threads", threads, 1)
        torch.set_num_threads(threads)
    try:
        return _act(loaded, cfg, level, episodes, batch, seed, frames, device, strip)
    finally:
        torch.set_num_threads(before)


def _act(loaded: LoadedModel, cfg: VLAConfig, level: str, episodes: int, batch: int,
         seed: int, frames: int, device: torch.device, strip: Any) -> ActReport:
    spec = SampleSpec(cfg.vocab_size, cfg.num_action_tokens, cfg.patch_size)
    seeds = list(range(seed, seed + episodes))
    run = _Episodes(level, seeds, batch, frames, cfg.image_size // _VIEW, strip is not None)
    inputs = _Inputs(spec, frames, batch, cfg.image_size, device)
    model, policy_s, actions = loaded.model, [], 0
    try:
        _greedy(model, inputs, run.live, spec.text_limit)  # warm-up, not timed or acted on
        start = time.perf_counter()
        while run.live:
            t0 = time.perf_counter()
            chosen = _greedy(model, inputs, run.live, spec.text_limit)
            policy_s.append(time.perf_counter() - t0)
            actions += len(chosen)
            run.step(chosen)
        wall = time.perf_counter() - start
    finally:
        run.close()
    if strip is not None and run.episode is not None:
        save_strip_png(run.episode, strip)
    return ActReport(
        level=level, episodes=episodes, batch=batch, seed=seed,
        success_rate=sum(run.successes) / episodes, mean_steps=sum(run.steps) / episodes,
        actions=actions, forwards=len(policy_s), policy=Latency.of(policy_s),
        env_step=Latency.of(run.env_s), actions_per_s=actions / sum(policy_s),
        loop_actions_per_s=actions / wall,
        params=sum(p.numel() for p in model.parameters()), threads=torch.get_num_threads(),
        device=str(device), checkpoint=str(loaded.path) if loaded.path else None,
        step=loaded.step, successes=run.successes, steps=run.steps,
        trajectories=run.trajectories)
