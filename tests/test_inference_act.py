"""``shardwise act`` (shardwise/inference/act.py): a VLA policy acting in its BabyAI level,
timed per action. A randomly initialised debug-vla saved as a run's checkpoint takes exactly
the actions of the trainer's rollout (``shardwise.data.vla.rollout`` with the greedy policy)
for the same seeds, batch and frames; the report's figures are consistent; the command prints
the table and refuses bad input with one named line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("minigrid")
gym = pytest.importorskip("gymnasium")

from shardwise import checkpoint  # noqa: E402
from shardwise.data.vla import GreedyActionPolicy, SampleSpec, rollout  # noqa: E402
from shardwise.inference.act import ActReport, act  # noqa: E402
from shardwise.inference.checkpoint import load_model  # noqa: E402
from shardwise.models import build_model, get_model_config  # noqa: E402
from shardwise.train.cli import main  # noqa: E402

LEVEL = "BabyAI-GoToObj-v0"  # not the default level: the run's config.toml names it


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory holding a random debug-vla's checkpoint and a config.toml."""
    root = tmp_path_factory.mktemp("vla")
    model = build_model(get_model_config("debug-vla"), seed=3)
    checkpoint.save(root / "checkpoints" / "step_00000007", model, step=7)
    (root / "config.toml").write_text(f'[model]\nname = "debug-vla"\n\n[vla]\nlevel = "{LEVEL}"'
                                      f'\nframes = 1\n')
    return root


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared machine, more threads than free cores stall at every
    parallel region's barrier (a forward of milliseconds then takes hundreds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Recorder:
    """The greedy policy, recording each episode's actions in the order episodes start."""

    def __init__(self, model, spec) -> None:
        self.greedy, self.episodes, self.current = GreedyActionPolicy(model, spec), [], {}

    def reset(self, env) -> None:
        self.current[id(env)] = []
        self.episodes.append(self.current[id(env)])

    def __call__(self, batch, envs):
        actions = self.greedy(batch, envs)
        for env, a in zip(envs, actions.tolist()):
            self.current[id(env)].append(a)
        return actions


class _Uneven(gym.Wrapper):
    """Ends each episode after a seed-dependent 3..9 steps, so the episodes of a batch end
    at different steps and slots are refilled mid-batch (a random policy never succeeds and
    would run every episode to the level's limit of 64)."""

    def reset(self, *, seed=None, options=None):
        self.left = 3 + (seed or 0) % 7
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.left -= 1
        return obs, reward, terminated, truncated or self.left == 0, info


@pytest.fixture(params=[False, True], ids=["full", "uneven"])
def uneven(request, monkeypatch):
    if request.param:
        import shardwise.data.vla.evaluate as evaluate
        import shardwise.inference.act as act_module

        make = act_module.make_env
        for module in (act_module, evaluate):
            monkeypatch.setattr(module, "make_env", lambda *a, **k: _Uneven(make(*a, **k)))
    return request.param


@pytest.mark.parametrize("batch, frames", [(1, 1), (3, 2)])
def test_act_takes_the_rollouts_actions(run, batch, frames, uneven):
    episodes = 5 if uneven else 4
    report = act(run, episodes=episodes, batch=batch, frames=frames, seed=1_000_010)
    assert isinstance(report, ActReport) and report.level == LEVEL
    loaded = load_model(run)
    c = loaded.config
    policy = _Recorder(loaded.model, SampleSpec(c.vocab_size, c.num_action_tokens, c.patch_size))
    seeds = list(range(1_000_010, 1_000_010 + episodes))
    assert len(set(report.steps)) > 1 if uneven else set(report.steps) == {64}
    want = rollout(policy, LEVEL, seeds, frames=frames, num_envs=batch, spec=policy.greedy.spec)
    assert report.trajectories == policy.episodes
    assert (report.successes, report.steps) == (want.successes, want.steps)
    assert report.success_rate == want.success_rate and 0 <= report.success_rate <= 1
    assert report.actions == sum(report.steps) == report.env_step.count
    assert report.forwards == report.policy.count
    assert report.forwards == report.actions if batch == 1 else report.forwards < report.actions
    for lat in (report.policy, report.env_step):
        assert 0 < lat.p50_ms <= lat.p99_ms <= lat.max_ms
    assert report.actions_per_s == pytest.approx(
        report.actions / (report.policy.mean_ms * report.forwards / 1e3))
    assert report.loop_actions_per_s < report.actions_per_s
    assert (report.step, report.params) == (7, c.num_params())
    assert json.loads(json.dumps(report.to_json()))["policy"]["p50_ms"] == report.policy.p50_ms


def test_a_module_and_threads(run):
    model = load_model(run).model
    torch.set_num_threads(2)
    report = act(model, level="BabyAI-GoToLocal-v0", episodes=1, threads=1)
    assert (report.level, report.threads, report.checkpoint) == ("BabyAI-GoToLocal-v0", 1, None)
    assert torch.get_num_threads() == 2  # restored


def test_the_command_prints_the_table_and_writes_json_and_strip(run, tmp_path, capsys):
    out = tmp_path / "act.json"
    code = main(["act", "--checkpoint", str(run), "--episodes", "2", "--json", str(out),
                 "--strip", str(tmp_path / "s.png"), "--threads", "1"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "step_00000007 (step 7)" in text and f"level {LEVEL}, 2 episodes" in text
    for row in ("success rate", "policy latency", "env step", "control rate", "3,736,576 params"):
        assert row in text
    figures = json.loads(out.read_text())
    assert figures["episodes"] == 2 and figures["policy"]["p99_ms"] >= figures["policy"]["p50_ms"]
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def _refused(capsys, *args: str) -> str:
    code = main(["act", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), err
    return lines[0]


def test_bad_input_is_refused_with_a_named_line(run, tmp_path, capsys):
    assert "level 'BabyAI-Nowhere-v0' is not a registered BabyAI level" in _refused(
        capsys, "--checkpoint", str(run), "--level", "BabyAI-Nowhere-v0")
    assert "does not exist" in _refused(capsys, "--checkpoint", str(tmp_path / "missing"))
    assert "act: episodes=0, expected an int >= 1" in _refused(
        capsys, "--checkpoint", str(run), "--episodes", "0")
    text = build_model(get_model_config("debug", dim=32, n_layers=1, n_heads=2, n_kv_heads=2))
    checkpoint.save(tmp_path / "text" / "step_00000001", text, step=1)
    assert "act needs a vision-language-action model" in _refused(
        capsys, "--checkpoint", str(tmp_path / "text" / "step_00000001"))
