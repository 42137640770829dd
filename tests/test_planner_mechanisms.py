"""The cost model's mechanisms that published runs exposed (docs/planner.md, "Validated
against published runs"): sequence-parallel collectives, AsyncTP, the stacks' selective
checkpointing policies, gradient synchronisation after the last backward, fp32 reductions
and fused norms. Each is checked against its definition on one layer or one layout."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardwise.planner import comm_model, get_hardware, get_model_spec
from shardwise.planner.cost_model import CostModel
from shardwise.planner.devices.registry import device_model
from shardwise.planner.dp_cost import dp_times
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.recompute import check_selective, layer_ac, replayed_matmuls
from shardwise.planner.stage_cost import StageCoster
from shardwise.planner.work import layer_work
from shardwise.planner.workload import Workload, parse_workload
from tests.planner_helpers import train_config

H100 = get_hardware("h100")
LLAMA8 = get_model_spec("llama3-8b")
LLAMA70 = get_model_spec("llama3-70b")


def _layer(wl: Workload, spec=LLAMA70, tp=8, sp=True, ac="full", mb=2):
    return StageCoster(spec, device_model(H100), wl).layer(False, tp, 1, sp, 1, mb, ac)


def test_sequence_parallel_moves_the_bytes_of_two_all_reduces():
    """Two all-gathers and two reduce-scatters per layer and pass (Korthikanti et al. 2022,
    4.2.2): the same bytes as tensor parallelism's two all-reduces."""
    wl = Workload(seq_len=8192, global_batch=8)
    act = 2 * 8192 * LLAMA70.dim * wl.act_bytes
    grp = comm_model.place(8, 1, H100.gpus_per_node)
    one = 2 * (comm_model.all_gather_time(act / 8, grp, H100)
               + comm_model.reduce_scatter_time(act / 8, grp, H100))
    for ac, passes in (("none", 2), ("selective", 2), ("full", 3)):
        sp, no_sp = _layer(wl, sp=True, ac=ac), _layer(wl, sp=False, ac=ac)
        assert sp.tp_comm == pytest.approx(passes * one)
        assert sp.tp_comm == pytest.approx(no_sp.tp_comm, rel=0.01)  # latency terms differ


def test_async_tp_hides_the_forward_passes_only():
    base = Workload(seq_len=8192, global_batch=8, compute_dtype="fp8", fused_kernels=True)
    plain = _layer(base)
    one = plain.tp_comm / 3  # forward, replayed forward, backward
    fused = _layer(dataclasses.replace(base, overlap_tp=True))
    hidden_fwd = max(0.0, one - plain.wgrad)  # what exceeds the forward's multiplies
    assert fused.tp_comm == pytest.approx(one + 2 * hidden_fwd)
    assert fused.tp_comm >= one  # the backward's collectives stay exposed
    none = _layer(dataclasses.replace(base, overlap_tp=True, overlap_tp_fraction=0.0))
    assert none.tp_comm == pytest.approx(plain.tp_comm)
    part = _layer(dataclasses.replace(base, overlap_tp=True, overlap_tp_fraction=0.4))
    assert fused.tp_comm < part.tp_comm < plain.tp_comm
    with pytest.raises(ValueError, match="overlap_tp_fraction=1.5"):
        Workload(seq_len=8, global_batch=1, overlap_tp_fraction=1.5)


def test_alternate_mm_replays_every_second_matmul_of_the_block():
    """torchtitan's op policy: wq, wk, wv, wo, w1, w3, w2 run; wk, wo and w3 are replayed."""
    t, d, kv, f = 8192, LLAMA8.dim, LLAMA8.kv_heads * LLAMA8.hd, LLAMA8.ffn_dim
    w = layer_work(LLAMA8, False, t, t, 1, 1, "flash", 2, fused=False)
    assert replayed_matmuls(LLAMA8, False, t, 1, w.gemms) == [2 * t * d * kv, 2 * t * d * d,
                                                              2 * t * d * f]
    ops = Workload(seq_len=t, global_batch=1)
    alt = dataclasses.replace(ops, selective_ac="alternate_mm")
    a = _layer(ops, LLAMA8, tp=1, sp=False, ac="selective", mb=1)
    b = _layer(alt, LLAMA8, tp=1, sp=False, ac="selective", mb=1)
    replay = sum(H100.matmul_time(x, "bf16") for x in replayed_matmuls(LLAMA8, False, t, 1,
                                                                     w.gemms))
    assert b.recompute == pytest.approx(a.recompute + replay)
    assert b.recompute_flops == pytest.approx(a.recompute_flops + 2 * t * d * (kv + d + f))
    assert b.recompute < _layer(ops, LLAMA8, tp=1, sp=False, ac="full", mb=1).recompute


def test_layer_policy_checkpoints_every_nth_block_fully():
    assert [layer_ac("selective", "layers:2", i) for i in range(4)] == [
        "none", "full", "none", "full"]
    assert layer_ac("full", "layers:2", 0) == "full"
    assert layer_ac("selective", "ops", 0) == "selective"
    wl = Workload(seq_len=8192, global_batch=8)
    costs = {}
    for ac, policy in (("none", "ops"), ("selective", "layers:2"), ("full", "ops")):
        cm = CostModel(LLAMA8, H100, dataclasses.replace(wl, selective_ac=policy))
        rt = cm.stages.rank(Layout(ac=ac), list(range(LLAMA8.n_layers)), True, True)
        costs[ac] = rt
    half = costs["selective"]
    assert half.recompute_flops == pytest.approx(costs["full"].recompute_flops / 2)
    assert costs["full"].saved < half.saved < costs["none"].saved
    for bad in ("layers:0", "layer:2", "every_other"):
        with pytest.raises(ValueError, match="selective_ac"):
            check_selective(bad)
    assert parse_workload("selective_ac=layers:3") == {"selective_ac": "layers:3"}


def _pp_fsdp(**stack) -> tuple[CostModel, Layout]:
    wl = Workload(seq_len=8192, global_batch=64, reshard_after_forward=False, **stack)
    L = Layout(dp_shard=8, tp=8, pp=8, zero=3, microbatch=1, pp_microbatches=8,
               pp_schedule="1f1b", ac="full", sp=True)
    return CostModel(get_model_spec("llama3-405b"), H100, wl), L


def test_gradient_sync_after_the_last_backward_is_exposed():
    """torch.distributed.pipelining with FSDP2 reduces each stage's gradients after its last
    backward (behind no compute) and keeps parameters gathered between micro-batches."""
    cm, L = _pp_fsdp()
    after, L2 = _pp_fsdp(dp_sync_after_backward=True)
    plan = cm.rank_plan(L, 0)
    gather, _, red, _ = dp_times(cm, L, *plan)
    overlapped = cm.estimate(L).breakdown["dp_comm"]
    exposed = after.estimate(L2).breakdown["dp_comm"]
    assert exposed >= red > overlapped
    # shardwise keeps a stage gathered through the step when it does not reshard after
    # forward (UNSHARD ... RESHARD, [Note: engine actions]): one gather a step, as above
    assert cm.dp_collective_seconds(L) == after.dp_collective_seconds(L2) == gather + red
    fp32, L3 = _pp_fsdp(dp_sync_after_backward=True, reduce_fp32=True)
    _, _, red32, _ = dp_times(fp32, L3, *plan)
    assert red32 == pytest.approx(2 * red, rel=0.01)  # fp32 instead of bf16 gradients
    assert fp32.estimate(L3).breakdown["dp_comm"] > exposed


def test_fused_norm_prices_only_the_norms_as_fused():
    eager = layer_work(LLAMA8, False, 8192, 8192, 1, 1, "flash", 2, fused=False)
    norm = layer_work(LLAMA8, False, 8192, 8192, 1, 1, "flash", 2, fused=False,
                      fused_norm=True)
    fused = layer_work(LLAMA8, False, 8192, 8192, 1, 1, "flash", 2, fused=True)
    assert fused.elementwise_rep == norm.elementwise_rep < eager.elementwise_rep
    assert norm.elementwise_tp == eager.elementwise_tp > fused.elementwise_tp  # RoPE, SwiGLU


def test_gradient_accumulation_outside_the_multiplies_lengthens_every_slot():
    """``grad_accum_bytes`` moves that many bytes per parameter of the rank in each
    micro-batch's backward, at the memory bandwidth ([Note: gradient accumulation])."""
    spec = get_model_spec("mt-nlg-530b")
    a100 = get_hardware("a100-80gb")
    L = Layout(dp_shard=8, tp=8, pp=35, zero=1, microbatch=1, pp_microbatches=240,
               pp_schedule="1f1b", ac="full", sp=False)
    base = Workload(seq_len=2048, global_batch=1920, compute_dtype="bf16", fused_kernels=True,
                    attention="unfused", overlap_dp=False, overlap_pp=False)
    acc = dataclasses.replace(base, grad_accum_bytes=6)
    cm0, cm6 = CostModel(spec, a100, base), CostModel(spec, a100, acc)
    layers, first, last = cm0.rank_plan(L, 0)
    r0 = StageCoster(spec, device_model(a100), base).rank(L, layers, first, last)
    r6 = StageCoster(spec, device_model(a100), acc).rank(L, layers, first, last)
    params = 3 * 12 * spec.dim ** 2 / 8  # three GPT blocks' weights over tp 8 ...
    params += spec.vocab_size * spec.dim / 8 + 2048 * spec.dim  # ... and the embeddings
    extra = a100.memory_time(6 * params)
    assert r6.bwd - r0.bwd == pytest.approx(extra, rel=0.01)
    assert r6.wgrad - r0.wgrad == pytest.approx(extra, rel=0.01)
    assert (r6.fwd, r6.tp_comm, r6.model_flops) == (r0.fwd, r0.tp_comm, r0.model_flops)
    # On the pipeline's critical path: every slot of the 240 + 34 grows.
    grown = cm6.estimate(L).step_time - cm0.estimate(L).step_time
    assert 240 * extra < grown < (240 + 34) * extra * 1.1
    assert parse_workload("grad_accum_bytes=18") == {"grad_accum_bytes": 18.0}
    for bad in (-1, True, "6"):
        with pytest.raises(ValueError, match="grad_accum_bytes="):
            Workload(seq_len=8, global_batch=1, grad_accum_bytes=bad)


def test_autograd_accumulation_is_shardwise_default_and_skips_the_first_micro_batch():
    """By default (``autograd_accum``, shardwise's engine) each micro-batch after the first
    adds its gradients into ``.grad`` in the compute dtype: 3 words a parameter, averaged
    over the step's micro-batches; a step of one micro-batch accumulates nothing, whatever
    the stack ([Note: gradient accumulation])."""
    spec, h100 = get_model_spec("llama3-8b"), get_hardware("h100")
    wl = Workload(seq_len=4096, global_batch=64)
    off = dataclasses.replace(wl, autograd_accum=False)
    own = dataclasses.replace(off, grad_accum_bytes=10)
    assert wl.autograd_accum and wl.grad_accum_bytes == 0
    layers = list(range(spec.n_layers))

    def extra(w, m: int, **kw) -> float:
        L = Layout(dp_shard=8, microbatch=1, pp_microbatches=m, **kw)
        got = StageCoster(spec, device_model(h100), w).rank(L, layers, True, True)
        bare = StageCoster(spec, device_model(h100), off).rank(L, layers, True, True)
        assert got.wgrad - bare.wgrad == pytest.approx(got.bwd - bare.bwd)
        return got.bwd - bare.bwd

    params = spec.num_params()  # one pipeline rank, no tensor parallelism: every parameter
    for m in (2, 8):
        assert extra(wl, m) == pytest.approx(h100.memory_time(6 * params * (m - 1) / m),
                                             rel=1e-6)
        assert extra(own, m) == pytest.approx(h100.memory_time(10 * params), rel=1e-6)
    fp32 = dataclasses.replace(wl, compute_dtype="fp32")
    fp32_off = dataclasses.replace(fp32, autograd_accum=False)
    L = Layout(dp_shard=8, microbatch=1, pp_microbatches=4)
    got = StageCoster(spec, device_model(h100), fp32).rank(L, layers, True, True).bwd
    bare = StageCoster(spec, device_model(h100), fp32_off).rank(L, layers, True, True).bwd
    assert got - bare == pytest.approx(h100.memory_time(12 * params * 3 / 4), rel=1e-6)
    assert extra(wl, 1) == extra(own, 1) == 0.0
    # The search's cached ranks know the count: more micro-batches, more accumulation.
    cm = CostModel(spec, h100, wl)
    few, many = (cm.estimate(Layout(dp_shard=8, microbatch=1, pp_microbatches=m))
                 for m in (1, 8))
    assert many.breakdown["compute"] > 8 * few.breakdown["compute"]
    assert parse_workload("autograd_accum=false") == {"autograd_accum": False}


def test_the_trainer_prices_its_own_accumulation():
    """``--parallel.plan auto`` prices the trainer's run with shardwise's own accumulation
    (autograd's add, in the run's compute dtype)."""
    from shardwise.models.registry import get_model_config
    from shardwise.train import plan_layout

    cfg = train_config(2, **{"model.name": "debug", "train.grad_accum": "4"})
    _, _, wl = plan_layout.planner_inputs(cfg, get_model_config("debug"), get_hardware("h100"))
    assert wl.autograd_accum and wl.grad_accum_bytes == 0


def test_engine_copies_around_gathers_and_reductions_on_gpus():
    """Stage 3 copies every gathered parameter out of the gather buffer (twice a micro-batch
    for the blocks, once for the root) and packs the gradients into the fp32 reduction
    buffer once a step, at the memory bandwidth; stacks without copies and stage 0 pay
    nothing ([Note: the engine's copies on GPUs])."""
    from shardwise.planner.devices.gpu import dp_copy_seconds

    spec, a100 = get_model_spec("llama3-8b"), get_hardware("a100-80gb")
    wl = Workload(seq_len=8192, global_batch=64, reduce_fp32=True)
    cm = CostModel(spec, a100, wl)
    layers = list(range(spec.n_layers))
    L = Layout(dp_shard=64, zero=3, microbatch=1, pp_microbatches=1)
    root = sum(math.prod(s) for s in spec.root_shapes())
    blocks = spec.num_params() - root
    want = a100.memory_time(2 * 2 * (root + 2 * blocks) + (2 + 4) * (root + blocks))
    assert dp_copy_seconds(cm, L, layers, True, True) == pytest.approx(want, rel=1e-3)
    two = dp_copy_seconds(cm, L.replace(pp_microbatches=2), layers, True, True)
    assert two - want == pytest.approx(a100.memory_time(4 * (root + 2 * blocks)), rel=1e-3)
    once = dp_copy_seconds(cm, L.replace(zero=2), layers, True, True)
    assert once == pytest.approx(a100.memory_time(4 * (root + blocks) + 6 * (root + blocks)),
                                 rel=1e-3)
    assert dp_copy_seconds(cm, L.replace(zero=0), layers, True, True) == 0.0
    assert dp_copy_seconds(cm, L.replace(dp_shard=1), layers, True, True) == 0.0
    # a pipeline stage kept gathered (no resharding after forward) gathers once a step,
    # whatever its micro-batches; without a pipeline every micro-batch gathers
    kept = CostModel(spec, a100, dataclasses.replace(wl, reshard_after_forward=False))
    pipe = L.replace(pp=2, pp_schedule="1f1b", dp_shard=32)
    assert dp_copy_seconds(kept, pipe.replace(pp_microbatches=4), layers, True, True) == \
        dp_copy_seconds(kept, pipe, layers, True, True)
    assert dp_copy_seconds(kept, L.replace(pp_microbatches=4), layers, True, True) > \
        dp_copy_seconds(kept, L, layers, True, True)
    flat = CostModel(spec, a100, dataclasses.replace(wl, dp_copies=False))
    assert dp_copy_seconds(flat, L, layers, True, True) == 0.0
    # ... and they land on the step's data-parallel time.
    assert cm.estimate(L).breakdown["dp_comm"] - flat.estimate(L).breakdown["dp_comm"] == \
        pytest.approx(want, rel=1e-3)


def test_tied_embedding_gradient_is_all_reduced_between_first_and_last_stage():
    """[Note: tied embeddings across stages]: a pair all-reduce of the embedding's gradient
    (vocabulary / tp rows, in the reduction dtype) over the pipeline's link, on pp_comm;
    nothing when untied, on one stage, or when a V placement gives rank 0 both ends."""
    bloom = get_model_spec("bloom-176b")
    a100 = get_hardware("a100-80gb")
    wl = Workload(seq_len=2048, global_batch=2048, reduce_fp32=True, fused_kernels=True,
                  attention="unfused", overlap_dp=False, overlap_pp=False)
    L = Layout(dp_shard=8, tp=4, pp=12, zero=1, microbatch=2, pp_microbatches=128,
               pp_schedule="1f1b", ac="full", sp=False)
    tied = CostModel(bloom, a100, wl)
    untied = CostModel(dataclasses.replace(bloom, tie_embeddings=False), a100, wl)
    pair = comm_model.place(2, 8 * 4 * 11, a100.gpus_per_node)
    assert (pair.size, pair.nodes) == (2, 2)  # the first and last stages sit on two nodes
    want = comm_model.all_reduce_time(250880 / 4 * bloom.dim * 4, pair, a100)
    assert tied._tied_embedding_time(L) == pytest.approx(want)
    assert untied._tied_embedding_time(L) == 0.0
    pp_tied, pp_untied = (cm.estimate(L).breakdown["pp_comm"] for cm in (tied, untied))
    assert pp_tied - pp_untied == pytest.approx(want)
    assert tied._tied_embedding_time(dataclasses.replace(L, pp=1, dp_shard=96)) == 0.0
    zbv = dataclasses.replace(L, pp_schedule="zbv", pp_virtual=2)
    assert tied._tied_embedding_time(zbv) == 0.0


def test_zero1_all_reduce_reduces_whole_gradients():
    """DeepSpeed's BF16_Optimizer all-reduces whole fp32 gradients at ZeRO-1
    (``zero1_all_reduce``): the reduction costs an all-reduce of the unit, not a
    reduce-scatter; gathers and other stages are unchanged."""
    bloom = get_model_spec("bloom-176b")
    a100 = get_hardware("a100-80gb")
    base = Workload(seq_len=2048, global_batch=2048, reduce_fp32=True, overlap_dp=False)
    L = Layout(dp_shard=8, tp=4, pp=12, zero=1, microbatch=2, pp_microbatches=128,
               pp_schedule="1f1b", ac="full", sp=False)
    rs, ar = CostModel(bloom, a100, base), \
        CostModel(bloom, a100, dataclasses.replace(base, zero1_all_reduce=True))
    plan = rs.rank_plan(L, 5)  # six blocks, no embedding
    g_rs, _, red_rs, _ = dp_times(rs, L, *plan)
    g_ar, _, red_ar, _ = dp_times(ar, L, *plan)
    grp = comm_model.place(8, 4, a100.gpus_per_node)
    block = sum(math.prod(s) for s in bloom.block_shapes(0, 4))
    assert red_ar == pytest.approx(6 * comm_model.all_reduce_time(block * 4, grp, a100))
    assert red_ar > 1.5 * red_rs and g_ar == g_rs
    L2 = dataclasses.replace(L, zero=2)
    assert dp_times(ar, L2, *plan) == dp_times(rs, L2, *plan)


def _torchtitan_split(n_layers: int, stages: int) -> list[int]:
    """Layers per stage of torchtitan's ``generate_split_points`` at 9dec370
    (torchtitan/parallelisms/pipelining_utils.py, re-stated): the first stage ``n // s``,
    the remainder one each on the middle stages, the last the rest."""
    base, extra = divmod(n_layers, stages)
    sizes = [base]
    for _ in range(stages - 2):
        sizes.append(base + (1 if extra > 0 else 0))
        extra -= 1 if extra > 0 else 0
    return sizes + [n_layers - sum(sizes)]


def test_stage_splits_are_the_published_runs():
    """``pp_split="ends"`` counts the embedding and the head as a layer each ([Note: stage
    splits]): torchtitan's generated splits of Llama 3.1 405B (126 layers) over 8 and 16
    stages, Llama 3's 16 x 8 chunks whose first holds only the embedding and last only the
    head (arXiv:2407.21783 Section 3.3.2), BLOOM's 5 / 6 / 5; "even" is unchanged."""
    from shardwise.planner.stage_cost import stage_bounds, stage_layers

    def sizes(n, s, split):
        return [len(b) for b in stage_bounds(n, s, split)]

    for stages in (8, 16):
        assert sizes(126, stages, "ends") == _torchtitan_split(126, stages)
    llama3 = sizes(126, 128, "ends")
    assert llama3[0] == llama3[-1] == 0 and set(llama3[1:-1]) == {1}
    assert sizes(70, 12, "ends") == [5] + [6] * 10 + [5]
    assert sizes(126, 16, "even") == [8] * 14 + [7, 7]
    assert sizes(126, 1, "ends") == [126]
    plan = stage_layers(126, 8, 2, "interleaved_1f1b", "ends")
    assert [len(p[0]) for p in plan] == [15] + [16] * 6 + [15] and plan[0][1] and plan[7][2]
    with pytest.raises(ValueError, match="pp_split='middle'"):
        stage_bounds(126, 8, "middle")
    with pytest.raises(ValueError, match="pp_split='middle'"):
        Workload(seq_len=8, global_batch=1, pp_split="middle")


def test_interleaved_ranks_weigh_their_stages():
    """An interleaved rank's saved activations at the peak are its stages' own bytes as the
    schedule keeps them ([Note: stages of unequal weight]): with the ends split, the
    torchtitan 405B interleaved run's heaviest rank is no longer the last one holding the
    head beside an average of its stages."""
    spec = get_model_spec("llama3-405b")
    hw = get_hardware("h100")
    wl = Workload(seq_len=8192, global_batch=256, pp_split="ends")
    L = Layout(dp_shard=8, tp=8, pp=8, zero=3, microbatch=4, pp_microbatches=8,
               pp_schedule="interleaved_1f1b", pp_virtual=2, ac="full", sp=True)
    cm = CostModel(spec, hw, wl)
    held = cm._stage_weighted(L)
    assert held is not None and len(held) == 8
    ranks = {r: rt for r, rt, _ in cm.all_ranks(L)}
    prof_avg = [ranks[r].saved * 1.0 for r in range(8)]
    assert held[0] > held[7] and all(h >= s for h, s in zip(held, prof_avg))
    assert cm._stage_weighted(L.replace(pp_schedule="1f1b", pp_virtual=1)) is None
