"""The learning-rate schedule: linear warmup, then a cosine down to a floor, and what a
resumed run does when its ``train.steps`` differs from the checkpoint's.

The schedule's horizon (the step count the cosine spans) is part of its state: the
multiplier is a :class:`WarmupCosine` object, whose attributes ``LambdaLR.state_dict()``
saves and ``load_state_dict()`` restores, so a checkpoint remembers the schedule it was
trained with. On resume, ``optim.schedule_horizon`` decides:

* ``"keep"`` (default): the original schedule continues; steps past its horizon stay at the
  floor. A resumed run is bitwise the uninterrupted one for the steps they share.
* ``"extend"``: warmup + cosine are re-planned over the new ``train.steps``; the learning
  rate moves from the old curve to the new one at the resumed step.

Either way the run says so at start, with both horizons and the learning rates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["lr_factor", "WarmupCosine", "build_lr_schedule", "apply_schedule_horizon"]


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier for 0-based ``step``: linear warmup, then cosine to a floor.

    Step 0 already gets ``1 / warmup_steps`` (a zero first step would waste a step); the last
    step (``total_steps - 1``) and every later one get ``min_ratio``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """:func:`lr_factor` as a ``LambdaLR`` multiplier whose settings are checkpointed.

    Args:
        warmup_steps: steps of linear warmup.
        total_steps: the horizon: the cosine reaches ``min_ratio`` at step ``total_steps``.
        min_ratio: the floor, as a fraction of the peak learning rate.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup_steps, self.total_steps, self.min_ratio)


def build_lr_schedule(optimizer: torch.optim.Optimizer, optim: Any,
                      total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine schedule (:func:`lr_factor`) over ``total_steps``, stepped once per
    optimizer step; ``optim`` is the ``[optim]`` section."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(optim.warmup_steps, total_steps, optim.min_lr_ratio))


def _lr(schedule: torch.optim.lr_scheduler.LambdaLR, step: int) -> float:
    """The first group's learning rate of 1-based training step ``step``."""
    return schedule.base_lrs[0] * schedule.lr_lambdas[0](step - 1)


def apply_schedule_horizon(schedule: torch.optim.lr_scheduler.LambdaLR, policy: str,
                           total_steps: int, done: int) -> str | None:
    """After resuming at step ``done``: keep the checkpoint's horizon or extend it.

    Args:
        schedule: the run's schedule, its state loaded from the checkpoint.
        policy: ``"keep"`` or ``"extend"`` (``optim.schedule_horizon``).
        total_steps: this run's ``train.steps``.
        done: the step the checkpoint was saved at (0: a fresh start, nothing to do).

    Returns:
        The line that says what happened, or None when the horizons agree (or a checkpoint
        from before horizons were saved left nothing to compare).

    Raises:
        ValueError: an unknown ``policy``.
    """
    if policy not in ("keep", "extend"):
        raise ValueError(f"optim.schedule_horizon must be 'keep' or 'extend', got {policy!r}")
    fns = [fn for fn in schedule.lr_lambdas if isinstance(fn, WarmupCosine)]
    old = fns[0].total_steps if fns else total_steps
    if done == 0 or old == total_steps:
        return None
    before, kept = _lr(schedule, done), _lr(schedule, done + 1)
    extended = WarmupCosine(fns[0].warmup_steps, total_steps, fns[0].min_ratio)(done)
    extended *= schedule.base_lrs[0]
    head = (f"the checkpoint's learning-rate schedule spans {old} steps, this run's "
            f"train.steps {total_steps}: step {done} had lr {before:.3g}; ")
    if policy == "keep":
        return head + (f"optim.schedule_horizon 'keep' continues the original schedule (step "
                       f"{done + 1}: lr {kept:.3g}); 'extend' would re-plan it over "
                       f"{total_steps} steps (step {done + 1}: lr {extended:.3g})")
    for fn in fns:
        fn.total_steps = total_steps
    # The optimizer's lr was set by the checkpointed schedule for the old horizon.
    lrs = [base * fn(schedule.last_epoch)
           for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas, strict=True)]
    for group, lr in zip(schedule.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    schedule._last_lr = lrs  # what get_last_lr() reports, as LambdaLR.step() would set it
    return head + (f"optim.schedule_horizon 'extend' re-plans it over {total_steps} steps "
                   f"(step {done + 1}: lr {extended:.3g}; 'keep' would give {kept:.3g})")
