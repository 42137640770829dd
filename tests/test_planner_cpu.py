"""The CPU-rank mechanisms of the cost model: the calibration's kernel and collective fits,
ranks time-sharing the cores, collectives exposed on saturated cores, and the saved
activations the planner lists for the trainer's Llama against ``saved_tensors_hooks``.

A synthetic ``local`` device (every fit known) keeps the timing tests free of timing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from shardwise.compat import tomllib
from shardwise.models import build_model, get_model_config
from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.calibrate import LocalMeasurements, write_calibration
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.cost_model import CostModel
from shardwise.planner.cpu_bench import fit_collectives, fit_terms
from shardwise.planner.cpu_costs import KERNELS, CpuCosts, Crowd, Fit, Kernel
from shardwise.planner.cpu_stage import layer_kernels
from shardwise.planner.layout import Layout
from shardwise.planner.workload import Workload


def _costs(per_call: float = 1e-4) -> CpuCosts:
    kernels = {k: Kernel(Fit(per_call, 1e-9), Fit(2 * per_call, 2e-9)) for k in KERNELS}
    colls = {k: {2: Fit(1e-3, 1e-9), 4: Fit(2e-3, 2e-9)}
             for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")}
    return CpuCosts(kernels, Fit(1e-5, 5e-9), colls)


def _local(cores: int = 2):
    base = get_hardware("a100-80gb")
    return base.replace(name="local", cores=cores, backend="gloo", cpu=_costs(),
                        peak_flops={"fp32": 1e11, "bf16": 1e11}, gpus_per_node=8,
                        memory_efficiency=1.0)


def _estimate(hw, **layout):
    wl = Workload(seq_len=128, global_batch=4 * layout.get("dp_shard", 1)
                  * layout.get("pp_microbatches", 1), compute_dtype="fp32")
    return CostModel(get_model_spec("debug"), hw, wl).estimate(Layout(microbatch=4, **layout),
                                                               exact=True)


def test_fit_terms_recovers_latency_and_slope():
    rows = [((1.0, n), 3e-5 + 2e-9 * n) for n in (1e3, 1e5, 1e7)]
    assert fit_terms(rows) == pytest.approx([3e-5, 2e-9], rel=1e-6)
    rows = [((1.0, f, s), 1e-4 + 1e-11 * f + 3e-9 * s)
            for f, s in ((1e6, 1e4), (1e8, 1e4), (1e7, 1e6), (1e9, 1e7))]
    assert fit_terms(rows) == pytest.approx([1e-4, 1e-11, 3e-9], rel=1e-6)
    # a term that would come out negative is dropped, not returned negative
    assert min(fit_terms([((1.0, n), 1e-9 * n) for n in (1e3, 1e5, 1e7)])) >= 0
    fits = fit_collectives({2: [("all_gather", b, 1e-3 + b * 1e-9) for b in (4096, 1 << 20)]})
    assert fits["all_gather"][2].latency == pytest.approx(1e-3)


def test_calibration_file_round_trip(tmp_path):
    """The kernels, update and collectives written by --calibrate are what `local` reads,
    with the machine's cores and Gloo."""
    costs = _costs()
    coll = {2: [("all_reduce", b, 1e-4 + b / 1e9) for b in (4096, 1 << 20)]
            + [("all_gather", b, 1e-4 + b / 1e9) for b in (4096, 1 << 20)]}
    meas = LocalMeasurements([(1e6, 1e-5), (1e8, 1e-3), (1e9, 1e-2)], 1e10, coll, 4,
                             2.0 ** 34, 2, costs)
    path = write_calibration(meas, tmp_path / "cal.toml")
    hw = get_hardware("local", calibration=path)
    assert (hw.cores, hw.backend) == (2, "gloo")
    again = hw.cpu
    assert again.optimizer == pytest.approx(costs.optimizer)
    for name in KERNELS:
        assert again.kernels[name].bwd.latency == pytest.approx(costs.kernels[name].bwd.latency)
    assert again.collective("all_gather", 4, 1e6) == pytest.approx(2e-3 + 2e-3)
    assert again.collective("all_gather", 3, 1e6) == again.collective("all_gather", 4, 1e6)
    assert again.collective("all_to_all", 2, 1e6) is None  # unmeasured: the link model
    assert "cpu" in tomllib.loads(path.read_text())["local"]
    assert (again.blocks, again.compose) == ((), 1.0)


def test_composed_blocks_are_priced_from_the_fits(tmp_path):
    """[Note: composed blocks]: --calibrate stores the measured blocks and the geometric
    mean of measured over priced seconds; the file reads back the same."""
    from dataclasses import replace

    from shardwise.planner.calibrate import compose_factor, priced_block_seconds

    coll = {2: [(k, b, 1e-4 + b / 1e9) for k in ("all_reduce", "all_gather")
                for b in (4096, 1 << 20)]}
    meas = LocalMeasurements([(1e6, 1e-5), (1e8, 1e-3), (1e9, 1e-2)], 1e10, coll, 2,
                             2.0 ** 34, 2, _costs())
    plain = get_hardware("local", calibration=write_calibration(meas, tmp_path / "a.toml"))
    priced = [priced_block_seconds(plain, d, h, kv) for d, h, kv in ((384, 6, 3), (640, 10, 5))]
    assert priced[1] > priced[0] > 0
    blocks = ((384, 6, 3, 1.2 * priced[0], 1.1 * priced[0]),
              (640, 10, 5, 1.5 * priced[1], 0.9 * priced[1]))
    meas.cpu = replace(meas.cpu, blocks=blocks)
    hw = get_hardware("local", calibration=write_calibration(meas, tmp_path / "b.toml"))
    assert hw.cpu.compose == pytest.approx((1.2 * 1.5) ** 0.5, rel=1e-3)
    # [Note: undisturbed steps]: the fastest calls give their own factor
    assert hw.cpu.compose_best == pytest.approx((1.1 * 0.9) ** 0.5, rel=1e-3)
    assert hw.cpu.undisturbed().compose == hw.cpu.compose_best
    assert hw.cpu.undisturbed().kernels == hw.cpu.kernels
    for got, want in zip(hw.cpu.blocks, blocks, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert compose_factor(plain, ()) == 1.0
    with pytest.raises(ValueError, match="compose = 9"):
        CpuCosts.from_table({"compose": 9})
    with pytest.raises(ValueError, match="compose_best = 0.1"):
        CpuCosts.from_table({"compose_best": 0.1})
    with pytest.raises(ValueError, match="blocks"):
        CpuCosts.from_table({"blocks": [[384, 6, 3]]})
    # a calibration written before the fastest calls were kept: four columns, no
    # compose_best; the median stands in for both
    old = CpuCosts.from_table({"blocks": [[384, 6, 3, 0.08]], "compose": 1.1})
    assert old.blocks == ((384, 6, 3, 0.08, 0.08),)
    assert (old.compose_best, old.undisturbed().compose) == (0.0, 1.1)
    assert "compose_best" not in "\n".join(old.toml_lines())


@pytest.mark.parametrize("layout", [{}, {"tp": 2, "sp": True}, {"pp": 2, "pp_microbatches": 2,
                                                            "pp_schedule": "1f1b"}])
def test_compose_scales_compute_not_communication(layout):
    """The composed-blocks factor multiplies what the ranks compute (layers and head,
    forward and backward, so the bubble too), never the collectives."""
    from dataclasses import replace

    hw = _local(cores=8)
    slow = hw.replace(cpu=replace(hw.cpu, compose=1.5))
    a, b = _estimate(hw, **layout).breakdown, _estimate(slow, **layout).breakdown
    assert b["compute"] == pytest.approx(1.5 * a["compute"], rel=1e-9)
    # (the simulator reads stage costs to 4 significant digits)
    assert b["pp_bubble"] == pytest.approx(1.5 * a["pp_bubble"], rel=1e-3)
    for k in ("tp_comm", "dp_comm", "pp_comm", "optimizer"):
        assert b[k] == pytest.approx(a[k], rel=1e-9)


def test_gpus_never_take_the_cpu_path():
    for name in ("a100-80gb", "h100", "h200", "b200", "mi300x"):
        hw = get_hardware(name)
        assert hw.cpu is None and hw.cores == 0 and hw.backend == "nccl"


def test_more_ranks_than_cores_time_share_them():
    """Data parallel at stage 3: every rank equally busy, so 4 ranks on 2 cores take twice
    the compute of 2 ranks on 2 cores; on 4 cores (or a GPU) they do not."""
    two, four = _estimate(_local(2), dp_shard=2, zero=3), _estimate(_local(2), dp_shard=4, zero=3)
    wide = _estimate(_local(4), dp_shard=4, zero=3)
    assert four.breakdown["compute"] == pytest.approx(2 * two.breakdown["compute"], rel=0.03)
    assert wide.breakdown["compute"] == pytest.approx(two.breakdown["compute"], rel=1e-9)


def test_collectives_are_exposed_once_the_cores_are_saturated():
    """On 4 cores 2 ranks leave cores for Gloo's threads (overlap as scheduled); on 2
    cores every gather and reduction is on the step."""
    sat, free = _estimate(_local(2), dp_shard=2, zero=3), _estimate(_local(4), dp_shard=2,
                                                                    zero=3)
    assert sat.breakdown["dp_comm"] > free.breakdown["dp_comm"]
    cm = CostModel(get_model_spec("debug"), _local(2), Workload(seq_len=128, global_batch=8,
                                                                compute_dtype="fp32"))
    L = Layout(microbatch=4, dp_shard=2, zero=3)
    assert sat.breakdown["dp_comm"] >= cm.dp_collective_seconds(L)


def test_pipeline_bubble_is_filled_by_time_sharing():
    """pp 2 x dp 2 on 2 cores: ranks waiting in the bubble free their core, so the step is
    the four ranks' busy seconds (compute, and the collectives' CPU: half their seconds
    here) over the two cores plus the collectives' waiting that no other rank fills (2 of
    4 ranks' worth), not the critical path with its bubble slowed down."""
    import dataclasses

    hw = _local(2)
    hw = hw.replace(cpu=dataclasses.replace(hw.cpu, comm_cpu={2: 0.5, 4: 0.25}))
    pipe = dict(pp=2, dp_shard=2, zero=3, pp_microbatches=2, pp_schedule="1f1b", pp_virtual=1)
    est, alone = _estimate(hw, **pipe), _estimate(_local(4), **pipe)
    wl = Workload(seq_len=128, global_batch=8, compute_dtype="fp32")
    cm = CostModel(get_model_spec("debug"), hw, wl)
    L = Layout(microbatch=4, **pipe)
    busy = sum(2 * (rt.fwd + rt.bwd) + cm._optimizer(L, lay, *cm._rank_plan(L, r)[1:])[0]
               for r, rt, lay in cm._all_ranks(L))
    b = est.breakdown
    comm = b["pp_comm"] + b["dp_comm"] + b["tp_comm"]
    on_core = 0.5 * comm  # every group here has 2 ranks
    assert est.step_time == pytest.approx((2 * busy + 4 * on_core) / 2
                                          + (comm - on_core) * 2 / 4, rel=0.02)  # copies aside
    without = _estimate(_local(2), **pipe)  # CPU fraction not measured: all waiting
    assert without.step_time < est.step_time
    assert alone.step_time < est.step_time < 2 * alone.step_time
    assert b["pp_bubble"] == pytest.approx(alone.breakdown["pp_bubble"])


def test_layer_kernels_count_the_calls_a_block_makes():
    """Each kernel call pays its latency: two norms, two residual adds, RoPE on q and on k,
    the gate, the attention kernel (its multiplies and softmax), k and v expanded for
    grouped-query attention."""
    spec = get_model_spec("debug")
    hw = _local(2).replace(cpu=CpuCosts({k: Kernel(Fit(1.0, 0.0), Fit(1.0, 0.0))
                                         for k in KERNELS}, Fit(0.0, 0.0), {}))
    fwd, bwd = layer_kernels(hw, spec, 512, 128, 1, False, 1e6)
    assert fwd == bwd == 2 + 2 + 2 + 1 + 2 + 2
    fwd_tp, _ = layer_kernels(hw, spec, 512, 128, 2, True, 1e6)
    assert fwd_tp == fwd  # the same calls on every tensor-parallel rank


def test_saved_activations_equal_saved_tensors_hooks():
    """The planner's per-layer list (Korthikanti-style, eager fp32 Llama: norms' input and
    normalised copies, q / expanded k, v / attention output, the SwiGLU tensors, the
    log-sum-exp; the final norm and the log-softmax output) against what autograd saves
    in shardwise.models, parameter storages left out."""
    from bench.planner_measure import SavedPeak, parameter_storages

    cfg = get_model_config("debug", n_layers=2)
    model = build_model(cfg, seed=0)
    b, t = 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1))
    saved = SavedPeak(parameter_storages(model))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    spec = from_llama_config(cfg, "debug")
    cm = CostModel(spec, _local(2), Workload(seq_len=t, global_batch=b, compute_dtype="fp32"))
    predicted = cm.estimate(Layout(microbatch=b)).memory.activations
    assert predicted == pytest.approx(saved.peak, rel=0.01)


def test_busy_cores_compute_slower():
    """The measured slowdown applies once every core computes: 1 rank runs at the lone-core
    speed, 2 ranks on 2 cores (and 4, time-sharing them) at the all-cores ratio; on 4
    cores, 3 ranks are interpolated between the 2- and 4-core ratios."""
    costs = CpuCosts({k: Kernel(Fit(1e-4, 1e-9), Fit(2e-4, 2e-9)) for k in KERNELS},
                     Fit(1e-5, 5e-9), {}, busy={2: 1.2, 4: 1.5})
    assert [costs.contention(b, 2) for b in (1, 2, 3, 4, 8)] == pytest.approx(
        [1.0, 1.2, 1.2, 1.2, 1.2])
    assert costs.contention(3, 4) == pytest.approx(1.35)  # on 4 cores: between 2 and 4
    hw = _local(2).replace(cpu=CpuCosts(costs.kernels, costs.optimizer, {}, busy={2: 1.2}))
    one, two = _estimate(hw, dp_shard=1, zero=0), _estimate(hw, dp_shard=2, zero=0)
    assert two.breakdown["compute"] == pytest.approx(1.2 * one.breakdown["compute"])
    again = CpuCosts.from_table(tomllib.loads("\n".join(costs.toml_lines("x")))["x"]["cpu"])
    assert again.busy == pytest.approx({2: 1.2, 4: 1.5})  # as written
    assert again.busy_best == {} and again.undisturbed().busy == again.busy
    # [Note: undisturbed steps]: the fastest calls' slowdown, written, read, and used
    quiet = replace(costs, busy_best={2: 1.05})
    back = CpuCosts.from_table(tomllib.loads("\n".join(quiet.toml_lines("x")))["x"]["cpu"])
    assert back.busy_best == pytest.approx({2: 1.05})
    assert back.undisturbed().contention(2, 2) == pytest.approx(1.05)
    assert back.contention(2, 2) == pytest.approx(1.2)


def test_collective_cpu_fraction_round_trips_and_is_checked():
    """The collectives' measured CPU fraction per group size is written and read back, read
    from the nearest group size, 0 when not measured, and a value outside [0, 1] is
    refused by name."""
    import dataclasses

    costs = dataclasses.replace(_costs(), comm_cpu={2: 0.5, 4: 0.25})
    table = tomllib.loads("\n".join(costs.toml_lines("x")))["x"]["cpu"]
    again = CpuCosts.from_table(table)
    assert again.comm_cpu == pytest.approx({2: 0.5, 4: 0.25})
    assert [again.comm_cpu_fraction(w) for w in (1, 2, 3, 4, 8)] == pytest.approx(
        [0.0, 0.5, 0.25, 0.25, 0.25])
    assert _costs().comm_cpu_fraction(2) == 0.0
    with pytest.raises(ValueError, match=r"comm_cpu\.2 = 1.5"):
        CpuCosts.from_table({**table, "comm_cpu": {"2": 1.5}})


def _tp_calls(sp: bool):
    """One training step's collective calls by label, on 2 ranks, tp 2."""
    import re

    import shardwise
    from shardwise import LossScaler
    from shardwise.distributed import env as dist_env
    from shardwise.train.config import load_config, resolve_world
    from shardwise.train.parallelize import build_parallel_model, wrap_optimizer
    from shardwise.train.preflight import build_model_config
    from shardwise.train.step import train_step
    from shardwise.train.trainer import build_optimizer

    cfg = resolve_world(load_config(None, {
        "model.name": "debug", "model.n_layers": "2", "data.seq_len": "16",
        "train.batch_size": "2", "parallel.tp": "2", "parallel.stage": "2",
        "parallel.sequence_parallel": str(sp).lower(), "log.progress": "false",
        "parallel.watchdog": "off"}), 2)
    mc = build_model_config(cfg)
    env = dist_env.init(backend="gloo", watchdog="off")
    model = build_parallel_model(cfg, mc, env)
    opt = wrap_optimizer(build_optimizer(model, cfg.optim), model)
    gen = torch.Generator().manual_seed(0)

    class Loader:
        def next_batch(self):
            t = torch.randint(0, mc.vocab_size, (2, 17), generator=gen)
            return t[:, :-1], t[:, 1:]

    shardwise.reset_comm_stats()
    train_step(model, opt, Loader(), cfg, env, 1, LossScaler(enabled=False))
    calls = {}
    for label, st in shardwise.comm_stats().by_label.items():
        key = re.sub(r".*\.", "", label)
        calls[key] = calls.get(key, 0) + st.calls
    return calls


@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_collectives_are_the_trainers(sp):
    """With every collective costing 1 s, the CPU path's tensor-parallel seconds of a step
    are the number of collectives apply_tp issues (comm_stats), sequence parallel or not."""
    from shardwise.planner.cpu_stage import tp_head_comm, tp_layer_comm
    from shardwise.testing import run_ranks

    calls = run_ranks(_tp_calls, 2, args=(sp,), timeout_s=120)[0]
    got = sum(n for k, n in calls.items() if k not in ("stats", "clip_grad_norm"))
    ones = {k: {2: Fit(1.0, 0.0)} for k in ("all_gather", "reduce_scatter", "all_reduce")}
    hw = _local(2).replace(cpu=CpuCosts({}, Fit(0.0, 0.0), ones))
    predicted = 2 * tp_layer_comm(hw, 32, 256, 4, 2, sp, False) + tp_head_comm(
        hw, 32, 256, 4, 2, sp, True, True) + (1 if sp else 0)  # + the norms' gradients
    assert predicted == got, calls


def test_gloo_micro_benchmark_runs_every_collective_on_real_ranks():
    """``--calibrate``'s collective rows come from live Gloo ranks through the engine's own
    calls (all four kinds, both payloads, a positive time each, the CPU time beside it) and
    fit per group size."""
    from shardwise.planner.cpu_gloo import cpu_fractions, measure_gloo

    rows = measure_gloo(2, [4096, 65536], calls=3, timeout_s=120)
    assert sorted({(k, b) for k, b, _, _ in rows}) == sorted(
        (k, b) for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")
        for b in (4096, 65536))
    assert all(t > 0 and 0 <= c for _, _, t, c in rows)
    assert any(c > 0 for *_, c in rows)  # a collective spends some CPU
    frac = cpu_fractions({2: rows})
    assert set(frac) == {2} and 0 < frac[2] <= 1
    fits = fit_collectives({2: rows})
    assert set(fits) == {"all_gather", "reduce_scatter", "all_reduce", "send_recv"}
    assert all(set(per_world) == {2} for per_world in fits.values())


def test_measure_blocks_times_the_calibration_blocks():
    """The composed blocks run for real (shardwise.models' block, forward and backward, one
    thread) and come back as (dim, heads, kv_heads, seconds) rows the pricing reads."""
    from shardwise.planner.cpu_bench import BLOCKS, measure_blocks

    threads = torch.get_num_threads()
    rows = measure_blocks(seconds=0.01)
    assert torch.get_num_threads() == threads  # restored
    assert [r[:3] for r in rows] == [tuple(b) for b in BLOCKS]
    assert all(r[3] >= r[4] > 0 for r in rows)  # the median call, then the fastest
    assert rows[1][3] > rows[0][3]  # the wider block takes longer


def test_contention_ratios_run_the_block_on_every_core():
    """Both slowdowns come back per process count, never below 1 (the lone process's
    median and fastest calls are the references), and a lone process asks for nothing."""
    from shardwise.planner.cpu_bench import contention_ratios, measure_contention

    median, fastest = contention_ratios([1, 2], seconds=0.05)
    assert set(median) == set(fastest) == {2}
    assert median[2] >= 1.0 and fastest[2] >= 1.0
    assert contention_ratios([1]) == ({}, {}) and measure_contention([1]) == {}


def test_median_blocks_takes_each_blocks_median_over_passes():
    """The composed blocks are timed in three passes across the calibration; one fast (or
    slow) pass does not decide a block's seconds."""
    from shardwise.planner.cpu_bench import median_blocks

    passes = [((384, 6, 3, 0.09, 0.08), (640, 10, 5, 0.187, 0.180)),
              ((384, 6, 3, 0.10, 0.07), (640, 10, 5, 0.240, 0.175)),
              ((384, 6, 3, 0.30, 0.09), (640, 10, 5, 0.232, 0.172))]
    # the median of the medians, the fastest call of any pass
    assert median_blocks(passes) == ((384, 6, 3, 0.10, 0.07), (640, 10, 5, 0.232, 0.172))
    assert median_blocks([((384, 6, 3, 0.09),), ((384, 6, 3, 0.12),), ((384, 6, 3, 0.1),)]) \
        == ((384, 6, 3, 0.1, 0.09),)  # four columns: the medians stand in


# ---------------------------------------------------------------- crowded collectives
def _crowd(hw, slow: float, cpu_fraction: float = 0.2, gap_s: float = 4e-3) -> Crowd:
    lone = hw.cpu.collectives
    return Crowd({k: {2: Fit(slow * v[2].latency, slow * v[2].per_unit)}
                  for k, v in lone.items()}, {2: cpu_fraction}, gap_s)


def _crowded(hw, slow: float, cpu_fraction: float = 0.2, short: float | None = None,
             gaps: tuple[float, float] = (1e-3, 4e-3)):
    """``hw`` with its 2-rank groups measured crowded in a 4-rank world: ``slow`` times
    their lone fits after ``gaps[1]`` seconds of compute, and ``short`` times after
    ``gaps[0]`` if given ([Note: crowded collectives] in shardwise/planner/cpu_stage.py)."""
    crowds = (_crowd(hw, slow, cpu_fraction, gaps[1]),)
    if short is not None:
        crowds = (_crowd(hw, short, cpu_fraction / 2, gaps[0]),) + crowds
    return hw.replace(cpu=replace(hw.cpu, crowded={4: crowds}))


def _fractions(hw):
    return hw.replace(cpu=replace(hw.cpu, comm_cpu={2: 0.5, 4: 0.25}))


def test_crowded_fits_replace_the_smaller_groups_beyond_the_cores_only():
    c = _crowded(_fractions(_local(2)), 4.0).cpu
    assert c.in_world(2, 2) is c and c.in_world(4, 4) is c  # every rank keeps a core
    four = c.in_world(4, 2)
    assert four.collective("all_gather", 2, 1e6) == pytest.approx(
        4 * c.collective("all_gather", 2, 1e6))
    # the world's own group was measured with every rank running: unchanged
    assert four.collective("reduce_scatter", 4, 1e6) == c.collective("reduce_scatter", 4, 1e6)
    assert four.comm_cpu == {2: 0.2, 4: 0.25} and not four.crowded
    assert four.in_world(4, 2) is four  # applying it twice changes nothing
    eight = c.in_world(8, 2)  # beyond the measured world: the nearest one's crowd
    assert eight.collective("all_reduce", 2, 1e5) == four.collective("all_reduce", 2, 1e5)
    assert c.in_world(4, 2, gap_s=1e-4).collective("all_reduce", 2, 1e5) == \
        four.collective("all_reduce", 2, 1e5)  # one gap measured: it stands for every gap


def test_crowds_are_interpolated_between_the_measured_gaps_and_clamped():
    """After 1 ms of compute the pairs were 2x their lone fits, after 4 ms 5x: 2.5 ms
    between the two is 3.5x, and outside the measured gaps the nearest one holds."""
    c = _crowded(_fractions(_local(2)), 5.0, short=2.0).cpu
    lone = c.collective("all_gather", 2, 1e6)

    def at(gap):
        return c.in_world(4, 2, gap_s=gap).collective("all_gather", 2, 1e6) / lone

    assert [at(g) for g in (1e-3, 2.5e-3, 4e-3)] == pytest.approx([2.0, 3.5, 5.0])
    assert at(1e-5) == pytest.approx(2.0) and at(1.0) == pytest.approx(5.0)
    assert c.in_world(4, 2).collective("all_gather", 2, 1e6) / lone == pytest.approx(5.0)
    assert c.in_world(4, 2, gap_s=2.5e-3).comm_cpu[2] == pytest.approx(0.15)


def test_crowded_fits_round_trip_through_the_calibration_file_and_are_checked():
    c = _crowded(_fractions(_local(2)), 3.0, short=1.5).cpu
    table = tomllib.loads("\n".join(c.toml_lines("x")))["x"]["cpu"]
    again = CpuCosts.from_table(table)
    assert set(again.crowded) == {4} and len(again.crowded[4]) == 2
    for want, got in zip(c.crowded[4], again.crowded[4], strict=True):
        assert got.gap_s == pytest.approx(want.gap_s)
        assert got.comm_cpu == pytest.approx(want.comm_cpu)
        for kind, by_group in want.collectives.items():
            g = got.collectives[kind][2]
            assert (g.latency, g.per_unit) == pytest.approx(
                (by_group[2].latency, by_group[2].per_unit), rel=1e-5)
    assert CpuCosts.from_table({k: v for k, v in table.items() if k != "crowded"}).crowded == {}
    with pytest.raises(ValueError, match=r"crowded\.4\.comm_cpu\.2 = 1.5"):
        CpuCosts.from_table({**table, "crowded": {"4": [{"comm_cpu": {"2": 1.5}}]}})
    with pytest.raises(ValueError, match=r"crowded\.4\.all_gather\.2"):
        CpuCosts.from_table({**table, "crowded": {"4": [{"collectives": {
            "all_gather": {"2": [1.0]}}}]}})
    with pytest.raises(ValueError, match=r"crowded\.4: expected an array of tables"):
        CpuCosts.from_table({**table, "crowded": {"4": {"comm_cpu": {"2": 0.5}}}})


_PIPE = dict(pp=2, dp_shard=2, zero=3, pp_microbatches=2, pp_schedule="1f1b", pp_virtual=1)


def test_crowded_groups_lengthen_a_pipeline_beyond_the_cores_not_data_parallelism():
    """pp 2 x dp 2 on 4 ranks over 2 cores: the step is its critical path with the
    crowded 2-rank fits, or the time-shared bound with the lone ones, whichever is longer.
    A crowd as fast as the lone groups changes nothing; 4 ranks of pure data parallelism
    (the world's own group) and 2 ranks on 2 cores never read the crowd."""
    base = _fractions(_local(2))
    plain = _estimate(base, **_PIPE)
    assert _estimate(_crowded(base, 1.0), **_PIPE).step_time == pytest.approx(
        plain.step_time, rel=1e-12)
    slow = _crowded(base, 30.0)
    est = _estimate(slow, **_PIPE)
    wl = Workload(seq_len=128, global_batch=8, compute_dtype="fp32")
    timeline = CostModel(get_model_spec("debug"), slow.replace(cpu=slow.cpu.in_world(4, 2)),
                         wl)
    timeline.timeline_only = True
    own = timeline.estimate(Layout(microbatch=4, **_PIPE), exact=True)
    assert est.step_time == pytest.approx(own.step_time)
    assert est.step_time > plain.step_time  # the timeline with the slow pairs is longer
    assert est.breakdown["dp_comm"] > plain.breakdown["dp_comm"]
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time)
    cm, L = CostModel(get_model_spec("debug"), slow, wl), Layout(microbatch=4, **_PIPE)
    assert cm.dp_collective_seconds(L) > CostModel(get_model_spec("debug"), base, wl
                                                   ).dp_collective_seconds(L)
    assert cm.lower_bound(L) <= est.step_time
    for other in (dict(dp_shard=4, zero=3), dict(dp_shard=2, zero=3),
                  dict(pp=2, zero=2, pp_microbatches=2, pp_schedule="1f1b", pp_virtual=1)):
        assert _estimate(slow, **other).step_time == _estimate(base, **other).step_time


def test_tensor_parallel_collectives_meet_the_crowd_at_their_own_gap():
    """tp 2 x dp 2 on 4 ranks: the tensor-parallel pairs meet their peers a fraction of a
    layer apart, so they are priced at the crowd interpolated at that gap (here below the
    short one: the 1 ms crowd), while the data-parallel pairs take the layer-gap crowd."""
    base = _fractions(_local(2))
    tp = dict(tp=2, sp=True, dp_shard=2, zero=3)
    cm = CostModel(get_model_spec("debug"), base, Workload(seq_len=128, global_batch=8,
                                                           compute_dtype="fp32"))
    L = Layout(microbatch=4, **tp)
    _, rt, layers = max(cm._sample_ranks(L), key=lambda x: x[1].busy)
    gap = cm._tp_gap(L)
    assert gap == pytest.approx((rt.fwd + rt.bwd) / (10 * len(layers)))
    gaps = (2 * gap, 8 * gap)  # the layout's gap is below the short one
    short_lone = _estimate(_crowded(base, 20.0, short=1.0, gaps=gaps), **tp)
    both_slow = _estimate(_crowded(base, 20.0, short=20.0, gaps=gaps), **tp)
    lone = _estimate(base, **tp)
    assert short_lone.breakdown["tp_comm"] == pytest.approx(lone.breakdown["tp_comm"])
    assert both_slow.breakdown["tp_comm"] > 10 * lone.breakdown["tp_comm"]
    assert short_lone.breakdown["dp_comm"] == pytest.approx(both_slow.breakdown["dp_comm"])
    assert short_lone.breakdown["dp_comm"] > lone.breakdown["dp_comm"]
    assert cm._tp_gap(Layout(microbatch=4, dp_shard=4, zero=3)) is None


def test_calibration_measures_the_crowd_only_beyond_the_cores(monkeypatch):
    """measure_cpu times each smaller group of a world beyond the cores, all groups at
    once, at both gaps (the kernels and blocks faked: only the collectives' wiring is
    under test)."""
    from shardwise.planner import cpu_bench

    launched = []

    def fake_gloo(world, sizes, calls=21, timeout_s=300.0, group=None, multiplies=3):
        launched.append((world, group, multiplies))
        slow = 1.0 + (group is not None) * multiplies
        return [(k, b, slow * (1e-3 + b * 1e-9), 0.5e-3) for b in sizes
                for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")]

    monkeypatch.setattr(cpu_bench, "measure_gloo", fake_gloo)
    monkeypatch.setattr(cpu_bench, "gap_seconds", lambda mult: mult * 1.5e-3)
    monkeypatch.setattr(cpu_bench, "measure_blocks", lambda seconds: ((384, 6, 3, 0.1, 0.09),))
    monkeypatch.setattr(cpu_bench, "measure_kernels", lambda quick: _costs().kernels)
    monkeypatch.setattr(cpu_bench, "measure_optimizer", lambda quick: Fit(1e-5, 1e-9))
    monkeypatch.setattr(cpu_bench, "contention_ratios", lambda counts, seconds: (
        {2: 1.1}, {2: 1.05}))
    four = cpu_bench.measure_cpu(4, quick=True, cores=2)
    assert launched == [(2, None, 3), (4, None, 3), (4, 2, 1), (4, 2, 3)]
    short, long = four.crowded[4]
    assert (short.gap_s, long.gap_s) == pytest.approx((1.5e-3, 4.5e-3))
    assert set(long.collectives["all_gather"]) == {2} and long.comm_cpu[2] < four.comm_cpu[2]
    for crowd, slow in ((short, 2.0), (long, 4.0)):
        assert crowd.collectives["send_recv"][2](1e6) == pytest.approx(
            slow * four.collectives["send_recv"][2](1e6), rel=1e-6)
    launched.clear()
    assert cpu_bench.measure_cpu(2, quick=True, cores=2).crowded == {}
    assert launched == [(2, None, 3)]


def test_gloo_micro_benchmark_runs_groups_inside_a_larger_world():
    """Two 2-rank groups of a 4-rank world run the same collectives at once, through the
    engine's calls on their own groups; a group that does not divide the world is refused
    by value before any rank starts."""
    from shardwise.planner.cpu_gloo import measure_gloo

    rows = measure_gloo(4, [4096], calls=3, timeout_s=120, group=2)
    assert sorted(k for k, *_ in rows) == ["all_gather", "all_reduce", "reduce_scatter",
                                           "send_recv"]
    assert all(t > 0 and c >= 0 for *_, t, c in rows)
    for bad in (3, 1):
        with pytest.raises(ValueError, match=f"group={bad} must be at least 2 and divide "
                                             "world=4"):
            measure_gloo(4, [4096], group=bad)
    with pytest.raises(ValueError, match="multiplies=0 must be at least 1"):
        measure_gloo(2, [4096], multiplies=0)
