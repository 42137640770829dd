"""The CPU calibration (``shardwise plan --hardware local --calibrate``): its fits, its
file, its micro-benchmarks on real Gloo ranks and blocks, and the factors the composed
blocks give ([Note: composed blocks], [Note: two composition factors] and [Note:
tensor-parallel pairs]).

Pricing with a calibration is tested in test_planner_cpu.py; refitting a device to measured
steps in test_planner_calibrate.py."""

from __future__ import annotations

import pytest
import torch

from shardwise.compat import tomllib
from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.calibrate import LocalMeasurements, write_calibration
from shardwise.planner.calibrate.kernels import fit_collectives, fit_terms
from shardwise.planner.devices.cpu.costs import KERNELS, CpuCosts
from shardwise.planner.devices.cpu.device import CpuDevice
from shardwise.planner.devices.cpu.fits import Fit
from shardwise.planner.stage_cost import StageCoster
from shardwise.planner.workload import Workload
from tests.planner_helpers import cpu_costs


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
    costs = cpu_costs()
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

    from shardwise.planner.calibrate.blocks import compose_factors, priced_block_seconds

    coll = {2: [(k, b, 1e-4 + b / 1e9) for k in ("all_reduce", "all_gather")
                for b in (4096, 1 << 20)]}
    meas = LocalMeasurements([(1e6, 1e-5), (1e8, 1e-3), (1e9, 1e-2)], 1e10, coll, 2,
                             2.0 ** 34, 2, cpu_costs())
    plain = get_hardware("local", calibration=write_calibration(meas, tmp_path / "a.toml"))
    priced = [priced_block_seconds(plain, d, h, kv) for d, h, kv in ((384, 6, 3), (640, 10, 5))]
    assert priced[1] > priced[0] > 0
    blocks = ((384, 6, 3, 1.2 * priced[0], 1.1 * priced[0]),
              (640, 10, 5, 1.5 * priced[1], 0.9 * priced[1]))
    meas.cpu = replace(meas.cpu, blocks=blocks)
    hw = get_hardware("local", calibration=write_calibration(meas, tmp_path / "b.toml"))
    assert hw.cpu.compose == pytest.approx((1.2 * 1.5) ** 0.5, rel=1e-3)
    assert hw.cpu.compose_kernels == 0.0  # two blocks of like kernel shares: one factor
    assert hw.cpu.kernel_compose == hw.cpu.compose
    # [Note: undisturbed steps]: the fastest calls give their own factor
    assert hw.cpu.compose_best == pytest.approx((1.1 * 0.9) ** 0.5, rel=1e-3)
    assert hw.cpu.undisturbed().compose == hw.cpu.compose_best
    assert hw.cpu.undisturbed().kernels == hw.cpu.kernels
    for got, want in zip(hw.cpu.blocks, blocks, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert compose_factors(plain, ()) == (1.0, 0.0)
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


def test_collective_cpu_fraction_round_trips_and_is_checked():
    """The collectives' measured CPU fraction per group size is written and read back, read
    from the nearest group size, 0 when not measured, and a value outside [0, 1] is
    refused by name."""
    import dataclasses

    costs = dataclasses.replace(cpu_costs(), comm_cpu={2: 0.5, 4: 0.25})
    table = tomllib.loads("\n".join(costs.toml_lines("x")))["x"]["cpu"]
    again = CpuCosts.from_table(table)
    assert again.comm_cpu == pytest.approx({2: 0.5, 4: 0.25})
    assert [again.comm_cpu_fraction(w) for w in (1, 2, 3, 4, 8)] == pytest.approx(
        [0.0, 0.5, 0.25, 0.25, 0.25])
    assert cpu_costs().comm_cpu_fraction(2) == 0.0
    with pytest.raises(ValueError, match=r"comm_cpu\.2 = 1.5"):
        CpuCosts.from_table({**table, "comm_cpu": {"2": 1.5}})


def test_gloo_micro_benchmark_runs_every_collective_on_real_ranks():
    """``--calibrate``'s collective rows come from live Gloo ranks through the engine's own
    calls (all four kinds, both payloads, a positive time each, the CPU time beside it) and
    fit per group size."""
    from shardwise.planner.calibrate.gloo import cpu_fractions, measure_gloo

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
    from shardwise.planner.calibrate.blocks import BLOCKS, measure_blocks

    threads = torch.get_num_threads()
    rows = measure_blocks(seconds=0.01)
    assert torch.get_num_threads() == threads  # restored
    assert [r[:3] for r in rows] == [tuple(b) for b in BLOCKS]
    assert all(r[3] >= r[4] > 0 for r in rows)  # the median call, then the fastest
    assert rows[1][3] > rows[0][3]  # the wider block takes longer


def test_contention_ratios_run_the_block_on_every_core():
    """Both slowdowns come back per process count, never below 1 (the lone process's
    median and fastest calls are the references), and a lone process asks for nothing."""
    from shardwise.planner.calibrate.kernels import contention_ratios, measure_contention

    median, fastest = contention_ratios([1, 2], seconds=0.05)
    assert set(median) == set(fastest) == {2}
    assert median[2] >= 1.0 and fastest[2] >= 1.0
    assert contention_ratios([1]) == ({}, {}) and measure_contention([1]) == {}


def test_median_blocks_takes_each_blocks_median_over_passes():
    """The composed blocks are timed in three passes across the calibration; one fast (or
    slow) pass does not decide a block's seconds."""
    from shardwise.planner.calibrate.blocks import median_blocks

    passes = [((384, 6, 3, 0.09, 0.08), (640, 10, 5, 0.187, 0.180)),
              ((384, 6, 3, 0.10, 0.07), (640, 10, 5, 0.240, 0.175)),
              ((384, 6, 3, 0.30, 0.09), (640, 10, 5, 0.232, 0.172))]
    # the median of the medians, the fastest call of any pass
    assert median_blocks(passes) == ((384, 6, 3, 0.10, 0.07), (640, 10, 5, 0.232, 0.172))
    assert median_blocks([((384, 6, 3, 0.09),), ((384, 6, 3, 0.12),), ((384, 6, 3, 0.1),)]) \
        == ((384, 6, 3, 0.1, 0.09),)  # four columns: the medians stand in


def test_calibration_measures_the_crowd_only_beyond_the_cores(monkeypatch):
    """measure_cpu times each smaller group of a world beyond the cores, all groups at
    once, at both gaps (the kernels and blocks faked: only the collectives' wiring is
    under test)."""
    from shardwise.planner.calibrate import kernels as cpu_bench

    launched = []

    def fake_gloo(world, sizes, calls=21, timeout_s=300.0, group=None, multiplies=3):
        launched.append((world, group, multiplies))
        slow = 1.0 + (group is not None) * multiplies
        return [(k, b, slow * (1e-3 + b * 1e-9), 0.5e-3) for b in sizes
                for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")]

    monkeypatch.setattr(cpu_bench, "measure_gloo", fake_gloo)
    monkeypatch.setattr(cpu_bench, "gap_seconds", lambda mult: mult * 1.5e-3)
    monkeypatch.setattr(cpu_bench, "measure_blocks", lambda seconds: ((384, 6, 3, 0.1, 0.09),))
    monkeypatch.setattr(cpu_bench, "measure_tp_blocks", lambda seconds: ((384, 6, 2, 0.1, 0.09),))
    monkeypatch.setattr(cpu_bench, "measure_kernels", lambda quick: cpu_costs().kernels)
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
    from shardwise.planner.calibrate.gloo import measure_gloo

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


# ------------------------------------------------------- two factors, tensor-parallel pairs
def _plain(tmp_path, name: str = "plain.toml", **cpu):
    """A calibration of synthetic fits (every kernel alike), with ``cpu`` fields set, and
    the device it gives."""
    from dataclasses import replace

    coll = {2: [(k, b, 1e-4 + b / 1e9) for k in ("all_reduce", "all_gather")
                for b in (4096, 1 << 20)]}
    meas = LocalMeasurements([(1e6, 1e-5), (1e8, 1e-3), (1e9, 1e-2)], 1e10, coll, 2,
                             2.0 ** 34, 2, replace(cpu_costs(), **cpu))
    return meas, get_hardware("local", calibration=write_calibration(meas, tmp_path / name))


def test_two_composition_factors_come_from_blocks_of_different_kernel_shares(tmp_path):
    """[Note: two composition factors]: blocks whose ratios of kernels to multiplies differ
    tell the multiplies' factor from the kernels'; the layers are priced with each on its
    own part; blocks that cannot tell them apart, or a fit outside 0.5-4 times, give one
    factor."""
    from shardwise.planner.calibrate.blocks import BLOCKS, compose_factors, priced_block_parts

    _, plain = _plain(tmp_path)
    parts = [priced_block_parts(plain, *b) for b in BLOCKS]
    mix = [k / m for m, k in parts]
    assert max(mix) > 2 * min(mix)  # the calibration's blocks can tell them apart
    blocks = tuple((*b, 1.05 * m + 1.3 * k, 0.95 * m + 1.1 * k)
                   for b, (m, k) in zip(BLOCKS, parts, strict=True))
    _, hw = _plain(tmp_path, "b.toml", blocks=blocks)
    c = hw.cpu
    assert (c.compose, c.compose_kernels) == pytest.approx((1.05, 1.3), rel=1e-3)
    assert (c.compose_best, c.compose_kernels_best) == pytest.approx((0.95, 1.1), rel=1e-3)
    quiet = c.undisturbed()
    assert (quiet.compose, quiet.kernel_compose) == pytest.approx((0.95, 1.1), rel=1e-3)

    wl = Workload(seq_len=128, global_batch=4, compute_dtype="fp32")
    coster = StageCoster(get_model_spec("debug"), CpuDevice(hw), wl)
    gemm, kf, kb = coster.device.layer_parts(coster.spec, wl, 1, False, 4)
    t = coster.layer(False, 1, 1, False, 1, 4, "none")
    assert (t.fwd, t.bwd, t.wgrad) == pytest.approx(
        (1.05 * gemm + 1.3 * kf, 2.1 * gemm + 1.3 * kb, 1.05 * gemm), rel=1e-6)
    # selective recomputation replays the kernels, at their factor
    sel = coster.layer(False, 1, 1, False, 1, 4, "selective")
    assert sel.recompute == pytest.approx(1.3 * kf, rel=1e-6)

    # the same shape twice: no spread of ratios, one factor (the geometric mean)
    twice = (blocks[1], blocks[1])
    ratio = blocks[1][3] / sum(parts[1])
    assert compose_factors(plain, twice) == pytest.approx((ratio, 0.0))
    # kernels at 10x the multiplies' factor: not believed, one factor
    wild = tuple((*b, m + 10 * k, m + 10 * k) for b, (m, k) in zip(BLOCKS, parts, strict=True))
    one, kernels = compose_factors(plain, wild)
    assert kernels == 0.0 and one > 1.0
    for key in ("compose_kernels", "compose_kernels_best"):
        with pytest.raises(ValueError, match=f"{key} = 9"):
            CpuCosts.from_table({key: 9})


def test_collective_overhead_is_what_the_pairs_take_beyond_their_price(tmp_path):
    """[Note: tensor-parallel pairs]: the 2-rank blocks' seconds beyond their price, per
    tensor-parallel collective (10 a layer), median and fastest calls apart; never below
    0; written, read back and checked by value."""
    from shardwise.planner.calibrate.blocks import TP_BLOCKS, priced_tp_block_seconds

    _, hw = _plain(tmp_path)
    priced = [priced_tp_block_seconds(hw, *b) for b in TP_BLOCKS]
    quiet = [priced_tp_block_seconds(hw.replace(cpu=hw.cpu.undisturbed()), *b)
             for b in TP_BLOCKS]
    pairs = tuple((*b, p + 10 * 2e-3, q + 10 * 0.5e-3)
                  for b, p, q in zip(TP_BLOCKS, priced, quiet, strict=True))
    _, got = _plain(tmp_path, "tp.toml", tp_blocks=pairs)
    assert got.cpu.collective_overhead == pytest.approx(2e-3, rel=1e-4)
    assert got.cpu.collective_overhead_best == pytest.approx(0.5e-3, rel=1e-4)
    assert got.cpu.undisturbed().collective_overhead == pytest.approx(0.5e-3, rel=1e-4)
    for row, want in zip(got.cpu.tp_blocks, pairs, strict=True):
        assert row == pytest.approx(want, rel=1e-5)
    fast = tuple((*b, 0.5 * p, 0.5 * p) for b, p in zip(TP_BLOCKS, priced, strict=True))
    _, none = _plain(tmp_path, "fast.toml", tp_blocks=fast)
    assert (none.cpu.collective_overhead, none.cpu.collective_overhead_best) == (0.0, 0.0)
    assert none.cpu.undisturbed().collective_overhead == 0.0  # a measured 0 is not "not measured"
    old = CpuCosts.from_table({"collective_overhead": 1e-3})
    assert (old.collective_overhead_best, old.undisturbed().collective_overhead) == (None, 1e-3)
    with pytest.raises(ValueError, match="collective_overhead = 2.0"):
        CpuCosts.from_table({"collective_overhead": 2})
    with pytest.raises(ValueError, match="tp_blocks"):
        CpuCosts.from_table({"tp_blocks": [[384, 6]]})


def test_repredict_recomputes_the_factors_from_the_stored_blocks(tmp_path):
    """planner_bench --report-only --repredict prices a run with this planner's factors,
    computed again from the blocks its calibration stored: a calibration written by an
    earlier planner (here: its overhead under an older name, so not read) gets the
    factors ``--calibrate`` writes now."""
    import dataclasses

    from bench.planner_bench import _recomposed
    from shardwise.planner.calibrate.blocks import BLOCKS, TP_BLOCKS, priced_block_parts
    from shardwise.planner.calibrate.blocks import priced_tp_block_seconds

    _, plain = _plain(tmp_path)
    parts = [priced_block_parts(plain, *b) for b in BLOCKS]
    blocks = tuple((*b, 1.05 * m + 1.3 * k, 0.95 * m + 1.1 * k)
                   for b, (m, k) in zip(BLOCKS, parts, strict=True))
    _, with_blocks = _plain(tmp_path, "b.toml", blocks=blocks)
    pairs = tuple((*b, priced_tp_block_seconds(with_blocks, *b) + 10 * 2e-3,
                   priced_tp_block_seconds(with_blocks, *b) + 10 * 1e-3) for b in TP_BLOCKS)
    _, now = _plain(tmp_path, "now.toml", blocks=blocks, tp_blocks=pairs)
    old = now.replace(cpu=dataclasses.replace(now.cpu, compose=1.0, compose_kernels=0.0,
                                              collective_overhead=0.0,
                                              collective_overhead_best=None))
    got = _recomposed(old).cpu
    for key in ("compose", "compose_best", "compose_kernels", "compose_kernels_best",
                "collective_overhead", "collective_overhead_best"):
        assert getattr(got, key) == pytest.approx(getattr(now.cpu, key), rel=1e-3), key
    assert got.collective_overhead == pytest.approx(2e-3, rel=1e-2)
    assert _recomposed(plain) is plain  # no blocks stored: nothing to compute again


def test_measure_tp_blocks_runs_sequence_parallel_pairs_on_two_ranks():
    """The tensor-parallel blocks run for real: apply_tp's sequence-parallel block on 2
    Gloo ranks, forward and backward, (dim, heads, kv_heads, median, fastest) rows."""
    from shardwise.planner.calibrate.blocks import TP_BLOCKS, measure_tp_blocks

    rows = measure_tp_blocks(seconds=0.01)
    assert [r[:3] for r in rows] == [tuple(b) for b in TP_BLOCKS]
    assert all(r[3] >= r[4] > 0 for r in rows)
    assert rows[1][4] > rows[0][4]  # the wider block takes longer


def test_calibration_times_tp_pairs_only_when_ranks_keep_a_core(monkeypatch):
    """measure_cpu times the tensor-parallel pairs in each of its three block passes (the
    median of the passes kept) when there are 2 cores for them, and not on one core."""
    from shardwise.planner.calibrate import kernels as cpu_bench

    passes = iter([0.3, 0.1, 0.2])
    calls = []

    def fake_tp(seconds):
        calls.append(seconds)
        t = next(passes)
        return ((384, 6, 2, t, t / 2),)

    monkeypatch.setattr(cpu_bench, "measure_tp_blocks", fake_tp)
    monkeypatch.setattr(cpu_bench, "measure_gloo", lambda world, sizes, calls=21, **kw: [
        (k, b, 1e-3 + b * 1e-9, 0.5e-3) for b in sizes
        for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")])
    monkeypatch.setattr(cpu_bench, "measure_blocks", lambda seconds: ((384, 6, 3, 0.1, 0.09),))
    monkeypatch.setattr(cpu_bench, "measure_kernels", lambda quick: cpu_costs().kernels)
    monkeypatch.setattr(cpu_bench, "measure_optimizer", lambda quick: Fit(1e-5, 1e-9))
    monkeypatch.setattr(cpu_bench, "contention_ratios", lambda counts, seconds: ({}, {}))
    two = cpu_bench.measure_cpu(2, quick=True, cores=2)
    assert len(calls) == 3 and two.tp_blocks == ((384, 6, 2, 0.2, 0.05),)
    calls.clear()
    assert cpu_bench.measure_cpu(2, quick=True, cores=1).tp_blocks == () and not calls
