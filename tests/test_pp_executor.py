"""The pipeline splitter and executor in one process (no ranks): splits, refusals, and every
stage on one rank, where the executor hands activations and gradients over locally.

With pp = 1 a schedule still has ``virtual`` stages (interleaved 1F1B, ZB-V); running it in
one process exercises the executor's whole path but the messages: micro-batches, the loss
scaling, I and W passes, local hand-overs and the tied mirror, against the unsplit model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.distributed.comm import p2p
from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.pipeline import (SCHEDULE_NAMES, PipelineExecutor, build_schedule,
                                         cross_entropy_loss, forward_schedule,
                                         split_microbatches, split_stages, stage_layer_counts)

CFG = LlamaConfig(dim=16, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                  max_seq_len=8)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threads only spin (badly so on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_layer_counts_even_uneven_and_explicit():
    assert stage_layer_counts(7, 3) == (3, 2, 2)
    assert stage_layer_counts(8, 4) == (2, 2, 2, 2)
    assert stage_layer_counts(7, 3, [1, 2, 4]) == (1, 2, 4)


@pytest.mark.parametrize("args, message", [
    ((3, 4), "the model has 3 layers, fewer than the 4 pipeline stages (pp x virtual)"),
    ((7, 3, [3, 2]), "layers_per_stage=[3, 2] has 2 entries; expected one per stage"),
    ((7, 3, [3, 4, 0]), "layers_per_stage=[3, 4, 0]: every stage needs at least one layer"),
    ((7, 3, [3, 3, 3]), "layers_per_stage=[3, 3, 3] sums to 9; the model has 7 layers"),
])
def test_layer_counts_refusals(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        stage_layer_counts(*args)


def test_split_keeps_the_unsplit_names_and_refuses_other_models():
    model = build_model(CFG, device="meta")
    part = split_stages(model, None, 4, [1, 1, 1, 1])
    assert [s.index for s in part.stages] == [0, 1, 2, 3]
    assert set(part.state_dict()) == set(model.state_dict())
    assert list(part.stages[1].layers) == ["1"]
    with pytest.raises(ValueError, match="lacks \\['tok_embeddings', 'layers', 'norm'"):
        split_stages(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="placement \\[0, 0, 1\\] does not put virtual=1"):
        split_stages(model, None, 1, placement=[0, 0, 1])
    with pytest.raises(RuntimeError, match="runs through its executor"):
        part(torch.zeros(1, 2, dtype=torch.long))


def test_executor_refusals():
    part = split_stages(build_model(CFG, seed=0), None, 2)
    with pytest.raises(ValueError, match="split with placement=schedule.placement"):
        PipelineExecutor(part, build_schedule("1f1b", pp=1, microbatches=2))
    with pytest.raises(ValueError, match="a batch of 6 sequences does not split into "
                                         "pp_microbatches=4 equal micro-batches"):
        split_microbatches(torch.zeros(6, 3), 4)
    with pytest.raises(ValueError, match="peer 0 is this rank"):
        p2p.batch_isend_irecv([p2p.Message(torch.zeros(2), 0, True, "x")])


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_forward_only_schedules_validate(name):
    schedule = build_schedule(name, pp=3, microbatches=6)
    fwd = forward_schedule(schedule)
    assert all(a.kind.value in ("F", "SEND_F", "RECV_F") for acts in fwd.ranks for a in acts)
    assert sum(a.kind.value == "F" for acts in fwd.ranks for a in acts) == 6 * fwd.num_stages


@pytest.mark.parametrize("name, tied", [("1f1b", False), ("interleaved_1f1b", True),
                                        ("zbv", False), ("zbv", True), ("dualpipev", False)])
def test_one_rank_holding_every_stage_matches_the_unsplit_model(name, tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    reference = build_model(cfg, seed=0)
    schedule = build_schedule(name, pp=1, microbatches=4)
    part = split_stages(build_model(cfg, seed=0), None, schedule.virtual,
                        placement=schedule.placement)
    pipe = PipelineExecutor(part, schedule)
    tokens = torch.randint(0, 32, (8, 5), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = pipe.step(x, y)
    expected = cross_entropy_loss(reference(x), y)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-6)
    grads = dict(reference.named_parameters())
    for n, p in part.named_parameters():
        assert torch.allclose(p.grad, grads[n].grad, rtol=1e-5, atol=1e-7), n
    assert part.mirror is None or part.mirror.weight.grad is None  # folded into the owner
    assert torch.allclose(pipe.evaluate(x, y), loss, rtol=1e-6)
