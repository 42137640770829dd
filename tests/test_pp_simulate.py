"""The pipeline simulator against published closed forms, in exact rational arithmetic.

Cost assumptions of every closed-form check (unless a test says otherwise): every stage costs
F = 1 and B = 2 per micro-batch (split backward: I = W = 1), messages are free, and the bubble
is idle rank-time / (p x step time). p = pipeline ranks, m = micro-batches, v = stages per rank.

Sources of the formulas (each test cites its own):
- GPipe / 1F1B: (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al. 2021).
- Interleaved 1F1B: (p-1)/(v m+p-1) (Narayanan et al. 2021, Megatron-LM), m >= p.
- ZB-H1 and ZB-V: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
  (arXiv 2401.10241): Table 2, ZB-H1 bubble (p-1)(T_F + T_B - T_W) with T_B the input-gradient
  pass and peak activation memory p M_B; Section 6, ZB-V has zero bubble (every rank busy from
  its first action to its last) when T_F = T_B = T_W, with peak p M_B.
- DualPipeV: DeepSeek's DualPipe README (github.com/deepseek-ai/DualPipe), table "Pipeline
  Bubbles and Memory Usage Comparison": DualPipeV bubble (PP/2-1)(F&B + B - 3W) with PP = 2p
  stages, B a full backward, F&B a forward and a backward chunk issued together, activation
  PP+1 chunks per device.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.parallel import (SCHEDULE_NAMES, Action, Costs, DeadlockError, Kind, Schedule,
                                build_schedule, critical_path, draw_timeline, format_timeline,
                                simulate)
from shardwise.parallel.pipeline.replay import replay_shared
from shardwise.parallel.pipeline.schedules import schedule_spec

UNIT = Costs(f=1, b=2, i=1, w=1, comm=0)
PS = (1, 2, 3, 4, 5)


def sim(name, p, m, v=0, costs=UNIT):
    return simulate(build_schedule(name, p, m, v), costs)


# ---- published closed forms -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble(name):
    for p, m in itertools.product(PS, range(1, 10)):
        s = sim(name, p, m)
        assert s.bubble == Fraction(p - 1, m + p - 1), (p, m)
        assert s.step_time == 3 * (m + p - 1)
        assert s.idle == (3 * (p - 1),) * p  # (p-1)(F+B) on every rank


@pytest.mark.parametrize("name,virtuals", [("interleaved_1f1b", (2, 3, 4)),
                                           ("looped_bfs", (1, 2, 3))])
def test_interleaved_and_looped_bubble(name, virtuals):
    """(p-1)/(v m+p-1) for every m >= p (Megatron states it for p | m; it holds beyond)."""
    for p, v in itertools.product(PS, virtuals):
        for m in range(p, 2 * p + 2):
            assert sim(name, p, m, v).bubble == Fraction(p - 1, v * m + p - 1), (p, m, v)


def test_zb_h1_matches_qi_et_al_table_2():
    """ZB-H1, T_F = T_B(=I) = T_W = 1: bubble (p-1)(T_F + T_B - T_W) = p-1 per rank, m >= p.

    The paper's bubble is the idle time inside a rank's own span; rank 0 starts first and ends
    last, so it equals rank 0's idle in the step and the step is 3m + p-1.
    """
    t_f = t_b = t_w = 1
    for p in PS:
        for m in range(p, 3 * p + 3):
            s = sim("zb1", p, m)
            assert s.span_bubble[0] == (p - 1) * (t_f + t_b - t_w), (p, m)
            assert s.step_time == 3 * m + (p - 1)
            assert s.bubble == Fraction(p - 1, 3 * m + p - 1)
            assert s.peak_activations == (p,) * p            # p M_B, the same as 1F1B's rank 0
            assert s.peak_activations_until_i == tuple(p - r for r in range(p))


def test_zb_h1_is_a_third_of_1f1b_bubble_time():
    """Qi et al.: with T_F = T_B = T_W, ZB-H1's bubble is one third of 1F1B's (same split costs)."""
    for p, m in itertools.product((2, 3, 4, 5), (8, 12)):
        ours = sim("zb1", p, m).span_bubble[0]
        one_f_one_b = sim("1f1b", p, m).span_bubble[0]  # B = I + W = 2
        assert 3 * ours == one_f_one_b


def test_zb_h1_formula_is_scale_free():
    third = Fraction(1, 3)
    for p, m in ((3, 5), (4, 9)):
        s = sim("zb1", p, m, costs=Costs(f=third, b=2 * third, i=third, w=third))
        assert s.span_bubble[0] == (p - 1) * third
        assert s.bubble == Fraction(p - 1, 3 * m + p - 1)


def test_zb_v_has_zero_bubble_in_qi_et_al_sense():
    """ZB-V, T_F = T_B = T_W (per half-stage chunk): every rank busy from first to last action.

    Holds once the warm-up can fill the V: m >= 2p-1. Ranks start p-1 apart, so in our measure
    each rank idles p-1 of a step 6m + p-1 and the bubble is (p-1)/(6m+p-1). Peak activations:
    2p chunk micro-batches = p M_B (a chunk is half a stage), the same as 1F1B.
    """
    for p in PS:
        for m in range(2 * p - 1, 3 * p + 1):
            s = sim("zbv", p, m)
            assert s.span_bubble == (0,) * p, (p, m)
            assert s.step_time == 6 * m + p - 1
            assert s.bubble == Fraction(p - 1, 6 * m + p - 1)
            assert s.peak_activations == (2 * p,) * p


def test_dualpipev_matches_the_dualpipe_readme():
    """DualPipeV: (PP/2-1)(F&B + B - 3W) idle per rank, PP = 2p stages, m >= 2p.

    Assumptions: F = W = 1, B = 2 (full backward), free messages, and F&B = F + B because our
    executor runs the paired forward and backward one after the other (DualPipe overlaps the
    pair's communication, not their computation). Activation per device: PP+1 chunks.
    """
    f, b, w = 1, 2, 1
    for p in PS:
        for m in range(2 * p, 3 * p + 1):
            s = sim("dualpipev", p, m)
            expected_idle = (2 * p // 2 - 1) * ((f + b) + b - 3 * w)
            assert s.idle == (expected_idle,) * p, (p, m)
            assert s.step_time == 6 * m + expected_idle
            assert s.bubble == Fraction(p - 1, 3 * m + p - 1)
            assert s.peak_activations == (2 * p + 1,) * p


def test_reference_formulas_agree_with_the_simulator():
    for name, p in itertools.product(SCHEDULE_NAMES, (2, 3)):
        for m in (1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p):
            if name == "dualpipev" and m < 2 * p:
                continue
            known = schedule_spec(name).reference_bubble(p, m, build_schedule(name, p, m).virtual)
            if known is not None:
                assert sim(name, p, m).bubble == known[1], (name, p, m, known[0])


REGISTERED = [(name, v) for name in SCHEDULE_NAMES
              for v in sorted({schedule_spec(name).default_virtual, schedule_spec(name).max_virtual
                               or 4})]


@pytest.mark.parametrize("name,v", REGISTERED)
@pytest.mark.parametrize("pp", [2, 4])
def test_registered_closed_forms_equal_the_simulator(name, v, pp):
    """Every schedule's closed forms in the registry are the simulator's results for equal
    stage costs ([Note: pipeline closed forms]: exact for the looped schedules and ZB-H1,
    within 10% for the V-shaped ones), and its placement is the one build_schedule uses."""
    f, b, w, m = 1.0, 2.4, 1.1, 2 * pp
    spec, sched = schedule_spec(name), build_schedule(name, pp, m, v)
    assert spec.placement(pp, v) == sched.placement
    run = simulate(sched, Costs(f=f / v, b=b / v, i=(b - w) / v, w=w / v))
    rel = 0.10 if spec.v_shape else 1e-9
    assert spec.bubble_time(pp, v, m, f, b, w) == pytest.approx(
        float(run.step_time - max(run.busy)), rel=rel)
    peak = max(run.peak_activations) / v if name not in ("gpipe", "looped_bfs") else m
    assert spec.peak_inflight(pp, v, m) == pytest.approx(peak)


# ---- memory ---------------------------------------------------------------------------------
def test_peak_in_flight_activations_1f1b_vs_gpipe():
    for p in PS:
        for m in range(p, 2 * p + 3):
            assert sim("1f1b", p, m).peak_activations == tuple(p - r for r in range(p))
            assert sim("gpipe", p, m).peak_activations == (m,) * p


def test_peak_does_not_depend_on_costs():
    a = sim("interleaved_1f1b", 4, 8).peak_activations
    assert sim("interleaved_1f1b", 4, 8, costs=Costs(f=3, b=1, comm=2)).peak_activations == a


# ---- hand-computed timings -------------------------------------------------------------------
def test_message_latency_hand_computed():
    c = Fraction(1, 4)
    s = sim("1f1b", 2, 1, costs=Costs(f=1, b=2, comm=c))
    assert s.step_time == 6 + 2 * c  # F, message, F, B, message, B
    assert s.critical_path == 6 + 2 * c


def test_per_stage_costs_hand_computed():
    # GPipe, 2 stages, 2 micro-batches; stage 1 twice as slow: rank 1 runs F F B B from t=1.
    s = sim("gpipe", 2, 2, costs=Costs(f=[1, 2], b=[2, 4]))
    assert s.busy == (6, 12) and s.step_time == 15 and s.bubble == Fraction(12, 30)


def test_text_grid_hand_computed():
    assert format_timeline(sim("1f1b", 2, 2)) == ("rank 0 | F0 F1 .. .. B0 -- .. B1 --\n"
                                                  "rank 1 | .. F0 B0 -- F1 B1 -- .. ..")


def test_exact_and_float_arithmetic():
    exact = sim("zbv", 3, 6, costs=Costs(f=Fraction(1, 3), b=1, i=Fraction(1, 2), w=Fraction(1, 6)))
    assert isinstance(exact.bubble, Fraction) and isinstance(exact.step_time, Fraction)
    floats = sim("zbv", 3, 6, costs=Costs(f=0.5, b=1.0, i=0.5, w=0.5))
    assert isinstance(floats.bubble, float)
    assert floats.bubble == pytest.approx(float(sim("zbv", 3, 6).bubble))


@pytest.mark.parametrize("kwargs,match", [({"f": -1}, "Costs.f=-1"), ({"comm": [1]}, "comm"),
                                          ({"b": "2"}, "Costs.b")])
def test_costs_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Costs(**kwargs)


def test_per_stage_cost_list_too_short_is_named():
    with pytest.raises(ValueError, match="Costs.f lists 2 stages; action 2F0 needs stage 2"):
        sim("1f1b", 3, 3, costs=Costs(f=[1, 1]))


def test_simulating_a_deadlocked_schedule_names_the_ranks():
    s = Schedule("hand", 2, 1, 1, (0, 1), (
        (Action(0, Kind.F, 0), Action(0, Kind.RECV_B, 0), Action(0, Kind.B, 0),
         Action(0, Kind.SEND_F, 0)),
        (Action(1, Kind.RECV_F, 0), Action(1, Kind.F, 0), Action(1, Kind.B, 0),
         Action(1, Kind.SEND_B, 0))))
    with pytest.raises(DeadlockError, match="rank 0 waits at action #1 0RECV_B0"):
        simulate(s)
    with pytest.raises(DeadlockError, match="rank 0 waits at action #1 0RECV_B0"):
        replay_shared(s.ranks, s.placement, UNIT.of, (1.0,))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_shared_replay_without_slowdown_is_the_simulation(name):
    """Processor sharing with no slowdown is the simulator's replay with free messages: the
    same step, and each rank busy for its own compute."""
    s = build_schedule(name, 3, 6)
    run = simulate(s, Costs(f=1.0, b=2.5, i=1.25, w=1.25))
    step, busy = replay_shared(s.ranks, s.placement, run.costs.of, (1.0,))
    assert step == pytest.approx(float(run.step_time))
    assert busy == pytest.approx([float(b) for b in run.busy])


# ---- properties over grids -------------------------------------------------------------------
def _all_schedules():
    for name, p in itertools.product(SCHEDULE_NAMES, (1, 2, 3, 4)):
        for m in (1, p, 2 * p + 1):
            if name == "dualpipev" and m < 2 * p:
                continue
            for v in {"interleaved_1f1b": (2, 3), "looped_bfs": (1, 3)}.get(name, (0,)):
                yield build_schedule(name, p, m, v)


SCHEDULES = list(_all_schedules())
fractions = st.fractions(min_value=0, max_value=4, max_denominator=6)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(SCHEDULES), fractions, fractions, fractions, fractions, fractions)
def test_step_time_bounds_and_monotonicity(schedule, f, b, i, w, comm):
    costs = Costs(f=f, b=b, i=i, w=w, comm=comm)
    s = simulate(schedule, costs)
    assert s.step_time >= critical_path(schedule, costs)
    assert s.step_time >= max(s.busy)
    assert 0 <= s.bubble <= 1
    assert sum(s.busy) == sum(costs.of(a) for acts in schedule.ranks for a in acts
                              if a.is_compute)
    slower = simulate(schedule, Costs(f=f + 1, b=b, i=i, w=w, comm=comm + Fraction(1, 2)))
    assert slower.step_time >= s.step_time  # fixed order: no event moves earlier


@pytest.mark.parametrize("schedule", SCHEDULES[::4], ids=lambda s: f"{s.name}-{s.pp}-"
                         f"{s.microbatches}-{s.virtual}")
def test_timeline_respects_every_dependency(schedule):
    """Independent of replay's mechanics: every action starts after what it needs ended."""
    s = simulate(schedule, Costs(f=1, b=2, i=1, w=1, comm=Fraction(1, 3)))
    end = {}
    for row in s.timeline:
        for t in row:
            if t.action.is_compute:
                end[(t.action.kind, t.action.stage, t.action.microbatch)] = t.end
    backward = {(k[1], k[2]): v for k, v in end.items() if k[0] in (Kind.B, Kind.I)}
    last = schedule.num_stages - 1
    for row in s.timeline:
        prev_end = 0
        for t in row:
            if not t.action.is_compute:
                continue
            k, st_, mb = t.action.kind, t.action.stage, t.action.microbatch
            hop = (Fraction(1, 3) if st_ > 0 and k is Kind.F and
                   schedule.placement[st_ - 1] != schedule.placement[st_] else 0)
            assert t.start >= prev_end
            if k is Kind.F and st_ > 0:
                assert t.start >= end[(Kind.F, st_ - 1, mb)] + hop
            if k in (Kind.B, Kind.I):
                assert t.start >= end[(Kind.F, st_, mb)]
                if st_ < last:
                    assert t.start >= backward[(st_ + 1, mb)]
            if k is Kind.W:
                assert t.start >= end[(Kind.I, st_, mb)]
            prev_end = t.end


def test_draw_timeline_writes_a_png(tmp_path):
    out = draw_timeline(sim("zbv", 3, 6), tmp_path / "zbv.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
