"""The vision-language-action model through pipeline stages (issue 34): its declared pieces
are its forward, a VLA batch splits into micro-batches of samples with their own frames, and
a small debug-vla trained 3 steps (fp32, SGD + momentum) at pp 2 and 3 matches one process
on the whole batch (weights within 1e-5 relative, losses within 1e-6).

The vision tower, projector and token embedding are the first stage's; on some steps one
micro-batch holds no frame, so that stage's tower runs on ``N = 0`` images (its ZeRO-3
gathers and reductions still happen). One launch of ranks per world size runs all its cases.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.data.vla import VLABatch, VLASample, collate
from shardwise.models import LlamaConfig, VLAConfig, build_model
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, shard_stages,
                                         split_stages)
from shardwise.parallel.pipeline.pieces import pipeline_pieces
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err
from shardwise.train.vla_pipeline import vla_microbatches

SMALL = VLAConfig(decoder=LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                      vocab_size=48, multiple_of=16, max_seq_len=32),
                  image_size=16, patch_size=8, vision_dim=16, vision_layers=2, vision_heads=2,
                  num_action_tokens=8)
TIED = dataclasses.replace(SMALL, decoder=dataclasses.replace(SMALL.decoder,
                                                              tie_embeddings=True))
STEPS, BATCH, MICRO = 3, 4, 2
# Frames per sample, per step: step 0's second micro-batch (samples 2, 3) holds none, step
# 2's first none.
FRAMES = ((1, 2, 0, 0), (2, 0, 1, 1), (0, 0, 2, 1))


def _sample(cfg: VLAConfig, frames: int, g: torch.Generator) -> VLASample:
    words = torch.randint(5, cfg.first_action_id, (int(torch.randint(2, 5, (), generator=g)),),
                          generator=g).tolist()
    ids = [1] + [cfg.image_token_id] * (frames * cfg.num_patches) + words + [cfg.act_token_id]
    tokens = torch.tensor(ids)
    labels = torch.full_like(tokens, -100)
    labels[-1] = cfg.first_action_id + int(torch.randint(0, 7, (), generator=g))
    images = torch.rand(frames, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    return VLASample(tokens, labels, images)


def _batches(cfg: VLAConfig) -> list[VLABatch]:
    g = torch.Generator().manual_seed(1)
    return [collate([_sample(cfg, n, g) for n in step]) for step in FRAMES]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


# --- one process --------------------------------------------------------------------------


def test_the_declared_pieces_are_the_forward_with_and_without_frames():
    model = build_model(SMALL, seed=0)
    decl = pipeline_pieces(model)
    assert [p.name for p in decl.pieces if p.role == "first"] == [
        "vision", "projector", "tok_embeddings"]
    assert [p.name for p in decl.pieces if p.role == "last"] == ["norm", "output"]
    for batch in _batches(SMALL)[0].split(MICRO):  # 3 frames, then none
        x = (batch.tokens, batch.images)
        h, side = x, decl.side_inputs(x)
        for piece in decl.pieces:
            h = piece.run(piece.module, h, side)
        assert torch.equal(h, model(*x))
    tied = pipeline_pieces(build_model(TIED, seed=0))
    assert tied.pieces[-1].tie == "tok_embeddings.weight"


def test_a_vla_batch_splits_by_samples_with_their_frames():
    batch = _batches(SMALL)[1]  # frames (2, 0, 1, 1)
    assert batch.frames_per_sample() == [2, 0, 1, 1]
    halves = batch.split(2)
    assert [b.num_images for b in halves] == [2, 2]
    quarters = batch.split(4)
    assert [b.num_images for b in quarters] == [2, 0, 1, 1]
    assert torch.equal(torch.cat([b.images for b in quarters]), batch.images)
    assert all(b.tokens.shape[1] == batch.tokens.shape[1] for b in quarters)
    assert torch.equal(torch.cat([b.labels for b in quarters]), batch.labels)
    with pytest.raises(ValueError, match="does not split into parts=3"):
        batch.split(3)
    inputs, labels = vla_microbatches(batch, 2, torch.device("cpu"))
    assert [x[1].shape[0] for x in inputs] == [2, 2] and len(labels) == 2


# --- pipelined ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    zero: int | None = None  # ZeRO stage inside each stage (None: not sharded)
    tied: bool = False


CASES = [Case("1f1b", 2), Case("1f1b", 2, zero=1), Case("gpipe", 2, zero=3),
         Case("1f1b", 2, zero=3, tied=True), Case("gpipe", 3, zero=3)]


def _cfg(case: Case) -> VLAConfig:
    return TIED if case.tied else SMALL


def _reference(case: Case):
    cfg = _cfg(case)
    model = build_model(cfg, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _batches(cfg):  # the whole batch at once
        loss = _loss(model(batch.tokens, batch.images), batch.labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _run_case(case: Case):
    cfg = _cfg(case)
    schedule = build_schedule(case.schedule, pp=case.pp, microbatches=MICRO)
    part = split_stages(build_model(cfg, seed=0), None, schedule.virtual,
                        placement=schedule.placement)
    if case.zero is not None:
        shard_stages(part, stage=case.zero)
    pipe = PipelineExecutor(part, schedule)
    opt = torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _batches(cfg):
        losses.append(float(pipe.step(*vla_microbatches(batch, MICRO, torch.device("cpu")))))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in part.named_parameters()}, losses


def _ranks():
    world = torch.distributed.get_world_size()
    return {c: _run_case(c) for c in CASES if c.pp == world}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_ranks(_ranks, world_size=request.param, timeout_s=180), request.param


def test_pipelined_vla_matches_one_process(results):
    per_rank, world = results
    for case in [c for c in CASES if c.pp == world]:
        ref_params, ref_losses = _reference(case)
        got = {}
        for rank_out in per_rank:
            params, losses = rank_out[case]
            assert losses == pytest.approx(ref_losses, rel=1e-6), case
            got.update(params)
        err, name = max_rel_err(got, ref_params)  # every parameter, under its own name
        assert err < 1e-5, (case, name, err)
