"""Tests for shardwise.data.vla: BabyAI demonstrations, the on-disk store, samples, the
rank-aware resumable loader, rollouts and ``shardwise data vla`` (issue 34)."""

from __future__ import annotations

import ast
import inspect
import json
import sys

import numpy as np
import pytest
import torch

from shardwise.data.vla import (ACT_ID, BOS_ID, EVAL_SEED_BASE, IGNORE_INDEX, IMAGE_ID,
                                MISSION_WORDS, PAD_ID, UNK_ID, ExpertPolicy,
                                GreedyActionPolicy, MissionTokenizer, RandomPolicy,
                                SampleSpec, VLADataset, VLALoader, build_sample,
                                check_train_seeds, collate, ensure_dataset, eval_seeds,
                                generate_demos, read_index, rollout, save_strip_png,
                                split_mission)
from shardwise.data.vla import store as store_mod
from shardwise.train.cli import main

LEVEL = "BabyAI-GoToLocal-v0"
P = 49  # (56 // 8) ** 2 patches per frame


@pytest.fixture(scope="module")
def demos():
    episodes, _ = generate_demos(LEVEL, 12, base_seed=0)
    return episodes


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, demos):
    out = tmp_path_factory.mktemp("vla") / "ds"
    store_mod.write_dataset(out, demos, shard_episodes=5,
                            meta={"level": LEVEL, "base_seed": 0, "tile_size": 8})
    return out


# ----------------------------------------------------------------------------- tokenizer

def _verifier_words() -> set[str]:
    """Words of minigrid's BabyAI grammar: its constants plus every string literal of the
    instructions' and descriptions' ``surface`` methods."""
    from minigrid.envs.babyai.core import verifier

    words = set(verifier.COLOR_NAMES) | set(verifier.OBJ_TYPES) | set(verifier.LOC_NAMES)
    words.add("object")  # ObjDesc.surface's name for a description without a type
    for node in ast.walk(ast.parse(inspect.getsource(verifier))):
        if isinstance(node, ast.FunctionDef) and node.name == "surface":
            skip = {id(c) for n in ast.walk(node) if isinstance(n, (ast.Assert, ast.Expr))
                    for c in ast.walk(n)}  # assert messages and docstrings are not missions
            for const in ast.walk(node):
                if isinstance(const, ast.Constant) and isinstance(const.value, str) \
                        and id(const) not in skip:
                    words.update(split_mission(const.value))
    return words


def test_word_list_is_minigrids_grammar_sorted_and_fixed():
    assert set(MISSION_WORDS) == _verifier_words()
    assert list(MISSION_WORDS) == sorted(MISSION_WORDS)
    tok = MissionTokenizer()
    assert (PAD_ID, BOS_ID, IMAGE_ID, ACT_ID, UNK_ID) == (0, 1, 2, 3, 4)
    assert tok.encode(MISSION_WORDS[0]) == [5]
    assert tok.vocab_size == 5 + len(MISSION_WORDS) < 112  # below debug-vla's action ids


@pytest.mark.parametrize("level", ["BabyAI-GoToLocal-v0", "BabyAI-PutNextLocal-v0",
                                   "BabyAI-PickupLoc-v0", "BabyAI-BossLevel-v0"])
def test_tokenizer_covers_missions(level):
    from shardwise.data.vla.env import make_env, reset_env

    tok, env = MissionTokenizer(), make_env(level)
    for seed in range(25):
        mission = reset_env(env, seed)["mission"]
        ids = tok.encode(mission)
        assert tok.decode(ids) == mission
    assert not tok.unknown, tok.unknown


def test_tokenizer_unknown_words_are_counted_and_decode_checks_ids():
    tok = MissionTokenizer()
    assert tok.encode("go to the zebra, then <pad>") == [
        tok.encode("go")[0], tok.encode("to")[0], tok.encode("the")[0], UNK_ID,
        tok.encode(",")[0], tok.encode("then")[0], UNK_ID, UNK_ID, UNK_ID]
    assert tok.unknown == {"zebra": 1, "<": 1, "pad": 1, ">": 1}
    with pytest.raises(ValueError, match="token id 38 is outside"):
        tok.decode([38])


# ----------------------------------------------------------------------------- demos, seeds

def test_demos_are_deterministic_from_level_and_seed(demos):
    again, _ = generate_demos(LEVEL, 3, base_seed=0)
    shifted, _ = generate_demos(LEVEL, 2, base_seed=1)
    for a, b in zip(again, demos[:3]):
        assert a.seed == b.seed and a.mission == b.mission
        assert np.array_equal(a.frames, b.frames) and np.array_equal(a.actions, b.actions)
    assert [e.seed for e in shifted] == [1, 2]
    assert np.array_equal(shifted[0].frames, demos[1].frames)
    assert all(e.success and e.dones[-1] and not e.dones[:-1].any() for e in demos)
    assert all(e.frames.shape[1:] == (56, 56, 3) and e.frames.dtype == np.uint8 for e in demos)


def test_eval_seeds_are_disjoint_from_training_seeds():
    assert min(eval_seeds(200)) == EVAL_SEED_BASE
    check_train_seeds(EVAL_SEED_BASE - 10, 10)  # the last training seed is allowed
    with pytest.raises(ValueError, match="reach the evaluation seeds"):
        check_train_seeds(EVAL_SEED_BASE - 10, 11)
    with pytest.raises(ValueError, match="reach the evaluation seeds"):
        generate_demos(LEVEL, 2, base_seed=EVAL_SEED_BASE)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        check_train_seeds(-1, 3)


# ----------------------------------------------------------------------------- store

def test_store_round_trip(dataset_dir, demos):
    ds = VLADataset(dataset_dir)
    index = read_index(dataset_dir)
    assert index["level"] == LEVEL and index["seeds"] == list(range(12))
    assert index["episodes"] == 12 and index["steps"] == sum(e.num_steps for e in demos)
    assert index["tokenizer"]["vocab_hash"] == MissionTokenizer().vocab_hash
    assert index["shardwise_version"] and len(index["shards"]) == 3  # 5 + 5 + 2 episodes
    assert index["bytes"] == sum(p.stat().st_size for p in dataset_dir.glob("*.safetensors"))
    for i in (0, 6, 11):
        e = ds.episode(i)
        assert e.mission == demos[i].mission and e.success
        for name in ("frames", "actions", "rewards", "dones"):
            assert np.array_equal(getattr(e, name), getattr(demos[i], name)), name
        assert ds.action(i, e.num_steps - 1) == demos[i].actions[-1]


def test_interrupted_write_leaves_no_dataset(tmp_path, demos, monkeypatch):
    real, calls = store_mod._write_shard, []

    def dies_on_second_shard(path, chunk):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write
        return real(path, chunk)

    monkeypatch.setattr(store_mod, "_write_shard", dies_on_second_shard)
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        store_mod.write_dataset(out, demos, meta={"level": LEVEL}, shard_episodes=4)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # A crash that skips the cleanup leaves shards without an index: not a dataset.
    out.mkdir()
    real(out / "shard-00000.safetensors", demos[:2])
    with pytest.raises(ValueError, match="not a complete VLA dataset"):
        VLADataset(out)
    with pytest.raises(ValueError, match="already exists and is not empty"):
        store_mod.write_dataset(out, demos, meta={})


def test_ensure_dataset_is_idempotent_and_checks_the_request(tmp_path):
    out = tmp_path / "ds"
    assert ensure_dataset(out, LEVEL, 3, seed=7) == out
    stamp = (out / "index.json").stat().st_mtime_ns
    assert ensure_dataset(out, LEVEL, 3, seed=7) == out
    assert (out / "index.json").stat().st_mtime_ns == stamp  # reused, not rewritten
    assert read_index(out)["seeds"] == [7, 8, 9]
    with pytest.raises(ValueError, match=r"episodes=3 \(requested 4\).*base_seed=7 "):
        ensure_dataset(out, LEVEL, 4, seed=8)


# ----------------------------------------------------------------------------- samples

def test_sample_layout_and_collate():
    tok, spec = MissionTokenizer(), SampleSpec()
    frames = np.random.default_rng(0).integers(0, 256, (2, 56, 56, 3), dtype=np.uint8)
    s2 = build_sample(tok, spec, frames, "go to the red ball", 2)
    s0 = build_sample(tok, spec, frames[:0], "open a door", 6)
    assert s2.tokens.tolist() == [BOS_ID] + [IMAGE_ID] * 2 * P + tok.encode(
        "go to the red ball") + [ACT_ID]
    assert torch.equal(s2.images[1], torch.from_numpy(frames[1]).permute(2, 0, 1) / 255.0)
    batch = collate([s2, s0, s2])
    assert batch.tokens.shape == batch.labels.shape == (3, len(s2.tokens))
    assert batch.images.shape == (4, 3, 56, 56) and batch.num_image_tokens == 4 * P
    assert (batch.tokens[1, len(s0.tokens):] == PAD_ID).all()
    act = batch.tokens == ACT_ID
    assert act.sum(1).tolist() == [1, 1, 1]
    assert batch.labels[act].tolist() == [114, 118, 114]  # 128 - 16 + action
    assert (batch.labels[~act] == IGNORE_INDEX).all()
    text_only = collate([s0], pad_to=20)
    assert text_only.images.shape == (0, 3, 56, 56) and text_only.tokens.shape == (1, 20)
    assert text_only.to("meta").images.device.type == "meta"
    with pytest.raises(ValueError, match="pad_to must be an int >= the longest sample"):
        collate([s2], pad_to=10)
    with pytest.raises(ValueError, match="different shapes"):
        collate([s2, build_sample(tok, spec, frames[:, :48, :48], "open a door", 0)])
    with pytest.raises(ValueError, match="leaves 10 ids below the action tokens"):
        SampleSpec(vocab_size=26, num_action_tokens=16)


# ----------------------------------------------------------------------------- loader

def _rows(batch) -> list[tuple]:
    """Each row as (unpadded tokens, its frames' bytes): comparable across paddings."""
    out, first = [], 0
    for row in range(batch.batch_size):
        tokens = batch.tokens[row]
        tokens = tokens[: int((tokens != PAD_ID).sum())]
        n = int((tokens == IMAGE_ID).sum()) // P
        out.append((tuple(tokens.tolist()), batch.images[first:first + n].numpy().tobytes(),
                    tuple(batch.labels[row][batch.labels[row] != IGNORE_INDEX].tolist())))
        first += n
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_slices_partition_each_global_batch(dataset_dir, world_size):
    kw = dict(seed=3, frames=2, text_only_share=0.3)
    ranks = [VLALoader(dataset_dir, 2, r, world_size, **kw) for r in range(world_size)]
    single = VLALoader(dataset_dir, 2 * world_size, 0, 1, **kw)
    for _ in range(2 * single.batches_per_epoch + 1):  # across epoch boundaries
        got = [row for ld in ranks for row in _rows(ld.next_batch())]
        assert got == _rows(single.next_batch())
    assert ranks[0].state_dict() == single.state_dict()


def test_resume_mid_epoch_gives_the_same_next_batches(dataset_dir):
    a = VLALoader(dataset_dir, 3, 1, 2, seed=5, frames=1)
    for _ in range(a.batches_per_epoch - 2):
        a.next_batch()
    state = a.state_dict()
    b = VLALoader(dataset_dir, 3, 1, 2, seed=0, frames=1)  # the state's seed wins
    b.load_state_dict(json.loads(json.dumps(state)))
    whole = VLALoader(dataset_dir, 6, 0, 1, seed=0, frames=1)  # resumed at world size 1
    whole.load_state_dict(state)
    for _ in range(5):  # crosses into the next epoch
        mine = a.next_batch()
        assert _rows(mine) == _rows(b.next_batch())
        assert _rows(mine) == _rows(whole.next_batch())[3:]
    with pytest.raises(ValueError, match="frames=1 but this loader has frames=2"):
        VLALoader(dataset_dir, 3, 0, 2, frames=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        b.load_state_dict({"epoch": 0})


def test_frames_per_sample_and_text_only(dataset_dir):
    ds = VLADataset(dataset_dir)
    steps = [t for n in ds.lengths for t in range(n)][:4]  # unshuffled: episode order
    assert ds.lengths[0] >= 2
    for k in (0, 1, 2):
        batch = VLALoader(dataset_dir, 4, 0, 1, frames=k, shuffle=False).next_batch()
        counts = [min(k, t + 1) for t in steps]
        assert batch.num_images == sum(counts) and batch.num_image_tokens == sum(counts) * P
        if k == 2:  # the second sample: frames 0 and 1, oldest first
            want = torch.from_numpy(ds.frames(0, 0, 2)).permute(0, 3, 1, 2) / 255.0
            assert torch.equal(batch.images[1:3], want)
    mixed = VLALoader(dataset_dir, 16, 0, 1, frames=1, text_only_share=0.5, seed=1)
    per_row = [(b.tokens == IMAGE_ID).sum(1) // P for b in (mixed.next_batch(),)][0]
    assert 0 < int((per_row == 0).sum()) < 16
    kw = dict(frames=1, text_only_ranks=[1], text_only_steps=[1])
    r0, r1 = (VLALoader(dataset_dir, 3, r, 2, **kw) for r in (0, 1))
    assert [r1.next_batch().num_images for _ in range(3)] == [3, 0, 3]
    assert [r0.next_batch().num_images for _ in range(3)] == [3, 3, 3]


def test_validation_split_is_held_out_by_seed(dataset_dir):
    ld = VLALoader(dataset_dir, 2, 1, 2, val_fraction=0.25)
    assert ld.val_seeds == [9, 10, 11]
    assert sorted(ld.dataset.seeds[e] for e in ld.train_episodes) == list(range(9))
    val = list(ld.val_batches())
    steps = sum(VLADataset(dataset_dir).lengths[9:])
    assert len(val) == steps // 4 and all(b.batch_size == 2 for b in val)
    with pytest.raises(ValueError, match="val_fraction=0.01 of 12 episodes holds out 0"):
        VLALoader(dataset_dir, 2, 0, 1, val_fraction=0.01)
    with pytest.raises(ValueError, match="holds 0 steps, fewer than one global batch"):
        list(VLALoader(dataset_dir, 2, 0, 1).val_batches())


# ----------------------------------------------------------------------------- rollouts

class _CheckedExpert(ExpertPolicy):
    """The expert, checking each batch it is given has the interface's layout."""

    def __call__(self, batch, envs):
        assert batch.num_image_tokens == batch.num_images * P
        assert (batch.tokens == ACT_ID).sum() == batch.batch_size == len(envs)
        return super().__call__(batch, envs)


def test_rollout_expert_succeeds_random_mostly_not(tmp_path):
    seeds = eval_seeds(12)
    expert = rollout(_CheckedExpert(), LEVEL, seeds, frames=2, record=True, num_envs=5)
    assert expert.success_rate == 1.0 and expert.seeds == seeds
    ep = expert.episode
    assert ep.seed == seeds[0] and ep.success and ep.num_steps == expert.steps[0]
    png = save_strip_png(ep, tmp_path / "strip.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    rand = rollout(RandomPolicy(0), LEVEL, eval_seeds(24), frames=0, num_envs=8)
    assert rand.success_rate < 0.6 and rand.mean_steps > expert.mean_steps


def test_greedy_policy_reads_the_action_tokens():
    spec = SampleSpec()

    def model(tokens, images):  # prefers action 5 among the actions, 0 among all ids
        logits = torch.zeros(*tokens.shape, spec.vocab_size)
        logits[..., 0] = 9.0
        logits[..., spec.text_limit + 5] = 1.0
        logits[..., spec.text_limit + 8] = 5.0  # a reserved id past BabyAI's 7 actions
        return logits

    policy = GreedyActionPolicy(model, spec)
    frames = np.zeros((1, 56, 56, 3), np.uint8)
    batch = collate([build_sample(MissionTokenizer(), spec, frames[:n], "open a door", None)
                     for n in (1, 0)])
    assert policy(batch, [None, None]).tolist() == [5, 5]
    result = rollout(policy, LEVEL, eval_seeds(2), frames=1)
    assert result.success_rate == 0.0  # toggling forever never reaches the object
    with pytest.raises(ValueError, match=r"expected one action in \[0, 7\)"):
        rollout(lambda batch, envs: [9] * len(envs), LEVEL, eval_seeds(1))


# ----------------------------------------------------------------------------- CLI, extra

def test_cli_writes_a_dataset(tmp_path, capsys):
    out = tmp_path / "ds"
    args = ["data", "vla", "--level", LEVEL, "--episodes", "4", "--out", str(out),
            "--seed", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "4 episodes" in printed and "bytes" in printed and "episodes/s" in printed
    assert read_index(out)["seeds"] == [3, 4, 5, 6]
    assert main(args) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["data", "vla", "--level", "BabyAI-Nope-v0", "--episodes", "1",
                 "--out", str(tmp_path / "x")]) == 2
    assert "is not a registered BabyAI level" in capsys.readouterr().err


def test_missing_minigrid_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "minigrid", None)  # makes `import minigrid` fail
    with pytest.raises(ImportError, match=r"pip install shardwise\[vla\]"):
        generate_demos(LEVEL, 1)
    assert main(["data", "vla", "--level", LEVEL, "--episodes", "1",
                 "--out", str(tmp_path / "ds")]) == 2
    assert "pip install shardwise[vla]" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()
