"""A rank whose forward skips a module never hangs and never mispairs (issue 34).

A tiny Hugging Face LLaVA (CLIP tower + projector + Llama, built from a config) and an
Idefics3 (SigLIP-style tower + connector + Llama) at 2 ranks, stages 0-3, SGD with momentum,
3 steps, where one rank's micro-batch is text only on some steps (no ``pixel_values``: HF
never calls the tower there) and on one step every rank's is: equal to one process on the
global batch (one forward over every sample) within 1e-5 relative, with the tower trainable
or frozen; a frozen tower's model-state bytes equal the trainable-only formula exactly.

A plain model with a skippable middle branch called on some ranks only (3 ranks, stage 3,
prefetch 1 and 2): every rank issues the same gathers, in the same order, as a run where
every rank calls the branch ([Note: skipped units] in shardwise/shard/skippable.py), and the
weights equal one process.

And the refusals: declaring a module skippable that is not a submodule, or not a unit and
holding none, raises a ValueError naming it before any collective (no process group here).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.shard import engine_states
from shardwise.shard.unit import Unit
from shardwise.testing import run_ranks
from shardwise.testing.topology_parity import has_transformers, weight_err

TOL = 1e-5
STEPS = 3
PER_RANK, SEQ, VOCAB, IMAGE_TOKEN = 2, 10, 64, 63
# which ranks' micro-batches hold images, per step (world 2)
SCHEDULES = {"all-images": [(1, 1), (1, 1), (1, 1)],
             "one-text": [(1, 1), (1, 0), (0, 0)],
             "text-first": [(0, 1), (0, 0), (1, 0)]}


# ----------------------------------------------------------------------- models
def build_vlm(kind: str, frozen: bool):
    """(model, wrap, tokens per image) of a tiny HF VLM, same weights for the same kind."""
    from transformers import LlamaConfig
    tc = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                     max_position_embeddings=64)
    torch.manual_seed(0)
    if kind.startswith("llava"):
        from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer, CLIPVisionModel
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, image_size=8, patch_size=4)
        model = LlavaForConditionalGeneration(LlavaConfig(
            vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-1, vision_feature_select_strategy="default",
            image_seq_length=4))
        wrap = {CLIPEncoderLayer, LlamaDecoderLayer, LlavaMultiModalProjector}
        if kind == "llava-nested":  # the tower a unit too, its layers units inside it
            wrap.add(CLIPVisionModel)
        tower, per_image = model.model.vision_tower, 4
    else:
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration
        from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
        from transformers.models.idefics3.modeling_idefics3 import (Idefics3Connector,
                                                                    Idefics3EncoderLayer)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        vc = Idefics3VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=8, patch_size=4)
        model = Idefics3ForConditionalGeneration(Idefics3Config(
            vision_config=vc.to_dict(), text_config=tc.to_dict(), image_token_id=IMAGE_TOKEN,
            scale_factor=2))
        wrap = {Idefics3EncoderLayer, LlamaDecoderLayer, Idefics3Connector}
        tower, per_image = model.model.vision_model, 1
    if frozen:
        tower.requires_grad_(False)
    return model, wrap, per_image


def vlm_batch(kind: str, step: int, images: tuple[int, ...], per_image: int):
    """Per rank: (input_ids, pixel_values or None); a rank with images puts ``per_image``
    placeholder tokens in each sample."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for has in images:
        ids = torch.randint(0, IMAGE_TOKEN - 1, (PER_RANK, SEQ), generator=g)
        pix = torch.randn(PER_RANK, 3, 8, 8, generator=g)
        if not has:
            out.append((ids, None))
            continue
        ids[:, 1:1 + per_image] = IMAGE_TOKEN
        out.append((ids, pix if kind.startswith("llava") else pix.unsqueeze(1)))
    return out


def vlm_loss(model, ids, pix) -> torch.Tensor:
    """Mean next-token cross entropy over the micro-batch (equal sizes on every rank, so the
    mean of the ranks' losses is the mean over the global batch)."""
    kw = {} if pix is None else {"pixel_values": pix}
    logits = model(input_ids=ids, **kw).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _zero_missing(model) -> None:
    for p in model.parameters():  # the engine's contract: an unused parameter gets zeros
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


@functools.lru_cache(maxsize=None)  # shared by the stages' cases; never mutated
def vlm_reference(kind: str, frozen: bool, schedule: str) -> dict[str, torch.Tensor]:
    """One process, one forward over the global batch (images where some rank had them)."""
    model, _, per_image = build_vlm(kind, frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, images in enumerate(SCHEDULES[schedule]):
        parts = vlm_batch(kind, step, images, per_image)
        ids = torch.cat([i for i, _ in parts])
        pix = None
        if any(images):
            pix = torch.cat([p if p is not None else torch.zeros_like(_any_pix(parts))
                             for _, p in parts]) if kind == "idefics3" else \
                torch.cat([p for _, p in parts if p is not None])
        vlm_loss(model, ids, pix).backward()
        _zero_missing(model)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _any_pix(parts):
    return next(p for _, p in parts if p is not None)


def _shard_bytes(model, wrap, world: int, rank: int) -> dict[str, int]:
    """Model-state bytes of ``rank`` by the formula: every parameter's padded dim-0 chunk
    plus a 16-byte gather trailer per unit (params); the padded chunks of the trainable
    parameters of units that train (grads); this rank's rows of each trainable parameter
    (SGD momentum)."""
    units: dict[int, list[nn.Parameter]] = {}
    owner = {id(model): id(model)}
    for m in model.modules():
        parent = owner.get(id(m), id(model))
        for child in m.children():
            owner[id(child)] = id(child) if isinstance(child, tuple(wrap)) else parent
        for p in m._parameters.values():
            if p is not None:
                units.setdefault(owner[id(m)], [])
                if all(q is not p for ps in units.values() for q in ps):
                    units[owner[id(m)]].append(p)
    params = grads = opt = 0
    for ps in units.values():
        if not ps:
            continue
        padded = []
        for p in ps:
            rows, row = p.shape[0], math.prod(p.shape[1:])
            chunk = -(-rows // world)
            padded.append(chunk * row)
            if p.requires_grad:
                opt += max(0, min(chunk, rows - rank * chunk)) * row * 4
        params += sum(padded) * 4 + 16
        grads += sum(n for n, p in zip(padded, ps) if p.requires_grad) * 4
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": opt}


def vlm_run(kind: str, frozen: bool, schedule: str, stage: int):
    """Train on the current ranks; (rank 0's full weights, this rank's bytes, formula)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, wrap, per_image = build_vlm(kind, frozen)
    expected = _shard_bytes(model, wrap, world if stage else 1, 0 if stage == 0 else rank)
    if stage == 0:  # whole parameters, no trailers
        expected["param_bytes"] = sum(p.numel() for p in model.parameters()) * 4
    run = shardwise.shard(model, stage=stage, wrap=wrap, prefetch=2 if stage == 3 else 1)
    opt = torch.optim.SGD(run.parameters(), lr=0.1, momentum=0.9)
    for step, images in enumerate(SCHEDULES[schedule]):
        ids, pix = vlm_batch(kind, step, images, per_image)[rank]
        vlm_loss(run, ids, pix).backward()
        opt.step()
        opt.zero_grad()
    rep = shardwise.memory_report(run, opt)
    got = {k: getattr(rep, k) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    return shardwise.full_state_dict(model, rank0_only=True), got, expected


VLM_CASES = ([(k, fz, sc, st) for k in ("llava",) for fz in (False, True)
              for sc in SCHEDULES for st in (0, 1, 2, 3)]
             + [("llava-nested", False, "one-text", st) for st in (1, 3)]
             + [("idefics3", fz, sc, st) for fz in (False, True) for sc in ("one-text",)
                for st in (0, 1, 3)]
             + [("idefics3", False, "text-first", 2)])


def vlm_grid(cases) -> dict:
    # no per-case recovery: a failed case leaves the ranks' collectives out of step
    return {case: vlm_run(*case) for case in cases}


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_vlm_ranks_with_and_without_images_equal_one_process():
    results = run_ranks(vlm_grid, world_size=2, args=(VLM_CASES,), timeout_s=600)
    failures = []
    for case in VLM_CASES:
        kind, frozen, schedule, stage = case
        for rank, res in enumerate(results):
            _, got, expected = res[case]
            if expected is not None and got != expected:
                failures.append(f"{case} rank {rank}: model-state bytes {got} != {expected}")
        ref = vlm_reference(kind, frozen, schedule)
        state = results[0][case][0]
        err, key = weight_err(state, ref)  # relative, floored for near-zero tensors
        if err > TOL:
            failures.append(f"{case}: weights differ from one process by {err:.2e} ({key})")
        if frozen:  # a frozen tower never moved, and never got a gradient buffer
            tower = [k for k in ref if ".vision_" in k]
            assert tower and all(torch.equal(state[k], ref[k]) for k in tower)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------- plain model
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Branchy(nn.Module):
    """inp -> a -> (+ branch, on some ranks) -> b -> out; ``branch`` is two units."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp, self.a = nn.Linear(6, 8), Block(8)
        self.branch = nn.Sequential(Block(8), Block(8))
        self.b, self.out = Block(8), nn.Linear(8, 3)
        if frozen:
            self.branch.requires_grad_(False)

    def forward(self, x, use_branch: bool):
        h = self.a(self.inp(x))
        if use_branch:
            h = h + self.branch(h)
        return self.out(self.b(h))


BRANCH = {"mixed": [(1, 0, 1), (0, 0, 0), (0, 1, 1)], "all": [(1, 1, 1)] * 3}


def _toy_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def toy_run(schedule: str, prefetch: int, frozen: bool):
    """(rank 0's weights, this rank's issued gathers per step, labelled by unit)."""
    rank = dist.get_rank()
    model = Branchy(frozen)
    shardwise.shard(model, stage=3, wrap={Block}, prefetch=prefetch,
                    skippable=[model.branch])
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    issued: list[str] = []
    original = Unit._issue_gather

    def record(self):
        issued.append(self.label)
        return original(self)
    Unit._issue_gather = record
    try:
        for step, uses in enumerate(BRANCH[schedule]):
            x, y = _toy_batch(step, rank)
            issued.append(f"step {step}")
            loss = F.cross_entropy(model(x, bool(uses[rank])), y)
            issued.append("backward")
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        Unit._issue_gather = original
    return shardwise.full_state_dict(model, rank0_only=True), issued


def toy_reference(schedule: str, frozen: bool, world: int) -> dict[str, torch.Tensor]:
    model = Branchy(frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for step, uses in enumerate(BRANCH[schedule]):
        loss = sum(F.cross_entropy(model(*_toy_batch(step, r)[:1], bool(uses[r])),
                                   _toy_batch(step, r)[1]) for r in range(world)) / world
        loss.backward()
        _zero_missing(model)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


TOY_CASES = [(s, p, fz) for s in BRANCH for p in (1, 2) for fz in (False, True)]


def toy_grid() -> dict:
    return {case: toy_run(*case) for case in TOY_CASES}


def test_a_skipped_branch_issues_the_gathers_of_a_run_that_calls_it():
    results = run_ranks(toy_grid, world_size=3, timeout_s=300)
    for schedule, prefetch, frozen in TOY_CASES:
        case = (schedule, prefetch, frozen)
        seqs = [r[case][1] for r in results]
        assert seqs[0] == seqs[1] == seqs[2], f"{case}: ranks issued different gathers"
        # data-independent: the same sequence as when every rank calls the branch
        assert seqs[0] == results[0][("all", prefetch, frozen)][1], case
        assert any(lab.startswith("branch") for lab in seqs[0]), case
        ref = toy_reference(schedule, frozen, 3)
        state = results[0][case][0]
        err, _ = weight_err(state, ref)
        assert err <= TOL, f"{case}: weights differ from one process by {err:.2e}"


# ----------------------------------------------------------------------- refusals
def test_declaring_a_module_outside_the_model_is_refused_by_name():
    model = Branchy()
    with pytest.raises(ValueError, match=r"skippable module Linear is not a submodule"):
        shardwise.shard(model, stage=3, wrap={Block}, skippable=[nn.Linear(2, 2)])
    assert not engine_states(model)


def test_declaring_a_module_that_is_no_unit_is_refused_by_name():
    model = Branchy()
    with pytest.raises(ValueError, match=r"skippable module Linear at 'inp' is not a unit"):
        shardwise.shard(model, stage=2, wrap={Block}, skippable=[model.inp])
    with pytest.raises(ValueError, match=r"'' is the sharded module itself|sharded module "
                                         r"itself"):
        shardwise.shard(model, stage=1, wrap={Block}, skippable=[model])
    assert not engine_states(model)


def test_the_automatic_rule_finds_hf_towers_and_projectors_only_in_vlms():
    if not has_transformers():
        pytest.skip("needs transformers")
    from shardwise.shard.skippable import auto_skippable
    for kind in ("llava", "idefics3"):
        model, _, _ = build_vlm(kind, False)
        names = {n for n, m in model.named_modules()
                 if any(m is s for s in auto_skippable(model))}
        want = ({"model.vision_tower", "model.multi_modal_projector"} if kind == "llava"
                else {"model.vision_model", "model.connector"})
        assert names == want, (kind, names)
    from transformers import CLIPConfig, CLIPModel  # contrastive: both towers always run
    clip = CLIPModel(CLIPConfig(
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "vocab_size": 32},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 8, "patch_size": 4}))
    assert auto_skippable(clip) == []
    marked = Branchy()
    marked.branch.shardwise_skippable = True
    assert auto_skippable(marked) == [marked.branch]


class Twice(Branchy):
    def forward(self, x, use_branch: bool):
        h = self.a(self.inp(x))
        return self.out(self.b(h + self.branch(h) + self.branch(h)))


def _called_twice() -> str:
    model = Twice()
    shardwise.shard(model, stage=3, wrap={Block}, skippable=[model.branch])
    try:
        model(torch.randn(2, 6), True)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_skippable_unit_run_twice_in_one_forward_is_named():
    msg = run_ranks(_called_twice, world_size=1, timeout_s=60)[0]
    assert "skippable unit 'branch.0' started its forward after it had run" in msg, msg
