"""A pipeline on CPU cores that slow each other only while they compute at once ([Note:
contention follows the schedule] in shardwise/planner/devices/cpu/pipeline.py): the replay against
hand-worked processor sharing, and the cost model pricing a 2-rank pipeline with it."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.planner.devices.cpu.pipeline import contended_pipeline
from shardwise.planner.pipeline import stage_costs
from tests.planner_helpers import estimate_debug, local_cpu

# two stages of one forward-length f = 1, backward b = 2 (no split backward)
_STAGES = stage_costs("1f1b", 2, 1, [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)])


def test_one_slowdown_for_every_count_scales_the_whole_step():
    """Every rank equally slow whatever runs beside it: the schedule keeps its shape and
    every time scales (the data-parallel case)."""
    alone = contended_pipeline("1f1b", 2, 1, 4, _STAGES, (1.0, 1.0))
    slow = contended_pipeline("1f1b", 2, 1, 4, _STAGES, (1.3, 1.3))
    assert alone.step == pytest.approx(3 * 5)  # (m + p - 1)(f + b)
    assert slow.step == pytest.approx(1.3 * alone.step, rel=1e-5)
    assert slow.busy == pytest.approx([1.3 * x for x in alone.alone], rel=1e-5)
    assert slow.alone == alone.alone == (12.0, 12.0)


def test_stages_that_never_compute_at_once_are_not_slowed():
    """One micro-batch through two stages: forward 0, forward 1, backward 1, backward 0,
    one rank at a time, so a slowdown for two ranks at once never applies."""
    run = contended_pipeline("1f1b", 2, 1, 1, _STAGES, (1.0, 1.5))
    assert run.step == pytest.approx(6.0)
    assert run.busy == run.alone == (3.0, 3.0)


@pytest.mark.parametrize("s", [1.2, 1.39, 2.0])
def test_two_micro_batches_match_hand_worked_processor_sharing(s):
    """1F1B, p = 2, m = 2, f = 1, b = 2, each of two ranks computing at once at 1/s of its
    lone speed. Worked by hand: rank 0's F1 and rank 1's F0 overlap (s), rank 1's B0 runs
    alone (2), rank 0's B0 overlaps rank 1's F1 and the first half of its B1 (2s), rank 1
    finishes B1 alone (1), rank 0's B1 alone (2): 1 + s + 2 + 2s + 1 + 2 = 6 + 3s, where
    slowing the whole step gives 9s."""
    run = contended_pipeline("1f1b", 2, 1, 2, _STAGES, (1.0, s))
    assert run.step == pytest.approx(6 + 3 * s, rel=1e-9)
    assert run.busy == pytest.approx((1 + s + 2 * s + 2, s + 2 + s + (s + 1)), rel=1e-9)
    assert 9.0 < run.step < 9 * s


def test_a_slowdown_below_one_is_refused_by_value():
    with pytest.raises(ValueError, match=r"slowdown=\(1.0, 0.9\).*>= 1"):
        contended_pipeline("1f1b", 2, 1, 2, _STAGES, (1.0, 0.9))


def test_cost_model_slows_a_two_rank_pipeline_only_where_both_ranks_compute():
    """pp 2 on 2 cores with both cores computing 1.4x slower: the pipeline's compute is
    stretched by less than 1.4 (its ranks overlap for part of the step) and more than 1,
    while 2 data-parallel ranks are stretched by 1.4 exactly; pp 2 x dp 2 on 2 cores keeps
    the time-shared price (every core is always computing)."""
    base = local_cpu(2)
    hw = base.replace(cpu=dataclasses.replace(base.cpu, busy={2: 1.4}))
    pipe = dict(pp=2, zero=2, pp_microbatches=2, pp_schedule="1f1b", pp_virtual=1)
    slow, alone = estimate_debug(hw, **pipe), estimate_debug(base, **pipe)
    stretch = slow.breakdown["compute"] / alone.breakdown["compute"]
    assert 1.05 < stretch < 1.35
    assert alone.step_time < slow.step_time < 1.4 * alone.step_time
    # the bubble is where one rank computes alone: no longer than it was unslowed x 1.4
    assert slow.breakdown["pp_bubble"] <= 1.4 * alone.breakdown["pp_bubble"] + 1e-9
    dp_slow = estimate_debug(hw, dp_shard=2, zero=2)
    dp_alone = estimate_debug(base, dp_shard=2, zero=2)
    assert dp_slow.breakdown["compute"] == pytest.approx(1.4 * dp_alone.breakdown["compute"])
    wide = dict(pipe, dp_shard=2, zero=3)
    wide_slow, wide_alone = estimate_debug(hw, **wide), estimate_debug(base, **wide)
    assert wide_slow.breakdown["pp_bubble"] == pytest.approx(
        1.4 * wide_alone.breakdown["pp_bubble"])
