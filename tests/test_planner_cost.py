"""The cost model's parts against their definitions: FLOPs, Korthikanti activations,
the pipeline profile, collective pricing, catalogues, layouts."""

from __future__ import annotations

import dataclasses

import math
from pathlib import Path

import pytest

from shardwise.distributed.comm import byte_counts as comm_bytes
from shardwise.models import get_model_config, list_model_configs
from shardwise.parallel import Costs, build_schedule, simulate
from shardwise.parallel.pipeline.schedules import schedule_spec
from shardwise.planner import comm_model, get_hardware, get_model_spec, planner_only_models
from shardwise.planner.catalogue import load_model_config
from shardwise.planner.cost_model import CostModel
from shardwise.planner.hardware import list_hardware, load_catalogue
from shardwise.planner.parallel_layout import Layout, check_layout, parse_layout
from shardwise.planner.pipeline import schedule_profile
from shardwise.planner.work import layer_work, saved_bytes
from shardwise.planner.workload import Workload


@pytest.mark.parametrize("name,seq", [("debug", 256), ("llama3-8b", 8192), ("llama3-70b", 4096)])
def test_model_flops_equal_llama_config(name, seq):
    """MFU's FLOPs are the trainer's own accounting (PaLM / Chinchilla, as flop_counter)."""
    wl = Workload(seq_len=seq, global_batch=3)
    cm = CostModel(get_model_spec(name), get_hardware("h100"), wl)
    assert cm._model_flops() == 3 * seq * get_model_config(name).flops_per_token(seq)


def test_activations_reproduce_korthikanti_et_al():
    """GPT block, fp16, unfused attention with dropout: Section 4 of Korthikanti et al."""
    spec = get_model_spec("megatron-22b")
    s, b, h, a, t = 2048, 4, spec.dim, spec.n_heads, 8
    sbh = s * b * h

    def saved(tp, sp, ac):
        w = layer_work(spec, False, b * s, s, tp, 1, "unfused", 2, fused=True)
        return saved_bytes(w, tp, sp, ac)

    assert saved(1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert saved(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert saved(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert saved(t, True, "selective") == pytest.approx(sbh / t * 34)
    assert saved(t, True, "full") == pytest.approx(2 * sbh / t)


def test_selective_with_flash_drops_the_cheap_tensors():
    spec = get_model_spec("llama3-8b")
    for fused in (True, False):
        w = layer_work(spec, False, 8192, 8192, 1, 1, "flash", 2, fused)
        none, sel, full = (saved_bytes(w, 1, False, ac) for ac in ("none", "selective", "full"))
        assert full < sel < none
    eager = layer_work(spec, False, 8192, 8192, 1, 1, "flash", 2, fused=False)
    fused = layer_work(spec, False, 8192, 8192, 1, 1, "flash", 2, fused=True)
    assert eager.elementwise_rep > 4 * fused.elementwise_rep  # eager RMSNorm: 36 vs 4 bytes


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
             ("zb1", 1), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_profile_reads_the_registry_and_the_simulator(name, v, pp):
    """The closed-form profile is the registry's closed forms (checked against the simulator
    in tests/test_pp_simulate.py); the exact one simulates 2p + (m mod p) micro-batches for
    m >= 3p, which has the bubble of all m."""
    f, b, w = 1.0, 2.4, 1.1
    spec = schedule_spec(name)
    closed = schedule_profile(name, pp, v, 2 * pp, f, b, w)
    assert (closed.bubble_time, closed.peak_inflight) == (
        spec.bubble_time(pp, v, 2 * pp, f, b, w), spec.peak_inflight(pp, v, 2 * pp))
    big = 3 * pp + 1
    full = simulate(build_schedule(name, pp, big, v),
                    Costs(f=f / v, b=b / v, i=(b - w) / v, w=w / v))
    exact = schedule_profile(name, pp, v, big, f, b, w, exact=True)
    assert exact.source == "simulator"
    assert exact.bubble_time == pytest.approx(float(full.step_time - max(full.busy)))


def test_collectives_are_priced_from_comm_bytes():
    hw = get_hardware("a100-80gb")
    assert comm_model.place(8, 1, 8) == comm_model.Group(8, 8)      # tp inside a node
    assert comm_model.place(16, 8, 8) == comm_model.Group(16, 1)    # one member per node
    assert comm_model.place(32, 2, 8) == comm_model.Group(32, 4)
    shard = 1 << 20
    inside = comm_model.all_gather_time(shard, comm_model.Group(8, 8), hw)
    sent = comm_bytes.all_gather_bytes(8, shard)[0]
    assert inside == pytest.approx(7 * hw.intra.latency + sent / hw.intra.bandwidth)
    spread = comm_model.all_gather_time(shard, comm_model.Group(8, 1), hw)
    assert spread == pytest.approx(7 * hw.inter.latency + sent / hw.inter.bandwidth)
    hier = comm_model.all_gather_time(shard, comm_model.Group(32, 8), hw)
    assert hier == pytest.approx(3 * hw.inter.latency + 3 * shard / hw.inter.bandwidth
                                 + 7 * hw.intra.latency + 7 * 4 * shard / hw.intra.bandwidth)
    assert comm_model.all_reduce_time(0, comm_model.Group(8, 8), hw) == 0.0


def test_hardware_catalogue(tmp_path: Path):
    names = list_hardware()
    for want in ("a100-40gb", "a100-80gb", "h100-sxm", "h800", "h200", "b200", "mi300x"):
        assert want in names
    assert get_hardware("h100").peak("bf16") == pytest.approx(989.4e12)
    assert get_hardware("h100").peak("fp8") == pytest.approx(1978.9e12)
    assert get_hardware("h800").intra_peak.bandwidth < get_hardware("h100").intra_peak.bandwidth
    assert get_hardware("a100").hbm_bytes == 80 * 2 ** 30
    for hw in load_catalogue(calibration="/nonexistent").values():
        assert 0 < hw.matmul_efficiency(1e12) < 1
    mine = tmp_path / "mine.toml"
    mine.write_text('[my-h100]\nbase = "h100-sxm"\nhbm_gib = 96.0\n')
    assert get_hardware("my-h100", catalogue=mine).hbm_bytes == 96 * 2 ** 30
    mine.write_text('[bad]\nbase = "h100-sxm"\nhbm_gb = 96.0\n')
    with pytest.raises(ValueError, match="hbm_gb.*did you mean 'hbm_gib'"):
        get_hardware("bad", catalogue=mine)
    with pytest.raises(ValueError, match="calibrate"):
        get_hardware("local", calibration=tmp_path / "none.toml")
    with pytest.raises(ValueError, match="did you mean 'h100'"):
        get_hardware("h10")


def test_model_catalogue(tmp_path: Path):
    only = planner_only_models()
    for name in ("gpt3-175b", "mt-nlg-530b", "gpt-1t", "bloom-176b"):
        assert name in only
    for name in ("mixtral-8x7b", "deepseek-v3"):  # planner-only until the registry has them
        assert (name in only) == (name not in list_model_configs())
    assert not {"llama3-8b", "llama3-70b", "llama3-405b"} & set(only)
    ds = get_model_spec("deepseek-v3")
    assert round(ds.num_params() / 1e9) == 671 and round(ds.active_params() / 1e9) == 38
    assert round(get_model_spec("gpt-1t").num_params() / 1e9) == 1008
    bloom = get_model_spec("bloom-176b")  # ALiBi: no position parameters, no rotary work
    assert round(bloom.num_params() / 1e9) == 176 and bloom.root_shapes(1, True, False) == \
        [(250880, 14336)]
    with pytest.raises(ValueError, match="position='alibi2', expected one of rope, learned, "
                                         "alibi"):
        dataclasses.replace(bloom, position="alibi2")
    assert round(get_model_spec("mixtral-8x7b").active_params() / 1e9, 1) == 12.9
    cfg = tmp_path / "m.toml"
    cfg.write_text('base = "llama3-8b"\nn_layers = 16\n')
    spec = load_model_config(cfg)
    assert spec.n_layers == 16 and spec.dim == 4096 and spec.name == "m"
    cfg.write_text('base = "llama3-8b"\nlayers = 16\n')
    with pytest.raises(ValueError, match="unknown model field 'layers'"):
        load_model_config(cfg)


def test_layout_parsing_and_checks():
    fixed = parse_layout("tp=8,pp=16,dp_shard=128,pp_schedule=1f1b,microbatch=1,ac=full")
    assert fixed == {"tp": 8, "pp": 16, "dp_shard": 128, "pp_schedule": "1f1b",
                     "microbatch": 1, "ac": "full"}
    with pytest.raises(ValueError, match="did you mean 'tp'"):
        parse_layout("tpp=8")
    with pytest.raises(ValueError, match="ac='fulll'.*did you mean 'full'"):
        parse_layout("ac=fulll")
    spec = get_model_spec("mixtral-8x7b")
    good = Layout(dp_shard=8, tp=2, ep=8, zero=3, microbatch=1, pp_microbatches=4)
    check_layout(good, spec, 16, 4096, 32)
    with pytest.raises(ValueError, match="expected the GPU count 32"):
        check_layout(good, spec, 32, 4096, 32)
    with pytest.raises(ValueError, match="ep=3 must divide"):
        check_layout(good.replace(ep=3), spec, 16, 4096, 32)
    with pytest.raises(ValueError, match="expected the global batch 64"):
        check_layout(good, spec, 16, 4096, 64)
    with pytest.raises(ValueError, match="needs pp_microbatches >= 4"):
        check_layout(good.replace(dp_shard=4, pp=2, ep=4, pp_schedule="dualpipev",
                                  pp_virtual=2, pp_microbatches=3), spec, 16, 4096, 12)


def test_memory_grows_with_what_it_should():
    cm = CostModel(get_model_spec("llama3-8b"), get_hardware("h100"),
                   Workload(seq_len=4096, global_batch=64))
    base = Layout(dp_shard=8, zero=1, microbatch=1, pp_microbatches=8)
    mems = {z: cm.estimate(base.replace(zero=z)).memory for z in (0, 1, 2, 3)}
    assert mems[0].optimizer > mems[1].optimizer == mems[2].optimizer == mems[3].optimizer
    assert mems[1].full_grads > 0 and mems[2].grads < mems[0].grads
    assert mems[3].unsharded < mems[2].unsharded
    acts = [cm.estimate(base.replace(ac=ac)).memory.activations
            for ac in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]
    slow = cm.estimate(base.replace(ac="full"))
    assert slow.hfu > slow.mfu and slow.step_time > cm.estimate(base).step_time
    assert math.isclose(cm.estimate(base).mfu, cm.estimate(base).hfu)
