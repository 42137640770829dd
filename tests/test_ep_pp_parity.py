"""MoE layers inside pipeline stages train like one process (issue 13, EP x PP).

Every case trains a small MoE Llama (4 blocks, 8 experts, top-2) for three SGD + momentum
steps, clipped, from a meta-device build split into pipeline stages, and evaluates it with
the forward-only schedule; the reference is one process on the same global batches with
the same micro-batch grouping (``shardwise.testing.pp_moe_parity``): LM losses and gradient
norms within 1e-6 relative, final weights within 1e-5, the evaluation loss within 1e-6, the
global token counts per expert of every layer equal (on every rank: the statistics are
gathered over the pipeline ranks), aux and z values within 1e-6, capacity drops equal.

The grid: pp 2 on 2 ranks (ep 1) under every schedule (GPipe, 1F1B, interleaved 1F1B,
looped BFS, and the split-backward ZB-H1, ZB-V and DualPipeV, whose input and weight passes
both start from the balance roots), and on 4 ranks pp 2 x dp_shard 2 at ep 1 and ep 2 (each
stage's experts split over its two data ranks, gradients divided by the full data degree),
ZeRO stages 1 and 3 (and one case each at 0 and 2), capacity mode, DeepSeek-V3 bias
balancing with a shared expert and MoE in every second block (so that under interleaved
1F1B pipeline rank 0 holds no MoE layer at all), and stage 3 re-gathering per micro-batch;
pp 2 x tp 2 (sequence parallelism: each tensor rank routes its sequence shard, the balance
statistics summed over the stage's data and tensor ranks) on 4 ranks, and pp 2 x tp 2 x
dp_shard 2 with ep 2 on 8.
``SHARDWISE_PP_FULL=1`` runs every case at both ZeRO stages. One launch of ranks per world
size runs all its cases.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from shardwise.models import MoESettings, build_model, configure_moe, get_model_config
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err
from shardwise.testing.pp_moe_parity import (PPMoECase, pp_moe_batches, pp_moe_reference_run,
                                             pp_moe_run)

STEPS, PER_MICROBATCH, SEQ, VOCAB, CLIP = 3, 2, 8, 64, 1.0
SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, moe_ffn_dim=48, vocab_size=VOCAB,
             max_seq_len=16)
MODELS = {  # name: (MoESettings, model overrides)
    "base": (MoESettings(), {}),
    "capacity": (MoESettings(capacity_factor=1.0), {}),
    "bias-shared-every2": (MoESettings(balance="bias", bias_update_rate=0.01),
                           {"num_shared_experts": 1, "moe_every": 2}),
}
FULL = os.environ.get("SHARDWISE_PP_FULL") == "1"
C = PPMoECase
GRID = {
    2: [C("gpipe", 2, 3), C("1f1b", 4, 1), C("1f1b", 3, 3, model="capacity"),
        C("interleaved_1f1b", 4, 3, model="bias-shared-every2"), C("looped_bfs", 2, 1),
        C("zb1", 4, 3), C("zbv", 4, 1, model="bias-shared-every2"),
        C("dualpipev", 4, 3, model="capacity")],
    4: [C("1f1b", 4, 3, dp=2), C("interleaved_1f1b", 2, 1, dp=2, model="bias-shared-every2"),
        C("gpipe", 2, 1, dp=2, ep=2), C("gpipe", 4, 3, dp=2, ep=2),
        C("1f1b", 4, 3, dp=2, ep=2), C("1f1b", 3, 1, dp=2, ep=2, model="capacity"),
        C("1f1b", 2, 3, dp=2, ep=2, keep_gathered=False),
        C("interleaved_1f1b", 4, 1, dp=2, ep=2),
        C("interleaved_1f1b", 4, 3, dp=2, ep=2, model="bias-shared-every2"),
        C("looped_bfs", 4, 2, dp=2, ep=2), C("1f1b", 2, 0, dp=2, ep=2),
        C("zb1", 4, 3, dp=2, ep=2), C("zb1", 2, 1, dp=2, ep=2, keep_gathered=False),
        C("zbv", 4, 1, dp=2, ep=2, model="bias-shared-every2"),
        C("dualpipev", 4, 3, dp=2, ep=2, model="capacity"),
        C("1f1b", 4, 3, tp=2), C("interleaved_1f1b", 4, 1, tp=2, model="bias-shared-every2"),
        C("zbv", 4, 3, tp=2)],
    8: [C("1f1b", 4, 3, dp=2, ep=2, tp=2),
        C("interleaved_1f1b", 2, 1, dp=2, ep=2, tp=2, model="bias-shared-every2"),
        C("zb1", 4, 3, dp=2, ep=2, tp=2)],
}
assert all(len({c.name for c in cases}) == len(cases) for cases in GRID.values())
if FULL:
    GRID = {w: list({dataclasses.replace(c, stage=s): None for c in cases for s in (1, 3)})
            for w, cases in GRID.items()}


def _build(model: str, meta: bool):
    settings, overrides = MODELS[model]
    cfg = get_model_config("debug-moe", **SMALL, **overrides)
    net = build_model(cfg, device="meta") if meta else build_model(cfg, seed=0)
    return configure_moe(net, settings)


def _batches(case: PPMoECase) -> torch.Tensor:
    return pp_moe_batches(case, STEPS, PER_MICROBATCH, SEQ, VOCAB)


@functools.lru_cache(maxsize=None)
def _reference(model: str, microbatches: int, dp: int):
    case = PPMoECase("1f1b", microbatches, 3, dp=dp, model=model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only spin
    try:
        return pp_moe_reference_run(functools.partial(_build, model, False), _batches(case),
                                    case, CLIP)
    finally:
        torch.set_num_threads(threads)


def _worker(cases: list[PPMoECase]) -> dict:
    meshes: dict = {}
    return {c.name: pp_moe_run(functools.partial(_build, c.model, True), _batches(c), c, CLIP,
                               meshes) for c in cases}


@pytest.fixture(scope="module", params=sorted(GRID), ids=lambda w: f"world{w}")
def results(request):
    world = request.param
    cases = GRID[world]
    return cases, run_ranks(_worker, world, args=(cases,), timeout_s=600, threads=1)


def _errors(case: PPMoECase, got, ref) -> list[str]:
    """What differs from the reference beyond the tolerances (empty: parity)."""
    bad = []
    loss = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses, strict=True))
    norm = max(abs(a - b) / b for a, b in zip(got.grad_norms, ref.grad_norms, strict=True))
    evl = abs(got.eval_loss - ref.eval_loss) / abs(ref.eval_loss)
    if not (loss < 1e-6 and norm < 1e-6 and evl < 1e-6):
        bad.append(f"loss {loss:.2e}, grad norm {norm:.2e}, eval loss {evl:.2e}")
    if got.names != ref.names:
        bad.append(f"layers {got.names[0]} != {ref.names[0]}")
    for step, (counts, want) in enumerate(zip(got.counts, ref.counts, strict=True)):
        if not all(torch.equal(a, b) for a, b in zip(counts, want, strict=True)):
            bad.append(f"token counts differ at step {step}")
    if got.dropped != ref.dropped:
        bad.append(f"dropped {got.dropped} != {ref.dropped}")
    for vals, want in zip(got.balance, ref.balance, strict=True):
        for (aux, z), (aux_ref, z_ref) in zip(vals, want, strict=True):
            if aux != pytest.approx(aux_ref, rel=1e-6) or z != pytest.approx(z_ref, rel=1e-6):
                bad.append(f"aux / z {(aux, z)} != {(aux_ref, z_ref)}")
    experts = 8 // case.ep
    if not got.local_experts or any(e != experts for e in got.local_experts):
        bad.append(f"local experts {got.local_experts}, expected {experts} per layer")
    return bad


def test_moe_pipelines_train_like_one_process(results):
    cases, per_rank = results
    failures = []
    for case in cases:
        ref = _reference(case.model, case.microbatches, case.dp)
        state = {}
        for r in per_rank:
            state.update(r[case.name].state)
        err, key = max_rel_err(state, ref.state)
        if err >= 1e-5:
            failures.append(f"{case.name}: weights {err:.2e} ({key})")
        for rank, r in enumerate(per_rank):  # every rank reports the whole model's numbers
            failures += [f"{case.name} rank {rank}: {e}" for e in _errors(case, r[case.name],
                                                                          ref)]
    assert not failures, "\n".join(failures)


def test_the_grid_exercises_capacity_bias_and_a_rank_without_moe_layers(results):
    cases, _ = results
    for case in cases:
        ref = _reference(case.model, case.microbatches, case.dp)
        if case.model == "capacity":  # the capacity did drop assignments
            assert any(sum(d) > 0 for d in ref.dropped), ref.dropped
        if case.model == "bias-shared-every2":  # the bias moved; MoE in blocks 1 and 3 only
            assert ref.names[0] == ["layers.1.feed_forward", "layers.3.feed_forward"]
            biases = [v for k, v in ref.state.items() if k.endswith("expert_bias")]
            assert biases and all(b.any() for b in biases)
