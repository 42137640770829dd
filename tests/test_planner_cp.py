"""The planner's context parallelism (issue 32): what it sends per layer is
``shardwise.parallel.context.bytes_per_layer`` for ring, Ulysses and hybrid; a ring step's
transfer hides behind its block and only the excess is exposed ([Note: context-parallel
exposure] in stage_cost.py), Ulysses' all-to-alls are exposed whole; layouts whose
all-to-all degree the key/value heads do not allow are refused, naming why, and never
searched; activations per rank scale as 1/cp and match what the trainer's ranks save; and
layouts written before ``cp_impl`` existed still parse."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.parallel.context import bytes_per_layer, ulysses_degree
from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.cost_model import CostModel
from shardwise.planner.devices.registry import device_model
from shardwise.planner.parallel_layout import (Layout, check_layout, cp_degrees, parse_layout)
from shardwise.planner.search import explain_empty, search
from shardwise.planner.sends import ContextSends, context_sends
from shardwise.planner.stage_cost import cp_exposed_seconds
from shardwise.planner.workload import Workload
from tests.planner_helpers import local_cpu


# ----------------------------------------------------------------- bytes
@pytest.mark.parametrize("model, tp", [("debug", 1), ("llama3-8b", 1), ("llama3-8b", 2),
                                       ("llama3-70b", 4)])
@pytest.mark.parametrize("impl", ["ring", "ulysses", "hybrid"])
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("elem", [2, 4])
def test_cp_bytes_are_the_closed_form(model, tp, impl, cp, elem):
    """The planner's bytes per layer and pass are ``bytes_per_layer``'s (the formula the
    runtime's tests count) at ``apply_cp``'s degree, and its messages add up to them."""
    spec = get_model_spec(model)
    kv = max(1, spec.kv_heads // tp)
    try:
        u = ulysses_degree(impl, cp, kv)
    except ValueError:
        with pytest.raises(ValueError, match="key/value heads"):
            context_sends(spec, impl, cp, tp, 2, 1024, elem)
        return
    s = context_sends(spec, impl, cp, tp, 2, 1024, elem)
    want = bytes_per_layer(impl, batch=2, seq_len=1024, cp=cp, heads=spec.n_heads // tp,
                           kv_heads=kv, head_dim=spec.hd, elem=elem, ulysses=u)
    assert (s.forward, s.backward) == (want["forward"], want["backward"])
    assert (s.ring, s.ulysses) == (cp // u, u) == cp_degrees(impl, cp, tp, spec)
    assert s.sent("forward") == pytest.approx(want["forward"], rel=1e-12)
    assert s.sent("backward") == pytest.approx(want["backward"], rel=1e-12)
    assert len(s.a2a) == (4 if u > 1 else 0) and len(s.steps) == cp // u
    assert sum(s.steps) == pytest.approx(1.0)


def test_ring_blocks_are_the_zigzag_chunks():
    """On the busiest rank a zigzag ring step is two kernel calls (three on its own block:
    the diagonal chunks are calls of their own) and an equal share of the causal entries;
    Ulysses calls each query chunk against each run of key chunks it sees whole; the
    entries are ``attention_entries``'."""
    from shardwise.parallel.context import attention_entries

    spec = get_model_spec("debug")
    ring = context_sends(spec, "ring", 4, 1, 1, 512, 4)
    assert ring.blocks == 3 + 2 * 3
    assert ring.scores == attention_entries(512, 0, 4, "zigzag")
    c = 512 // 8
    assert ring.steps[0] == pytest.approx((2 * c * c + c) / ring.scores)
    assert ring.steps[1:] == pytest.approx([2 * c * c / ring.scores] * 3)
    uly = context_sends(spec, "ulysses", 4, 1, 1, 512, 4)
    # chunks 0, 7, 1, 6, 2, 5, 3, 4 in the group's order: 27 runs
    assert uly.blocks == 27 and uly.steps == (1.0,) and uly.scores == ring.scores


# ----------------------------------------------------------------- exposure
class _Links:
    """A device whose messages cost what the test says."""

    def __init__(self, p2p: float, a2a: float = 0.0) -> None:
        self.t_p2p, self.t_a2a = p2p, a2a

    def p2p(self, nbytes, across_nodes):
        return self.t_p2p if nbytes > 0 else 0.0

    def all_to_all(self, nbytes, g):
        return self.t_a2a if g.size > 1 else 0.0


def _ring(n: int) -> ContextSends:
    return ContextSends("ring", n, n, 1, 0, 0, kv=1.0, dkv=2.0, steps=(1 / n,) * n)


def test_exposed_ring_time_is_zero_when_compute_dominates():
    """Each ring step's transfer hides behind its block: with blocks longer than any
    transfer the forward exposes nothing, the backward only its last ``dK``, ``dV``
    (which arrive after the last block, as ``ring_backward`` waits for them)."""
    dev = _Links(p2p=1e-3)
    fwd_only = cp_exposed_seconds(dev, _ring(4), (1.0, 2.5), 1, 8, replays=1) - \
        cp_exposed_seconds(dev, _ring(4), (1.0, 2.5), 1, 8, replays=0)
    assert fwd_only == 0.0
    assert cp_exposed_seconds(dev, _ring(4), (1.0, 2.5), 1, 8) == pytest.approx(1e-3)


def test_exposed_ring_time_is_the_transfers_when_they_dominate():
    """With no compute to hide behind, every transfer is exposed: forward ``n - 1`` blocks,
    backward the same blocks again and ``n`` gradient blocks; in between, per step only
    what exceeds the block."""
    t, n = 1e-3, 4
    dev = _Links(p2p=t)
    assert cp_exposed_seconds(dev, _ring(n), (0.0, 0.0), 1, 8, replays=1) == pytest.approx(
        (n - 1) * t + (n - 1) * t + n * t)
    # a block of half a transfer: half of each forward transfer shows
    block = 0.5 * t
    fwd = cp_exposed_seconds(dev, _ring(n), (n * block, 0.0), 1, 8, replays=1) - \
        cp_exposed_seconds(dev, _ring(n), (n * block, 0.0), 1, 8, replays=0)
    assert fwd == pytest.approx((n - 1) * 0.5 * t)


def test_ulysses_all_to_alls_are_not_overlapped():
    """Four all-to-alls forward and four backward, exposed whatever the compute, and once
    more for the forward a full recomputation replays."""
    s = ContextSends("ulysses", 4, 1, 4, 0, 0, a2a=(1.0, 1.0, 1.0, 1.0))
    dev = _Links(p2p=0.0, a2a=1e-3)
    assert cp_exposed_seconds(dev, s, (10.0, 25.0), 1, 8) == pytest.approx(8e-3)
    assert cp_exposed_seconds(dev, s, (10.0, 25.0), 1, 8, replays=2) == pytest.approx(12e-3)


def test_the_cost_model_exposes_the_ring_only_when_transfer_bound():
    """On an H100, a long sequence's ring hides its key/value blocks behind attention (the
    exposed time is the backward's last gradient block per layer), a short one at wide cp
    does not; Ulysses exposes its all-to-alls either way."""
    spec, hw = get_model_spec("llama3-8b"), get_hardware("h100")

    def cp_comm(seq: int, cp: int, impl: str, tp: int = 1, on=hw) -> tuple[float, float]:
        wl = Workload(seq_len=seq, global_batch=1, fused_kernels=True)
        layer = CostModel(spec, on, wl).stages.layer(False, tp, cp, False, 1, 1, "none", impl)
        return layer.cp_comm, layer.fwd

    long_ring, fwd = cp_comm(131072, 8, "ring")
    s = context_sends(spec, "ring", 8, 1, 1, 131072, 2)
    tail = device_model(hw).p2p(s.dkv, False)
    assert long_ring == pytest.approx(tail) and long_ring < 1e-2 * fwd
    # 512 tokens a rank, its ring across 8 nodes (tp 8 inside them) on a slow network
    slow = hw.replace(inter_efficiency=hw.inter_efficiency / 50)
    s = context_sends(spec, "ring", 8, 8, 1, 4096, 2)
    kv, dkv = (device_model(slow).p2p(x, True) for x in (s.kv, s.dkv))
    every = 2 * 7 * kv + 8 * dkv  # forward and backward transfers
    short_ring, _ = cp_comm(4096, 8, "ring", tp=8, on=slow)
    assert 0.8 * every < short_ring < every
    assert cp_comm(4096, 8, "ring", tp=8)[0] == pytest.approx(device_model(hw).p2p(s.dkv, True))
    uly, _ = cp_comm(131072, 8, "ulysses")
    a2a = context_sends(spec, "ulysses", 8, 1, 1, 131072, 2).a2a
    from shardwise.planner import comm_model
    g = comm_model.place(8, 1, hw.gpus_per_node)
    assert uly == pytest.approx(2 * sum(device_model(hw).all_to_all(x, g) for x in a2a))


def test_cpu_ranks_price_the_messages_from_their_calibration():
    """A CPU rank's ring step is the calibrated send/receive pair, an all-to-all the
    calibrated Gloo reduce-scatter of a ``1 / n`` shard (the engine's reduce-scatter is that
    all-to-all plus a local sum), and the attention the calibrated block calls."""
    from shardwise.planner import comm_model

    hw = local_cpu(cores=8)
    dev = device_model(hw)
    g = comm_model.place(2, 1, 8)
    assert dev.p2p(1e6, False) == pytest.approx(1e-3 + 1e-9 * 1e6)  # planner_helpers' fits
    assert dev.all_to_all(4e6, g) == pytest.approx(1e-3 + 1e-9 * 2e6)
    from shardwise.planner.work import layer_work

    spec = get_model_spec("debug")
    wl = Workload(seq_len=512, global_batch=4, compute_dtype="fp32")
    s = context_sends(spec, "ring", 2, 1, 4, 512, 4)
    w = layer_work(spec, False, 4 * 256, 512, act_bytes=4, fused=False, cp_scores=4 * s.scores,
                   cp_calls=s.blocks, cp_area=4 * s.area, cp_queries=4 * s.queries)
    # [Note: context-parallel kernels]: per call, on the rectangles and query chunks (5
    # calls of 128 x 128)
    assert s.blocks == 5 and s.area == 128 * 128 * 5 and s.queries == 128 * 5
    ker = hw.cpu.kernel_compose
    fwd, bwd = dev.attention_seconds(spec, wl, w, 1)
    area, queries = (4 * 8 * x * 32 for x in (s.area, s.queries))  # x sequences, heads, hd
    assert fwd == pytest.approx(ker * (2 * 5 * 1e-4 + 1e-9 * (area + queries)))
    assert bwd == pytest.approx(ker * (2 * 5 * 2e-4 + 2e-9 * (area + queries)))
    # a calibration from before cp_attention: the one-rank fits, per call
    old = local_cpu(cores=8)
    old = old.replace(cpu=dataclasses.replace(old.cpu, kernels={
        k: v for k, v in old.cpu.kernels.items() if k != "cp_attention"}))
    f_old, _ = device_model(old).attention_seconds(spec, wl, w, 1)
    assert f_old == pytest.approx(ker * (2 * 5 * 1e-4 + 1e-9 * (w.attn_exec_flops
                                                                 + w.attn_scores)))


# ----------------------------------------------------------------- refusals
def test_ulysses_above_the_kv_heads_is_refused_with_the_reason():
    spec = get_model_spec("llama3-8b")  # 8 key/value heads
    wl = Workload(seq_len=8192, global_batch=1)
    check_layout(Layout(cp=8, cp_impl="ulysses"), spec, 8, 8192, 1)
    with pytest.raises(ValueError, match=r"cp_impl='ulysses' at cp=16 needs the key/value "
                                         r"heads \(8 per tensor rank\) to divide by 16"):
        check_layout(Layout(cp=16, cp_impl="ulysses"), spec, 16, 8192, 1)
    with pytest.raises(ValueError, match=r"\(4 per tensor rank\) to divide by 8"):
        check_layout(Layout(cp=8, tp=2, cp_impl="ulysses"), spec, 16, 8192, 1)
    with pytest.raises(ValueError, match="cp_impl='hybrid' at cp=2 needs a degree"):
        check_layout(Layout(cp=2, cp_impl="hybrid"), spec, 2, 8192, 1)
    mla = get_model_spec("deepseek-v3")
    with pytest.raises(ValueError, match="multi-head latent attention of deepseek-v3"):
        cp_degrees("ring", 2, 1, mla)
    fixed = {"cp": 16, "cp_impl": "ulysses", "tp": 1}
    assert not search(spec, get_hardware("h100"), wl, 16, fixed, top=1).ranked
    assert "to divide by 16" in explain_empty(spec, get_hardware("h100"), wl, 16, fixed)


def test_the_search_never_prices_an_impl_the_heads_do_not_allow():
    spec, hw = get_model_spec("llama3-8b"), get_hardware("h100")
    wl = Workload(seq_len=65536, global_batch=4, fused_kernels=True)
    res = search(spec, hw, wl, 64, {"pp": 1}, top=40, exact=False)
    impls = {(e.layout.cp_impl, e.layout.cp, e.layout.tp) for e in res.ranked
             if e.layout.cp > 1}
    assert {i for i, _, _ in impls} >= {"ring"}
    for impl, cp, tp in impls:
        assert impl != "allgather"
        cp_degrees(impl, cp, tp, spec)  # every one fits the heads
    mla = search(get_model_spec("deepseek-v3"), get_hardware("h800"),
                 Workload(seq_len=16384, global_batch=4, fused_kernels=True), 64,
                 {"cp": 4, "pp": 16, "ep": 4, "tp": 1}, top=1, exact=False).ranked
    assert mla and all(e.layout.cp_impl == "allgather" for e in mla)


# ----------------------------------------------------------------- memory
@pytest.mark.parametrize("impl", ["ring", "ulysses", "allgather"])
def test_activation_memory_per_rank_scales_as_one_over_cp(impl):
    spec, hw = get_model_spec("llama3-8b"), get_hardware("h100")
    wl = Workload(seq_len=32768, global_batch=1, fused_kernels=True)

    def acts(cp: int, cp_impl: str) -> float:
        L = Layout(cp=cp, microbatch=1, zero=3, cp_impl=cp_impl)
        return CostModel(spec, hw, wl).estimate(L).memory.activations

    assert acts(2, impl) == pytest.approx(2 * acts(4, impl), rel=1e-12)
    assert acts(4, impl) == pytest.approx(2 * acts(8, impl), rel=1e-12)
    if impl == "allgather":  # the one-rank kernel on gathered keys: exactly 1/cp
        assert acts(1, impl) == pytest.approx(8 * acts(8, impl), rel=1e-12)


def _saved_with_cp(impl: str, seq: int, batch: int) -> float:
    from bench.planner_measure import SavedPeak, parameter_storages
    from shardwise.distributed.parallel_dims import ParallelDims
    from shardwise.models import build_model, get_model_config
    from shardwise.parallel.context import apply_cp, cp_context

    torch.manual_seed(0)
    cfg = get_model_config("debug", n_layers=2, max_seq_len=seq)
    model = build_model(cfg, seed=0)
    mesh = ParallelDims(1, 1, 2, cp=2).resolved().build_mesh()
    apply_cp(model, mesh["cp"], impl=impl)
    tokens = cp_context(model).shard(torch.randint(0, cfg.vocab_size, (batch, seq + 1))[:, :-1])
    saved = SavedPeak(parameter_storages(model))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return saved.peak


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_saved_activations_with_cp_equal_saved_tensors_hooks(impl):
    """[Note: context-parallel activations]: on 2 Gloo ranks the operator saves the keys
    and values unexpanded and its output beside wo's input; the planner's list at cp 2
    matches what autograd saves on each rank."""
    from shardwise.planner.catalogue import from_llama_config
    from shardwise.models import get_model_config
    from shardwise.testing.dist import run_ranks

    seq, b = 128, 2
    peaks = run_ranks(_saved_with_cp, 2, args=(impl, seq, b), threads=1, timeout_s=120)
    spec = from_llama_config(get_model_config("debug", n_layers=2, max_seq_len=seq), "debug")
    wl = Workload(seq_len=seq, global_batch=b, compute_dtype="fp32")
    cm = CostModel(spec, local_cpu(2), wl)
    predicted = cm.estimate(Layout(cp=2, microbatch=b, cp_impl=impl)).memory.activations
    assert max(peaks) == pytest.approx(predicted, rel=0.01)


# ----------------------------------------------------------------- the record
def test_layout_strings_and_records_from_before_cp_impl_still_parse():
    old = "dp_replicate=1,dp_shard=2,cp=2,tp=1,pp=1,ep=1,zero=3,microbatch=4," \
          "pp_microbatches=1,pp_schedule=none,pp_virtual=1,ac=none,sp=false,offload=none," \
          "comm_weights=fp,comm_grads=fp"
    L = Layout(**parse_layout(old))
    assert L.cp_impl == "ring" and L.key() == old + ",cp_impl=ring"
    assert Layout(**parse_layout(L.key())) == L
    record = json.loads(json.dumps(L.as_dict()))
    del record["cp_impl"]  # a record written before the key existed
    assert Layout(**record) == L
    assert Layout(**parse_layout("cp=2,cp_impl=allgather")).cp_impl == "allgather"
    with pytest.raises(ValueError, match="cp_impl='rings' .*ring, ulysses, hybrid, allgather"):
        parse_layout("cp_impl=rings")


def test_llama3_128k_keeps_its_all_gather():
    """The published 128K run used all-gather context parallelism: its record says so, and
    is priced as it was before the ring existed."""
    from shardwise.planner.validate.runs import load_runs

    run = next(r for r in load_runs() if r.id == "llama3-405b-128k-16384gpu")
    assert parse_layout(run.layout)["cp_impl"] == "allgather"
    assert all(parse_layout(r.layout).get("cp", 1) == 1 for r in load_runs()
               if r.id != run.id)
    assert math.isfinite(run.value)


@pytest.mark.parametrize("impl, calls", [("ring", 1 + 3), ("ulysses", 4 + 4)])
def test_cpu_ranks_charge_the_collective_overhead_on_every_cp_call(impl, calls):
    """[Note: collectives between operators]: each all-to-all and each ring exchange (at cp
    2: one key/value block forward; the block again and two gradient blocks backward) pays
    the calibrated overhead, as tensor-parallel collectives do."""
    from shardwise.planner.sends import cp_calls_per_layer

    spec = get_model_spec("debug")
    assert cp_calls_per_layer(context_sends(spec, impl, 2, 1, 4, 512, 4), False) == calls
    assert cp_calls_per_layer(context_sends(spec, impl, 2, 1, 4, 512, 4), True) == \
        calls + (1 if impl == "ring" else 4)
    hw = local_cpu(cores=8)
    wl = Workload(seq_len=512, global_batch=4, compute_dtype="fp32")
    L = Layout(cp=2, microbatch=4, zero=2, cp_impl=impl)
    plain = CostModel(spec, hw, wl).estimate(L).breakdown["cp_comm"]
    over = hw.replace(cpu=dataclasses.replace(hw.cpu, collective_overhead=1e-3))
    charged = CostModel(spec, over, wl).estimate(L).breakdown["cp_comm"]
    assert charged - plain == pytest.approx(1e-3 * calls * spec.n_layers)


@pytest.mark.parametrize("impl, buildable", [("ring", True), ("ulysses", True),
                                             ("allgather", False)])
def test_the_trainer_builds_the_impls_the_planner_says(impl, buildable, tmp_path):
    """[Note: buildable layouts]: ring and Ulysses at cp 2 are built (the config carries
    ``cp_impl`` both ways), Llama 3's all-gather is priced only; a plan auto run keeps the
    configured implementation fixed."""
    from shardwise.models import get_model_config
    from shardwise.planner.buildable import not_buildable
    from shardwise.planner.catalogue import from_llama_config
    from shardwise.train import plan_layout
    from shardwise.train.config import load_config, resolve_world

    L = Layout(cp=2, microbatch=2, zero=2, cp_impl=impl)
    cfg = resolve_world(load_config(None, {"model.name": "debug", "log.dir": str(tmp_path)}), 2)
    new = plan_layout.with_layout(cfg, L)
    if buildable:
        assert plan_layout.layout_of(new) == L
        assert plan_layout.trainer_keys(L)["parallel.cp_impl"] == impl
    model_cfg = get_model_config("debug")
    assert plan_layout._buildable(new, model_cfg, 2) is buildable
    assert (not_buildable(L, from_llama_config(model_cfg, "debug")) is None) is buildable
    uly = load_config(None, {"model.name": "debug", "parallel.cp_impl": "ulysses",
                             "log.dir": str(tmp_path)})
    assert plan_layout.plan_constraints(resolve_world(uly, 2))["cp_impl"] == "ulysses"


def test_cpu_ranks_on_saturated_cores_expose_every_ring_transfer():
    """[Note: context-parallel exposure]: with as many ranks as cores Gloo's threads need the
    cores the blocks run on, so a ring exposes every transfer; with cores to spare it hides
    them behind the blocks (``DeviceModel.overlaps``, as for every other collective)."""
    spec = get_model_spec("debug")
    wl = Workload(seq_len=2048, global_batch=1, compute_dtype="fp32")
    L = Layout(cp=2, microbatch=1, zero=2)
    s = context_sends(spec, "ring", 2, 1, 1, 2048, 4)
    t = 1e-3 + 1e-9 * s.kv  # planner_helpers' send/receive fit (kv and dkv: same size)
    per_layer = {}
    for cores in (2, 8):
        hw = local_cpu(cores=cores)
        hw = hw.replace(cpu=dataclasses.replace(hw.cpu, collective_overhead=0.0))
        per_layer[cores] = CostModel(spec, hw, wl).estimate(L).breakdown["cp_comm"] / 4
    assert s.kv == s.dkv
    assert per_layer[2] == pytest.approx(t + (t + 2 * t))  # forward 1, backward 3
    assert per_layer[8] == pytest.approx(t)  # the last gradient block
