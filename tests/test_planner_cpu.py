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
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.cost_model import CostModel
from shardwise.planner.devices.cpu.costs import KERNELS, CpuCosts
from shardwise.planner.devices.cpu.fits import Crowd, Fit, Kernel
from shardwise.planner.devices.cpu.kernels import layer_kernels
from shardwise.planner.devices.registry import device_model
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.workload import Workload
from tests.planner_helpers import estimate_debug, local_cpu


@pytest.mark.parametrize("layout", [{}, {"tp": 2, "sp": True}, {"pp": 2, "pp_microbatches": 2,
                                                            "pp_schedule": "1f1b"}])
def test_compose_scales_compute_not_communication(layout):
    """The composed-blocks factor multiplies what the ranks compute (layers and head,
    forward and backward, so the bubble too), never the collectives."""
    from dataclasses import replace

    hw = local_cpu(cores=8)
    slow = hw.replace(cpu=replace(hw.cpu, compose=1.5))
    a, b = estimate_debug(hw, **layout).breakdown, estimate_debug(slow, **layout).breakdown
    assert b["compute"] == pytest.approx(1.5 * a["compute"], rel=1e-9)
    # (the simulator reads stage costs to 4 significant digits)
    assert b["pp_bubble"] == pytest.approx(1.5 * a["pp_bubble"], rel=1e-3)
    for k in ("tp_comm", "dp_comm", "pp_comm", "optimizer"):
        assert b[k] == pytest.approx(a[k], rel=1e-9)


def test_cpu_ranks_price_the_accumulation_as_the_calibrated_add():
    """On CPU ranks autograd's accumulation is the calibrated elementwise add (``residual``),
    one call per parameter tensor the rank holds, once per micro-batch after the first."""
    from shardwise.planner.stage_cost import StageCoster

    hw, spec = local_cpu(cores=8), get_model_spec("debug")
    wl = Workload(seq_len=128, global_batch=16, compute_dtype="fp32")
    L = Layout(microbatch=4, pp_microbatches=4)
    layers = list(range(spec.n_layers))
    on = StageCoster(spec, device_model(hw), wl).rank(L, layers, True, True)
    off = StageCoster(spec, device_model(hw), replace(wl, autograd_accum=False)).rank(
        L, layers, True, True)
    shapes = [s for i in layers for s in spec.block_shapes(i)] + spec.root_shapes()
    adds = sum(1e-4 + 1e-9 * torch.Size(s).numel() for s in shapes)  # cpu_costs' residual fit
    assert on.bwd - off.bwd == pytest.approx(adds * 3 / 4, rel=1e-9)
    assert on.fwd == off.fwd


def test_gpus_never_take_the_cpu_path():
    for name in ("a100-80gb", "h100", "h200", "b200", "mi300x"):
        hw = get_hardware(name)
        assert hw.cpu is None and hw.cores == 0 and hw.backend == "nccl"


def test_more_ranks_than_cores_time_share_them():
    """Data parallel at stage 3: every rank equally busy, so 4 ranks on 2 cores take twice
    the compute of 2 ranks on 2 cores; on 4 cores (or a GPU) they do not."""
    two = estimate_debug(local_cpu(2), dp_shard=2, zero=3)
    four = estimate_debug(local_cpu(2), dp_shard=4, zero=3)
    wide = estimate_debug(local_cpu(4), dp_shard=4, zero=3)
    assert four.breakdown["compute"] == pytest.approx(2 * two.breakdown["compute"], rel=0.03)
    assert wide.breakdown["compute"] == pytest.approx(two.breakdown["compute"], rel=1e-9)


def test_collectives_are_exposed_once_the_cores_are_saturated():
    """On 4 cores 2 ranks leave cores for Gloo's threads (overlap as scheduled); on 2
    cores every gather and reduction is on the step."""
    sat = estimate_debug(local_cpu(2), dp_shard=2, zero=3)
    free = estimate_debug(local_cpu(4), dp_shard=2, zero=3)
    assert sat.breakdown["dp_comm"] > free.breakdown["dp_comm"]
    cm = CostModel(get_model_spec("debug"), local_cpu(2), Workload(seq_len=128, global_batch=8,
                                                                compute_dtype="fp32"))
    L = Layout(microbatch=4, dp_shard=2, zero=3)
    assert sat.breakdown["dp_comm"] >= cm.dp_collective_seconds(L)


def test_pipeline_bubble_is_filled_by_time_sharing():
    """pp 2 x dp 2 on 2 cores: ranks waiting in the bubble free their core, so the step is
    the four ranks' busy seconds (compute, and the collectives' CPU: half their seconds
    here) over the two cores, not the critical path with its bubble slowed down; the
    collectives' waiting is other ranks' turns ([Note: waiting beyond the cores])."""
    import dataclasses

    hw = local_cpu(2)
    hw = hw.replace(cpu=dataclasses.replace(hw.cpu, comm_cpu={2: 0.5, 4: 0.25}))
    pipe = dict(pp=2, dp_shard=2, zero=3, pp_microbatches=2, pp_schedule="1f1b", pp_virtual=1)
    est, alone = estimate_debug(hw, **pipe), estimate_debug(local_cpu(4), **pipe)
    wl = Workload(seq_len=128, global_batch=8, compute_dtype="fp32")
    cm = CostModel(get_model_spec("debug"), hw, wl)
    L = Layout(microbatch=4, **pipe)
    busy = sum(2 * (rt.fwd + rt.bwd) + cm.optimizer_seconds(L, lay, *cm.rank_plan(L, r)[1:])[0]
               for r, rt, lay in cm.all_ranks(L))
    b = est.breakdown
    comm = b["pp_comm"] + b["dp_comm"] + b["tp_comm"]
    on_core = 0.5 * comm  # the groups here have 2 ranks (the step's statistics aside)
    assert est.step_time == pytest.approx((2 * busy + 4 * on_core) / 2, rel=0.02)  # copies aside
    without = estimate_debug(local_cpu(2), **pipe)  # CPU fraction not measured: all waiting
    assert without.step_time < est.step_time
    assert alone.step_time < est.step_time < 2 * alone.step_time
    assert b["pp_bubble"] == pytest.approx(alone.breakdown["pp_bubble"])


def _slow_collectives(hw, factor: float, copy: bool = True):
    """``hw`` with its 4-rank collectives ``factor`` times their fits, CPU fractions
    measured (0.5 of a 2-rank collective's seconds, 0.25 of a 4-rank one's), and the
    engine's copies free unless ``copy``."""
    c = hw.cpu
    colls = {k: {**v, 4: Fit(factor * v[4].latency, factor * v[4].per_unit)}
             for k, v in c.collectives.items()}
    kernels = dict(c.kernels)
    if not copy:
        kernels["copy"] = Kernel(Fit(0.0, 0.0), Fit(0.0, 0.0))
    return hw.replace(cpu=replace(c, collectives=colls, kernels=kernels,
                                  comm_cpu={2: 0.5, 4: 0.25}))


def test_waiting_beyond_the_cores_is_not_on_the_step():
    """ZeRO-3 over 4 ranks on 2 cores: a collective's waiting is the peers' compute while
    they time-share the cores, already in the busy seconds ([Note: waiting beyond the
    cores]), so slower collectives lengthen the step only by their CPU: each rank's 0.25
    of the added seconds, 4 ranks over 2 cores."""
    fast = estimate_debug(_slow_collectives(local_cpu(2), 1.0), dp_shard=4, zero=3)
    slow = estimate_debug(_slow_collectives(local_cpu(2), 10.0), dp_shard=4, zero=3)
    added = slow.breakdown["dp_comm"] - fast.breakdown["dp_comm"]
    assert added > 0.1 * fast.step_time  # the collectives weigh
    assert slow.step_time - fast.step_time == pytest.approx(4 * 0.25 * added / 2, rel=1e-6)


def test_collectives_cpu_is_their_own_groups():
    """dp_replicate 4 on 2 cores (no shards): the replicas' gradient all-reduce and the
    step's loss and statistics are 4-rank collectives, so 0.25 of their seconds is CPU
    that joins the busy seconds, not nothing (the engine's shard group has one rank)."""
    layout = dict(dp_replicate=4, dp_shard=1, zero=1)
    wl = Workload(seq_len=128, global_batch=16, compute_dtype="fp32")
    hw = _slow_collectives(local_cpu(2), 1.0, copy=False)
    none = hw.replace(cpu=replace(hw.cpu, comm_cpu={}))
    L = Layout(microbatch=4, **layout)
    got, unmeasured = (CostModel(get_model_spec("debug"), h, wl).estimate(L, exact=True)
                       for h in (hw, none))
    comm = got.breakdown["dp_comm"]
    assert comm > 0 and comm == pytest.approx(unmeasured.breakdown["dp_comm"])
    assert got.step_time - unmeasured.step_time == pytest.approx(4 * 0.25 * comm / 2,
                                                                 rel=1e-6)


def test_layer_kernels_count_the_calls_a_block_makes():
    """Each kernel call pays its latency: two norms, two residual adds, RoPE on q and on k,
    the gate, the attention kernel (its multiplies and softmax), k and v expanded for
    grouped-query attention."""
    spec = get_model_spec("debug")
    hw = local_cpu(2).replace(cpu=CpuCosts({k: Kernel(Fit(1.0, 0.0), Fit(1.0, 0.0))
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
    cm = CostModel(spec, local_cpu(2), Workload(seq_len=t, global_batch=b, compute_dtype="fp32"))
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
    hw = local_cpu(2).replace(cpu=CpuCosts(costs.kernels, costs.optimizer, {}, busy={2: 1.2}))
    one, two = estimate_debug(hw, dp_shard=1, zero=0), estimate_debug(hw, dp_shard=2, zero=0)
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


# ---------------------------------------------------------------- crowded collectives
def _crowd(hw, slow: float, cpu_fraction: float = 0.2, gap_s: float = 4e-3) -> Crowd:
    lone = hw.cpu.collectives
    return Crowd({k: {2: Fit(slow * v[2].latency, slow * v[2].per_unit)}
                  for k, v in lone.items()}, {2: cpu_fraction}, gap_s)


def _crowded(hw, slow: float, cpu_fraction: float = 0.2, short: float | None = None,
             gaps: tuple[float, float] = (1e-3, 4e-3)):
    """``hw`` with its 2-rank groups measured crowded in a 4-rank world: ``slow`` times
    their lone fits after ``gaps[1]`` seconds of compute, and ``short`` times after
    ``gaps[0]`` if given ([Note: crowded collectives] in shardwise/planner/devices/cpu/step.py)."""
    crowds = (_crowd(hw, slow, cpu_fraction, gaps[1]),)
    if short is not None:
        crowds = (_crowd(hw, short, cpu_fraction / 2, gaps[0]),) + crowds
    return hw.replace(cpu=replace(hw.cpu, crowded={4: crowds}))


def _fractions(hw):
    return hw.replace(cpu=replace(hw.cpu, comm_cpu={2: 0.5, 4: 0.25}))


def test_crowded_fits_replace_the_smaller_groups_beyond_the_cores_only():
    c = _crowded(_fractions(local_cpu(2)), 4.0).cpu
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
    c = _crowded(_fractions(local_cpu(2)), 5.0, short=2.0).cpu
    lone = c.collective("all_gather", 2, 1e6)

    def at(gap):
        return c.in_world(4, 2, gap_s=gap).collective("all_gather", 2, 1e6) / lone

    assert [at(g) for g in (1e-3, 2.5e-3, 4e-3)] == pytest.approx([2.0, 3.5, 5.0])
    assert at(1e-5) == pytest.approx(2.0) and at(1.0) == pytest.approx(5.0)
    assert c.in_world(4, 2).collective("all_gather", 2, 1e6) / lone == pytest.approx(5.0)
    assert c.in_world(4, 2, gap_s=2.5e-3).comm_cpu[2] == pytest.approx(0.15)


def test_crowded_fits_round_trip_through_the_calibration_file_and_are_checked():
    c = _crowded(_fractions(local_cpu(2)), 3.0, short=1.5).cpu
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
    base = _fractions(local_cpu(2))
    plain = estimate_debug(base, **_PIPE)
    assert estimate_debug(_crowded(base, 1.0), **_PIPE).step_time == pytest.approx(
        plain.step_time, rel=1e-12)
    slow = _crowded(base, 30.0)
    est = estimate_debug(slow, **_PIPE)
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
        assert estimate_debug(slow, **other).step_time == estimate_debug(base, **other).step_time


def test_tensor_parallel_collectives_meet_the_crowd_at_their_own_gap():
    """tp 2 x dp 2 on 4 ranks: the tensor-parallel pairs meet their peers a fraction of a
    layer apart, so they are priced at the crowd interpolated at that gap (here below the
    short one: the 1 ms crowd), while the data-parallel pairs take the layer-gap crowd."""
    base = _fractions(local_cpu(2))
    tp = dict(tp=2, sp=True, dp_shard=2, zero=3)
    cm = CostModel(get_model_spec("debug"), base, Workload(seq_len=128, global_batch=8,
                                                           compute_dtype="fp32"))
    L = Layout(microbatch=4, **tp)
    _, rt, layers = max(cm.sample_ranks(L), key=lambda x: x[1].busy)
    gap = cm.tp_gap(L)
    assert gap == pytest.approx((rt.fwd + rt.bwd) / (10 * len(layers)))
    gaps = (2 * gap, 8 * gap)  # the layout's gap is below the short one
    short_lone = estimate_debug(_crowded(base, 20.0, short=1.0, gaps=gaps), **tp)
    both_slow = estimate_debug(_crowded(base, 20.0, short=20.0, gaps=gaps), **tp)
    lone = estimate_debug(base, **tp)
    assert short_lone.breakdown["tp_comm"] == pytest.approx(lone.breakdown["tp_comm"])
    assert both_slow.breakdown["tp_comm"] > 10 * lone.breakdown["tp_comm"]
    assert short_lone.breakdown["dp_comm"] == pytest.approx(both_slow.breakdown["dp_comm"])
    assert short_lone.breakdown["dp_comm"] > lone.breakdown["dp_comm"]
    assert cm.tp_gap(Layout(microbatch=4, dp_shard=4, zero=3)) is None


