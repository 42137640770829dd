"""Ranks that run different numbers of micro-batches (issue 30.3).

* A hand-written loop where one rank runs one forward / backward more than its peers in
  one step: the first gather that pairs different steps raises on every rank, naming each
  rank's step and micro-batch ([Note: step identity]), at stages 1-3, on 2 and 3 ranks;
  before, the ranks trained on gradients mixed across steps and the job "succeeded".
* ``shardwise.join``: loaders of different lengths train to the weights of a
  single-process reference that replays what each rank ran (the missing ranks' gradients
  counted as zeros), at stages 0-3, with accumulation and gradient clipping inside the loop,
  on 2 and 3 ranks; a rank with no batch at all is refused on every rank.
* The watchdog tells a peer that ended normally from one that crashed, and shows its real
  last collective.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.shard.identity import GatherMismatch
from shardwise.shard.registry import engine_states
from shardwise.testing.dist import run_ranks
from shardwise.testing.models import EdgeBlock, EdgeCaseModel

VOCAB, SEQ, BATCH = 11, 6, 2


def _model() -> EdgeCaseModel:
    torch.manual_seed(0)
    return EdgeCaseModel(vocab=VOCAB)


def _batch(rank: int, i: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * i + micro)
    return torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=g)  # token 0 never: no `rare`


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


# ----------------------------------------------------------------------------- one extra
def _one_extra_microbatch() -> list[str]:
    """Rank 1 runs an extra forward / backward in step 2 of 4; every other rank one per step.
    Returns, per stage, what this rank raised (every rank must raise at the same gather)."""
    rank, out = dist.get_rank(), []
    for stage in (1, 2, 3):
        model = shardwise.shard(_model(), stage=stage, wrap={EdgeBlock})
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        try:
            for step in range(4):
                for micro in range(2 if (step == 1 and rank == 1) else 1):
                    _loss(model, _batch(rank, step, micro)).backward()
                opt.step()
                opt.zero_grad()
            out.append("no error")
        except GatherMismatch as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_an_extra_microbatch_on_one_rank_is_named_at_the_first_mispaired_gather(world):
    results = run_ranks(_one_extra_microbatch, world, timeout_s=120)
    others = "ranks 0, 2" if world == 3 else "rank 0"
    for stage_messages in zip(*results):
        assert len(set(stage_messages)) == 1, stage_messages  # the same error on every rank
        message = stage_messages[0]
        assert ("the ranks gathered unit '<root>' for different steps: "
                f"{others} at step 3, micro-batch 1; rank 1 at step 2, micro-batch 2") \
            in message, message
        assert "shardwise.join" in message


def _same_microbatches_with_accumulation() -> list[tuple[int, int]]:
    """Control: every rank runs 3 micro-batches a step (no_sync for the first two), checked
    through the trailer of every gather; no error, and the counts advance as designed."""
    rank = dist.get_rank()
    model = shardwise.shard(_model(), stage=3, wrap={EdgeBlock})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = engine_states(model)[0]
    seen = []
    for step in range(2):
        for micro in range(3):
            with shardwise.no_sync(model) if micro < 2 else contextlib.nullcontext():
                _loss(model, _batch(rank, step, micro)).backward()
            count = state.root.tag.count
            seen.append((count.step, count.microbatch))
        opt.step()
        opt.zero_grad()
    return seen


def test_equal_microbatches_pass_and_count_steps_and_microbatches():
    seen = run_ranks(_same_microbatches_with_accumulation, 2, timeout_s=60)
    assert seen[0] == seen[1] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


# ----------------------------------------------------------------------------- join
LENGTHS = {2: [3, 5], 3: [4, 2, 3]}  # batches per rank: a rank that ends first, a middle one
ACCUM, CLIP = 2, 0.5


def _join_case(rank: int, world: int, stage: int, accum: int, clip: bool):
    """Train with shardwise.join on this rank's LENGTHS[world][rank] items (each ``accum``
    micro-batches); returns the full weights and what the loop saw."""
    model = shardwise.shard(_model(), stage=stage, wrap={EdgeBlock})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    items = [[_batch(rank, i, m) for m in range(accum)] for i in range(LENGTHS[world][rank])]
    shadowed = 0
    for micros in (uneven := shardwise.join(model, items)):
        for m, tokens in enumerate(micros):
            last = m == len(micros) - 1
            with contextlib.nullcontext() if last else shardwise.no_sync(model):
                (_loss(model, tokens) / accum).backward()
        if clip:
            shardwise.clip_grad_norm_(model, CLIP)  # a collective inside the loop body
        opt.step()
        opt.zero_grad()
        shadowed += uneven.shadowing
    full = shardwise.full_state_dict(model)
    return full, uneven.iterations, shadowed


def _join_grid() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    return [_join_case(rank, world, stage, accum, clip)
            for stage, accum, clip in [(0, 1, False), (1, 1, True), (2, ACCUM, False),
                                       (3, 1, False), (3, ACCUM, True)]]


def _replay(world: int, accum: int, clip: bool) -> dict[str, torch.Tensor]:
    """One process: each step sums the gradients of the ranks that still had data, over
    ``world`` (the engine's average, the missing ranks' gradients zeros)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(max(LENGTHS[world])):
        for rank in range(world):
            if i < LENGTHS[world][rank]:
                for m in range(accum):
                    (_loss(model, _batch(rank, i, m)) / accum).backward()
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad / world
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_join_trains_uneven_inputs_to_the_replayed_reference(world):
    results = run_ranks(_join_grid, world, timeout_s=240)
    cases = [(0, 1, False), (1, 1, True), (2, ACCUM, False), (3, 1, False), (3, ACCUM, True)]
    for k, (stage, accum, clip) in enumerate(cases):
        ref = _replay(world, accum, clip)
        full, iterations, _ = results[0][k]
        assert iterations == max(LENGTHS[world])
        for rank in range(world):
            shadowed = results[rank][k][2]
            assert shadowed == max(LENGTHS[world]) - LENGTHS[world][rank], (stage, rank)
        for name, want in ref.items():
            if name in full:  # buffers are not in the sharded full state
                err = (full[name] - want).norm() / max(want.norm(), 1e-12)
                assert err < 1e-5, (stage, accum, clip, name, float(err))


def _joined_without_data() -> str:
    rank = dist.get_rank()
    model = shardwise.shard(_model(), stage=2, wrap={EdgeBlock})
    items = [] if rank == 1 else [_batch(rank, 0)]
    try:
        for tokens in shardwise.join(model, items):
            _loss(model, tokens).backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_join_refuses_a_rank_with_no_batch_on_every_rank():
    messages = run_ranks(_joined_without_data, 2, timeout_s=60)
    assert messages[0] == messages[1]
    assert "rank(s) [1] of the group had no batch at all" in messages[0]


def test_join_needs_a_sharded_model():
    with pytest.raises(ValueError, match="needs a module passed to shardwise.shard"):
        shardwise.join(torch.nn.Linear(2, 2), [1])


# ----------------------------------------------------------------------------- watchdog
_FEWER_STEPS = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    import shardwise
    from shardwise.testing.models import EdgeBlock, EdgeCaseModel

    env = shardwise.distributed.init(timeout_s=60)
    model = shardwise.shard(EdgeCaseModel(vocab=11), stage=3, wrap={EdgeBlock})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2 if env.rank == 0 else 3):   # rank 0 ends a step early, normally
        tokens = torch.randint(1, 11, (2, 7))
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
""")


def test_the_watchdog_says_a_peer_ended_normally_and_shows_its_last_collective(tmp_path):
    script = tmp_path / "fewer_steps.py"
    script.write_text(_FEWER_STEPS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script)], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert "shardwise watchdog: rank 0 ended before its peers: its process" in text, text[-3000:]
    assert "ended without an error" in text and "killed, out of memory" not in text
    assert "its last heartbeat: no collective yet" not in text
    assert "before it ended it issued" in text and "last collective: reduce_scatter" in text
