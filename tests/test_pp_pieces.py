"""Any model that declares its pieces pipelines like one process (issue 34).

Two models nobody here wrote a pipeline forward for, each trained 3 steps (fp32, SGD +
momentum) on real ranks and compared with one process on the same micro-batches (weights
within 1e-5 relative to each tensor's largest value, losses within 1e-6):

* a two-tower toy (an image encoder of a few blocks + a projector feeding a causal decoder):
  the encoder and projector are ``"first"`` pieces of the first stage, the image features
  become prefix tokens of the decoder, so micro-batches with 2, 1 and 0 images send
  activations of different lengths (a shape message per new micro-batch signature); split
  into 2 and 3 stages under 1F1B and GPipe (and 4 virtual stages under ZB-V);
* Hugging Face's ``LlamaForCausalLM`` from a small config, read through
  :func:`hf_decoder_pieces` (its own modules and forwards), at 2 stages, tied and untied.

Some cases shard each stage's pieces (ZeRO 1 or 3 over the stage's one data rank: the
engine's hooks around pieces that see no image). One launch of ranks per world size runs
all its cases.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.pieces import Piece, PipelinePieces
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, cross_entropy_loss,
                                         shard_stages, split_stages)
from shardwise.parallel.pipeline.pieces import hf_decoder_pieces, pipeline_pieces
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err

STEPS, MICROBATCHES, ROWS, SEQ, VOCAB = 3, 3, 2, 5, 24
IMAGES = (2, 1, 0)  # images per micro-batch: the last has none


class Block(nn.Module):
    """A pre-norm block: causal self-attention (one head) and an MLP."""

    def __init__(self, dim: int, causal: bool) -> None:
        super().__init__()
        self.norm, self.qkv, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), \
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.causal = causal

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x if pos is None else x + pos)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, T, C) each
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).squeeze(1)
        return x + self.mlp(x)


class TwoTower(nn.Module):
    """Images ``(N, patches, P)`` shared by the micro-batch's rows and tokens ``(B, T)`` ->
    logits ``(B, T, V)``: each image's pooled, projected features are a prefix token."""

    def __init__(self, patch: int = 6, enc: int = 8, dim: int = 12, layers: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(patch, enc)
        self.vision = nn.ModuleList(Block(enc, causal=False) for _ in range(2))
        self.projector = nn.Linear(enc, dim)
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim, causal=True) for _ in range(layers))
        self.norm, self.output = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        self.dim = dim

    def positions(self, length: int) -> torch.Tensor:
        t = torch.arange(length, dtype=torch.float32)[:, None]
        return torch.sin(t / (1 + torch.arange(self.dim, dtype=torch.float32)))  # (L, C)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        feats = self.patch_embed(images)
        for block in self.vision:
            feats = block(feats)
        prefix = self.projector(feats).mean(1)  # (N, C)
        h = self.tok_embeddings(tokens)
        h = torch.cat([prefix.expand(tokens.shape[0], -1, -1), h], 1)  # (B, N + T, C)
        pos = self.positions(h.shape[1])
        for layer in self.layers:
            h = layer(h, pos)
        return self.output(self.norm(h)[:, images.shape[0]:])

    def pipeline_pieces(self) -> PipelinePieces:
        """The encoder, projector and token embedding on the first stage; the decoder
        blocks split; norm and head on the last. Side inputs: the position table and the
        image count, rebuilt by each stage from the micro-batch's (images, tokens)."""
        def encode(m, x, side):  # the running value: (image features, tokens)
            return m(x[0]), x[1]

        def merge(m, x, side):
            prefix = x[0].mean(1)
            return torch.cat([prefix.expand(x[1].shape[0], -1, -1), m(x[1])], 1)

        def side(inputs):
            images, tokens = inputs
            n = images.shape[0]
            return {"pos": self.positions(n + tokens.shape[1]), "images": n}

        return PipelinePieces(pieces=(
            Piece("patch_embed", self.patch_embed, "first", call=encode),
            *(Piece(f"vision.{i}", b, "first", call=encode) for i, b in enumerate(self.vision)),
            Piece("projector", self.projector, "first", call=encode),
            Piece("tok_embeddings", self.tok_embeddings, "first", call=merge),
            *(Piece(f"layers.{i}", b, call=lambda m, h, s: m(h, s["pos"]))
              for i, b in enumerate(self.layers)),
            Piece("norm", self.norm, "last", call=lambda m, h, s: m(h)[:, s["images"]:]),
            Piece("output", self.output, "last")), side=side)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str      # "two_tower" | "hf" | "hf_tied"
    schedule: str
    pp: int
    zero: int | None = None  # ZeRO stage inside each stage (None: not sharded)


CASES = [Case("two_tower", "1f1b", 2), Case("two_tower", "gpipe", 2, zero=3),
         Case("two_tower", "zbv", 2),  # a V: 4 stages on 2 ranks, the backward split
         Case("two_tower", "1f1b", 3, zero=1), Case("two_tower", "gpipe", 3),
         Case("hf", "1f1b", 2, zero=3), Case("hf_tied", "gpipe", 2)]


def _hf_llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=16, tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return TwoTower() if case.model == "two_tower" else _hf_llama(case.model == "hf_tied")


def _batches(case: Case):
    """Per step: the micro-batches' inputs and targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tok = [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g) for _ in IMAGES]
        xs, ys = [t[:, :-1] for t in tok], [t[:, 1:] for t in tok]
        if case.model == "two_tower":
            xs = [(torch.randn(n, 3, 6, generator=g), x) for n, x in zip(IMAGES, xs)]
        out.append((xs, ys))
    return out


def _forward(model: nn.Module, case: Case, x) -> torch.Tensor:
    return model(*x) if case.model == "two_tower" else model(input_ids=x).logits


def _reference(case: Case):
    model = _build(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for xs, ys in _batches(case):
        total = 0.0
        for x, y in zip(xs, ys):
            loss = cross_entropy_loss(_forward(model, case, x), y) / len(xs)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return dict(model.named_parameters()), losses


def _run_case(case: Case):
    model = _build(case)
    schedule = build_schedule(case.schedule, pp=case.pp, microbatches=MICROBATCHES)
    part = split_stages(model, None, schedule.virtual, placement=schedule.placement)
    if case.zero is not None:
        shard_stages(part, stage=case.zero)
    pipe = PipelineExecutor(part, schedule)
    opt = torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for xs, ys in _batches(case):
        losses.append(float(pipe.step(xs, ys)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in part.named_parameters()}, losses


def _ranks():
    world = torch.distributed.get_world_size()
    return {c: _run_case(c) for c in CASES if c.pp == world}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    return run_ranks(_ranks, world_size=request.param, timeout_s=180), request.param


def test_two_tower_and_hf_llama_match_one_process(results):
    per_rank, world = results
    for case in [c for c in CASES if c.pp == world]:
        ref_params, ref_losses = _reference(case)
        got = {}
        for rank_out in per_rank:
            params, losses = rank_out[case]
            assert losses == pytest.approx(ref_losses, rel=1e-6), case
            got.update(params)
        # every parameter, under its own name (max_rel_err checks the names first)
        err, name = max_rel_err(got, {n: p.detach() for n, p in ref_params.items()})
        assert err < 1e-5, (case, name, err)


def test_declarations():
    model = TwoTower()
    decl = pipeline_pieces(model)
    assert [p.name for p in decl.pieces if p.role == "first"] == [
        "patch_embed", "vision.0", "vision.1", "projector", "tok_embeddings"]
    # The declared chain is the model's forward, zero images included.
    for n in (2, 0):
        x = (torch.randn(n, 3, 6), torch.randint(0, VOCAB, (2, SEQ)))
        h, side = x, decl.side_inputs(x)
        for piece in decl.pieces:
            h = piece.run(piece.module, h, side)
        assert torch.equal(h, model(*x))
    hf = _hf_llama(tied=True)
    names = [p.name for p in hf_decoder_pieces(hf).pieces]
    assert names == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)),
                     "model.norm", "lm_head"]
    assert hf_decoder_pieces(hf).pieces[-1].tie == "model.embed_tokens.weight"
    part = split_stages(hf, None, 2)  # one rank holds both stages
    assert [st.piece_names[0] for st in part.stages] == ["model.embed_tokens",
                                                         "model.layers.2"]
    assert set(dict(part.named_parameters())) == set(dict(hf.named_parameters()))


@pytest.mark.parametrize("pieces, message", [
    (lambda m: PipelinePieces((Piece("norm", m.norm, "last"), Piece("layers.0", m.layers[0]))),
     "expected first pieces, then at least one block"),
    (lambda m: PipelinePieces((Piece("layers.0", m.layers[0], "middle"),)), "role must be"),
    (lambda m: PipelinePieces((Piece("layers.0", m.layers[0]), Piece("layers.0", m.layers[1]))),
     "repeat"),
    (lambda m: PipelinePieces((Piece("layers.0", m.layers[0], tie="norm.weight"),)),
     "a tie is a last piece"),
    (lambda m: PipelinePieces((Piece("tok_embeddings", m.tok_embeddings, "first"),
                               Piece("layers.0", m.layers[0]),
                               Piece("output", m.output, "last", tie="tok_embeddings.bias"))),
     "not a parameter of TwoTower"),
])
def test_refusals(pieces, message):
    model = TwoTower()
    with pytest.raises(ValueError, match=message):
        split_stages(model, None, 1, pieces=pieces(model))
    with torch.device("meta"):
        meta = TwoTower()
    out_of_order = PipelinePieces((Piece("layers.1", meta.layers[1]),
                                   Piece("layers.0", meta.layers[0])))
    with pytest.raises(ValueError, match="not in TwoTower's named_modules"):
        split_stages(meta, None, 1, pieces=out_of_order)
