"""The trainer's per-step failure handling, in one object the loop calls at fixed points.

    guard = StepGuard(cfg, env, model)
    for step in ...:
        guard.begin(step)                     # watchdog context; injected "start" faults
        loss = guard.on_loss(loss)            # injected nan / inf loss
        guard.after_backward(model)           # injected gradient faults
        if the agreed loss or gradient norm is not finite:
            skip = guard.before_update(model, loss, step, scaler.enabled)
        guard.before_optimizer()              # unless skipped; then clip + optimizer step
    guard.close()

The trainer reads every rank's loss and the global gradient norm once per step; only when one
of them is not finite (every rank sees the same numbers, so every rank enters) does
``before_update`` run the detailed check (:func:`shardwise.shard.nonfinite.find_nonfinite_grads`,
one small all-gather) with the ``train.nonfinite`` policy: "stop" raises
:class:`NonFiniteError` naming the step and the first offending parameter on every rank alike;
"skip" returns the same message and the trainer drops the update. Faults come from
``$SHARDWISE_FAULT`` (shardwise.train.faults).

[Note: naming low-bit layers] With a low-bit ``precision.matmul``, every cast of a converted
layer ors a device flag that its amax was not finite (no host sync). ``begin`` clears the
flags, so they describe the step; only on the non-finite path does ``before_update`` read them
(:func:`~shardwise.parallel.lowbit.nonfinite_amax_layers`: one host sync) and gather every
rank's list (one small object all-gather, on every rank alike since the agreed loss and norm
sent every rank there), and the message names the layer where the nan or inf entered first
on each rank that saw one. A steady step reads nothing. Blocks compiled with
``train.compile`` cast inside their graphs, which keep no flags: the message then says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.distributed import watchdog
from shardwise.distributed.comm.objects import all_gather_object
from shardwise.parallel.lowbit import lowbit_modules, nonfinite_amax_layers
from shardwise.train.faults import FaultPlan
from shardwise.shard.nonfinite import NonFiniteError, find_nonfinite_grads

__all__ = ["StepGuard"]


class StepGuard:
    """Failure handling around each training step (see the module docstring).

    Args:
        cfg: the run config (``train.nonfinite``, ``train.steps``).
        env: this rank's :class:`~shardwise.distributed.env.DistEnv`.
        model: the parallel model (fault hooks are installed on it).
    """

    def __init__(self, cfg: Any, env: Any, model: nn.Module) -> None:
        self.policy = cfg.train.nonfinite
        self.faults = FaultPlan.from_env(env.rank, cfg.train.steps)
        if self.faults is not None:
            self.faults.arm(model)
        self.watchdog = watchdog.active()
        self.skipped: list[int] = []
        # From the config, not the modules: a pipeline rank may hold no converted layer, and
        # every rank must take part in the gather ([Note: naming low-bit layers]).
        self.lowbit = cfg.precision.matmul != "bf16"
        self.compiled = bool(cfg.train.compile)
        self._lowbit_states = [s for _, _, s in lowbit_modules(model)]

    def begin(self, step: int) -> None:
        """The loop starts ``step``."""
        if self.watchdog is not None:
            self.watchdog.context["step"] = step
        for state in self._lowbit_states:  # the flags describe this step
            state.clear_flag()
        if self.faults is not None:
            self.faults.at_step(step)

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss, corrupted if a fault says so."""
        return self.faults.on_loss(loss) if self.faults is not None else loss

    def after_backward(self, model: nn.Module) -> None:
        """After backward, before the gradients are measured: injected gradient faults."""
        if self.faults is not None:
            self.faults.after_backward(model)

    def before_update(self, model: nn.Module, loss: float, step: int,
                      scaled: bool) -> str | None:
        """A loss or the gradient norm is not finite on some rank (collective: every rank
        calls it, as every rank saw the same numbers).

        Args:
            model: the model whose gradients are checked.
            loss: this rank's loss for the step.
            step: the step (for messages).
            scaled: fp16 loss scaling is on: its scaler skips overflowing steps itself.

        Returns:
            None to update as usual, or the reason the update is skipped.

        Raises:
            NonFiniteError: a nan / inf loss or gradient under the "stop" policy.
        """
        if scaled:
            return None
        report = find_nonfinite_grads(model, loss=loss)
        if report is None:
            return None
        message = report.message(step) + self._lowbit_note(model)
        if self.policy == "stop":
            raise NonFiniteError(f"{message}; try a lower optim.lr, or "
                                 "train.nonfinite = 'skip' to drop such steps")
        self.skipped.append(step)
        return message

    def _lowbit_note(self, model: nn.Module) -> str:
        """The low-bit layers that cast a non-finite amax this step, on every rank (collective
        with a low-bit recipe; ``""`` without one): [Note: naming low-bit layers]."""
        if not self.lowbit:
            return ""
        per_rank = all_gather_object(nonfinite_amax_layers(model), label="nonfinite.lowbit")
        seen = [(rank, names) for rank, names in enumerate(per_rank) if names]
        if not seen:
            why = " (compiled blocks keep no flags)" if self.compiled else ""
            return f"; no low-bit layer cast a non-finite amax{why}"
        parts = [f"rank {rank}: {_first_and_more(names)}" for rank, names in seen]
        return "; non-finite amax in low-bit layers (where it entered first): " + \
            "; ".join(parts)

    def before_optimizer(self) -> None:
        """Just before clipping and the optimizer step: injected "optimizer" faults."""
        if self.faults is not None:
            self.faults.fire("optimizer")

    def close(self) -> None:
        """Undo the fault hooks (the watchdog stays: it belongs to the process group)."""
        if self.faults is not None:
            self.faults.disarm()


def _first_and_more(names: list[str], shown: int = 3) -> str:
    """``'a' first, then 2 more: b, c`` (at most ``shown`` of the rest named)."""
    rest = names[1:]
    if not rest:
        return f"{names[0]!r}"
    listed = ", ".join(rest[:shown]) + (", ..." if len(rest) > shown else "")
    return f"{names[0]!r} first, then {len(rest)} more: {listed}"
