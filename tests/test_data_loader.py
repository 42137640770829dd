"""Tests for shardwise.data: train/validation split and the rank-aware, resumable loader."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.data import TokenLoader, iter_eval_batches, split_tokens

FAST = settings(max_examples=40, deadline=None)


# ----------------------------------------------------------------------------- split_tokens

@FAST
@given(st.integers(0, 500), st.floats(0.0, 0.999))
def test_split_tokens_contiguous_val_at_end(n: int, frac: float) -> None:
    ids = torch.arange(n)
    train, val = split_tokens(ids, frac)
    assert val.numel() == int(n * frac)
    assert torch.equal(torch.cat([train, val]), ids)


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, math.nan, "0.1"])
def test_split_tokens_rejects_bad_fraction(bad) -> None:
    with pytest.raises(ValueError, match=r"val_fraction must be a number in \[0, 1\)"):
        split_tokens(torch.arange(10), bad)


# ----------------------------------------------------------------------------- TokenLoader

def _window_ids(inputs: torch.Tensor, seq_len: int) -> list[int]:
    """Window index of each row, for tokens = arange (row k starts at k * (seq_len + 1))."""
    return (inputs[:, 0] // (seq_len + 1)).tolist()


def _global_stream(loaders: list[TokenLoader], steps: int) -> list[torch.Tensor]:
    """Per step, the ranks' inputs concatenated in rank order (the global micro-batch)."""
    return [torch.cat([ld.next_batch()[0] for ld in loaders]) for _ in range(steps)]


def test_loader_shapes_and_shifted_targets() -> None:
    seq_len, batch = 8, 3
    tokens = torch.arange(1000, dtype=torch.int32)
    loader = TokenLoader(tokens, seq_len=seq_len, batch_size=batch, rank=1, world_size=2)
    for _ in range(5):
        inputs, targets = loader.next_batch()
        assert inputs.shape == targets.shape == (batch, seq_len)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(targets, inputs + 1)  # tokens = arange: shifted by one
        assert torch.all(inputs[:, 0] % (seq_len + 1) == 0)  # rows start on window bounds


@FAST
@given(world_size=st.integers(1, 4), batch=st.integers(1, 3), seq_len=st.integers(1, 5),
       extra=st.integers(0, 30), seed=st.integers(0, 2**31), steps=st.integers(1, 25))
def test_union_of_ranks_equals_single_process(world_size, batch, seq_len, extra, seed,
                                              steps) -> None:
    num_windows = world_size * batch + extra
    tokens = torch.arange(num_windows * (seq_len + 1) + seq_len)  # plus a partial window
    ranks = [TokenLoader(tokens, seq_len, batch, r, world_size, seed=seed)
             for r in range(world_size)]
    single = TokenLoader(tokens, seq_len, batch * world_size, 0, 1, seed=seed)
    # Steps may cross several epoch boundaries: the wrap must agree too.
    for got in _global_stream(ranks, steps):
        assert torch.equal(got, single.next_batch()[0])
    assert {tuple(ld.state_dict().items()) for ld in ranks} == {tuple(single.state_dict().items())}


def test_epoch_covers_distinct_windows_drops_remainder_and_reshuffles() -> None:
    seq_len, num_windows = 4, 50
    tokens = torch.arange(num_windows * (seq_len + 1))
    loader = TokenLoader(tokens, seq_len=seq_len, batch_size=4, rank=0, world_size=3, seed=7)
    assert loader.batches_per_epoch == 4  # 50 // 12; 2 windows dropped per epoch
    single = TokenLoader(tokens, seq_len=seq_len, batch_size=12, rank=0, world_size=1, seed=7)
    epochs = []
    for epoch in range(3):
        assert single.epoch == epoch and single.consumed == 0
        seen = [w for _ in range(4) for w in _window_ids(single.next_batch()[0], seq_len)]
        assert len(set(seen)) == 48 and all(0 <= w < num_windows for w in seen)
        epochs.append(seen)
    assert single.epoch == 3
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])  # actually shuffled


def test_shuffle_false_and_seed_dependence() -> None:
    tokens = torch.arange(40 * 3)
    ordered = TokenLoader(tokens, seq_len=2, batch_size=5, rank=0, world_size=1, shuffle=False)
    assert _window_ids(ordered.next_batch()[0], 2) == [0, 1, 2, 3, 4]
    stream = [TokenLoader(tokens, 2, 5, 0, 1, seed=s).next_batch()[0] for s in (0, 0, 1)]
    assert torch.equal(stream[0], stream[1]) and not torch.equal(stream[0], stream[2])


def test_iterator_protocol() -> None:
    loader = TokenLoader(torch.arange(100), seq_len=4, batch_size=2, rank=0, world_size=1)
    reference = TokenLoader(torch.arange(100), seq_len=4, batch_size=2, rank=0, world_size=1)
    for (inputs, _), _step in zip(loader, range(30)):
        assert torch.equal(inputs, reference.next_batch()[0])


def test_resume_same_world_size() -> None:
    tokens = torch.arange(37 * 6)
    def make(r):
        return TokenLoader(tokens, seq_len=5, batch_size=2, rank=r, world_size=2, seed=3)

    full = [make(r) for r in range(2)]
    expected = _global_stream(full, 30)
    first = [make(r) for r in range(2)]
    head = _global_stream(first, 13)
    state = first[0].state_dict()
    resumed = [make(r) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(state)
    tail = _global_stream(resumed, 17)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, expected))


@FAST
@given(save_world=st.sampled_from([1, 2, 4]), load_world=st.sampled_from([1, 2, 4]),
       steps=st.integers(0, 20), seed=st.integers(0, 1000))
def test_resume_at_another_world_size_same_global_stream(save_world, load_world, steps,
                                                         seed) -> None:
    tokens = torch.arange(29 * 4)  # 29 windows of seq_len + 1 = 4; global batch 4
    global_batch = 4

    def ranks(world: int) -> list[TokenLoader]:
        return [TokenLoader(tokens, 3, global_batch // world, r, world, seed=seed)
                for r in range(world)]

    expected = _global_stream(ranks(1), steps + 10)
    saving = ranks(save_world)
    head = _global_stream(saving, steps)
    state = saving[-1].state_dict()
    loading = ranks(load_world)
    for ld in loading:
        ld.load_state_dict(state)
    tail = _global_stream(loading, 10)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, expected))


def test_load_state_dict_rejects_foreign_state() -> None:
    loader = TokenLoader(torch.arange(200), seq_len=4, batch_size=2, rank=0, world_size=1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"missing keys \['consumed'\]"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "consumed"})
    other = TokenLoader(torch.arange(300), seq_len=4, batch_size=2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="num_windows=60 but this loader has num_windows=40"):
        loader.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="seq_len=9"):
        loader.load_state_dict({**state, "seq_len": 9})
    with pytest.raises(ValueError, match="consumed=41"):
        loader.load_state_dict({**state, "consumed": 41})


def test_too_small_corpus_error_names_the_numbers() -> None:
    msg = (r"corpus has 25 tokens -> 2 windows of seq_len\+1=10; one global batch needs "
           r"world_size\*batch_size=2\*2=4 windows")
    with pytest.raises(ValueError, match=msg):
        TokenLoader(torch.arange(25), seq_len=9, batch_size=2, rank=0, world_size=2)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(seq_len=0), "seq_len must be a positive int, got 0"),
    (dict(seq_len=-3), "seq_len must be a positive int, got -3"),
    (dict(batch_size=0), "batch_size must be a positive int, got 0"),
    (dict(world_size=0), "world_size must be a positive int, got 0"),
    (dict(rank=2), r"rank must be an int in \[0, world_size=2\), got 2"),
    (dict(rank=-1), r"rank must be an int in \[0, world_size=2\), got -1"),
    (dict(tokens=torch.zeros(4, 50, dtype=torch.long)), r"1-D tensor, got shape \(4, 50\)"),
    (dict(tokens=torch.zeros(200)), "integer dtype, got torch.float32"),
])
def test_loader_argument_errors(kwargs, pattern) -> None:
    args = dict(tokens=torch.arange(200), seq_len=4, batch_size=2, rank=0, world_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        TokenLoader(**args)
    if "tokens" not in kwargs:
        with pytest.raises(ValueError, match=pattern):
            iter_eval_batches(**args)


# ----------------------------------------------------------------------------- evaluation

def test_eval_batches_unshuffled_rank_sliced_and_bounded() -> None:
    seq_len, batch, world = 3, 2, 3
    tokens = torch.arange(20 * (seq_len + 1))  # 20 windows -> 3 global batches of 6
    per_rank = [list(iter_eval_batches(tokens, seq_len, batch, r, world)) for r in range(world)]
    assert [len(b) for b in per_rank] == [3, 3, 3]
    seen = [w for g in range(3) for r in range(world)
            for w in _window_ids(per_rank[r][g][0], seq_len)]
    assert seen == list(range(18))
    for inputs, targets in per_rank[1]:
        assert inputs.shape == (batch, seq_len) and torch.equal(targets, inputs + 1)
    assert len(list(iter_eval_batches(tokens, seq_len, batch, 0, world, max_batches=2))) == 2
    with pytest.raises(ValueError, match="max_batches must be a positive int, got 0"):
        iter_eval_batches(tokens, seq_len, batch, 0, world, max_batches=0)
    with pytest.raises(ValueError, match="validation set has 8 tokens -> 2 windows"):
        iter_eval_batches(tokens[:8], seq_len, batch, 0, world)


def test_loader_val_batches_matches_function_and_keeps_position() -> None:
    tokens = torch.arange(300)
    loader = TokenLoader(tokens, seq_len=4, batch_size=2, rank=1, world_size=2, seed=5)
    loader.next_batch()
    before = loader.state_dict()
    got = list(loader.val_batches(max_batches=4))
    want = list(iter_eval_batches(tokens, 4, 2, 1, 2, max_batches=4))
    assert len(got) == 4 and all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
    assert loader.state_dict() == before


