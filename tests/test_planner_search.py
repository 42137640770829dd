"""The layout search: its space, its pruning, its ranking and its speed."""

from __future__ import annotations

import time

import pytest

from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.parallel_layout import Layout, check_layout
from shardwise.planner.search import evaluate, in_search_space, search
from shardwise.planner.cost_model import BOTTLENECKS
from shardwise.planner.workload import Workload
from tests.planner_helpers import RECORD_KEYS


def test_ranked_layouts_fit_run_and_are_fastest_first():
    spec, hw = get_model_spec("llama3-8b"), get_hardware("h100")
    wl = Workload(seq_len=8192, global_batch=64)
    res = search(spec, hw, wl, 16, top=5)
    assert res.ranked and res.evaluated > 50 and res.pruned > 0
    fitting = [e for e in res.ranked if e.fits]
    times = [e.step_time for e in fitting[:5]]
    assert times == sorted(times)
    for e in res.ranked[:20]:
        check_layout(e.layout, spec, 16, 8192, 64)
        assert e.memory.total <= hw.hbm_bytes or not e.fits
        rec = e.record()
        assert set(rec) == RECORD_KEYS and set(rec["layout"]) == set(Layout().as_dict())
        assert rec["bottleneck"] in BOTTLENECKS
        assert 0 < rec["mfu"] <= rec["hfu"] < 1


def test_fixed_keys_restrict_the_search():
    spec, hw = get_model_spec("llama3-70b"), get_hardware("a100-80gb")
    wl = Workload(seq_len=4096, global_batch=256)
    fixed = {"tp": 8, "pp": 4, "ac": "full", "zero": 1}
    res = search(spec, hw, wl, 128, fixed)
    assert res.ranked
    for e in res.ranked:
        assert (e.layout.tp, e.layout.pp, e.layout.ac, e.layout.zero) == (8, 4, "full", 1)


def test_what_cannot_fit_is_pruned_or_offloaded():
    spec, hw = get_model_spec("gpt-1t"), get_hardware("h100")
    wl = Workload(seq_len=2048, global_batch=64)
    res = search(spec, hw, wl, 8)
    assert not any(e.fits for e in res.ranked)  # 1T parameters on 8 GPUs: nothing fits
    res = search(get_model_spec("llama3-8b"), hw, Workload(seq_len=4096, global_batch=8), 2)
    best = res.ranked[0]  # 8B with Adam needs 128 GB of model state: shard it, or offload
    assert best.fits and (best.layout.zero == 3 or best.layout.offload == "cpu")
    assert res.pruned > 0


def test_moe_layouts_use_expert_parallelism():
    spec, hw = get_model_spec("mixtral-8x7b"), get_hardware("h100")
    res = search(spec, hw, Workload(seq_len=4096, global_batch=256, fused_kernels=True), 64,
                 {"pp": 1})
    assert res.ranked[0].fits
    eps = {e.layout.ep for e in res.ranked}
    assert len(eps) > 1 and all(8 % ep == 0 for ep in eps)


@pytest.mark.parametrize("run", ["megatron21-1.7b", "korthikanti22-175b-full",
                                 "torchtitan-a100-70b-full"])
def test_published_layout_in_space_and_choice_at_least_as_fast(run):
    from shardwise.planner.validate.runs import hardware_of, load_runs, predict, workload_of
    r = next(x for x in load_runs() if x.id == run)
    est, _ = predict(r)
    spec, hw, wl = get_model_spec(r.model), hardware_of(r), workload_of(r)
    assert in_search_space(est.layout, spec, hw, wl, r.gpus)
    best = search(spec, hw, wl, r.gpus).ranked[0]
    assert best.fits and best.step_time <= est.step_time * (1 + 1e-9)


def test_outside_the_space():
    spec, hw, wl = get_model_spec("llama3-8b"), get_hardware("h100"), \
        Workload(seq_len=8192, global_batch=64)
    inside = Layout(dp_shard=2, tp=8, zero=3, microbatch=1, pp_microbatches=32)
    assert in_search_space(inside, spec, hw, wl, 16)
    assert not in_search_space(inside.replace(tp=16, dp_shard=1), spec, hw, wl, 16)
    assert not in_search_space(inside.replace(microbatch=32, pp_microbatches=1), spec, hw,
                               wl, 16)  # micro-batches above 16 sequences are not searched
    with pytest.raises(ValueError, match="expected the GPU count"):
        evaluate(spec, hw, wl, inside, 32)


def test_search_of_16384_gpus_under_a_minute():
    spec, hw = get_model_spec("llama3-405b"), get_hardware("h100")
    start = time.perf_counter()
    res = search(spec, hw, Workload(seq_len=8192, global_batch=2048), 16384)
    assert time.perf_counter() - start < 60
    assert res.ranked[0].fits and res.evaluated > 1000
