"""The learning-rate schedule's horizon: saved with the schedule, kept or extended on resume."""

from __future__ import annotations

import pytest
import torch

from shardwise.train.config import load_config
from shardwise.train.lr_schedule import (WarmupCosine, apply_schedule_horizon, build_lr_schedule,
                                      lr_factor)

PEAK = 3e-3


def _schedule(total: int, steps_done: int = 0):
    """A trainer-like schedule (two param groups) stepped ``steps_done`` times."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=PEAK)
    sched = build_lr_schedule(opt, load_config(None, {}).optim, total)
    for _ in range(steps_done):
        opt.step()
        sched.step()
    return sched


def _resumed(saved_total: int, new_total: int, done: int):
    """A schedule built for ``new_total`` that loads the state of one saved at ``done``."""
    old = _schedule(saved_total, done)
    new = _schedule(new_total)
    new.optimizer.load_state_dict(old.optimizer.state_dict())
    new.load_state_dict(old.state_dict())
    return new


def _lr_of_step(step: int, total: int) -> float:
    """The trainer's lr at 1-based step ``step`` of a run planned for ``total`` steps."""
    return PEAK * lr_factor(step - 1, 10, total, 0.1)


def test_the_horizon_is_part_of_the_saved_state():
    state = _schedule(20, 5).state_dict()
    assert all(fn == {"warmup_steps": 10, "total_steps": 20, "min_ratio": 0.1}
               for fn in state["lr_lambdas"])
    assert isinstance(_resumed(20, 40, 5).lr_lambdas[0], WarmupCosine)
    assert _resumed(20, 40, 5).lr_lambdas[0].total_steps == 20  # restored by load_state_dict


def test_keep_continues_the_original_schedule_and_says_so():
    sched = _resumed(20, 40, 20)
    note = apply_schedule_horizon(sched, "keep", 40, 20)
    assert note == ("the checkpoint's learning-rate schedule spans 20 steps, this run's "
                    "train.steps 40: step 20 had lr 0.0003; optim.schedule_horizon 'keep' "
                    "continues the original schedule (step 21: lr 0.0003); 'extend' would "
                    "re-plan it over 40 steps (step 21: lr 0.00228)")
    for step in range(21, 25):  # the floor of the original schedule, no jump
        assert sched.optimizer.param_groups[1]["lr"] == pytest.approx(_lr_of_step(step, 20))
        sched.optimizer.step()
        sched.step()


def test_extend_replans_over_the_new_steps():
    sched = _resumed(20, 40, 20)
    note = apply_schedule_horizon(sched, "extend", 40, 20)
    assert "'extend' re-plans it over 40 steps (step 21: lr 0.00228; 'keep' would give 0.0003)" \
        in note
    assert sched.get_last_lr() == pytest.approx([_lr_of_step(21, 40)] * 2)
    for step in range(21, 25):
        for group in sched.optimizer.param_groups:
            assert group["lr"] == pytest.approx(_lr_of_step(step, 40))
        sched.optimizer.step()
        sched.step()


def test_nothing_to_say_for_a_fresh_run_or_the_same_horizon():
    assert apply_schedule_horizon(_schedule(40), "keep", 40, 0) is None
    assert apply_schedule_horizon(_resumed(40, 40, 7), "extend", 40, 7) is None
    # fewer steps than planned: said too (the cosine will not reach its floor)
    assert "spans 40 steps, this run's train.steps 10" in apply_schedule_horizon(
        _resumed(40, 10, 5), "keep", 10, 5)


def test_the_policy_is_a_config_key():
    assert load_config(None, {}).optim.schedule_horizon == "keep"
    assert load_config(None, {"optim.schedule_horizon": "extend"}).optim.schedule_horizon \
        == "extend"
    with pytest.raises(ValueError, match="optim.schedule_horizon must be 'keep' or 'extend', "
                                         "got 'stretch'"):
        load_config(None, {"optim.schedule_horizon": "stretch"})
