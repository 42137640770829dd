"""Measure, correct, re-plan: ``shardwise train --parallel.plan auto`` while it trains.

    summary = train_planned(cfg, data, env)   # launch.py calls this in place of train()

[Note: re-planning] Preflight gave the run the planner's best layout
(:func:`shardwise.train.plan_layout.plan_start`). In each layout the run trains one warm-up
step and then ``parallel.replan_steps`` measured steps: step time (the slowest rank's
median), bytes and calls per collective from ``comm_stats`` (per step), and the model-state
bytes of ``memory_report``. Rank 0 then refits the device's constants to every layout
measured so far (``planner.calibrate``: ``matmul_max`` from step times alone, plus the link
efficiency once collective times are known or two layouts are measured, and on multi-rank
CPU jobs the cores' contention ``cpu_busy``), re-ranks the
layouts the trainer can build and compares the measured layout with the best other one
(its measured time if it ran, else its prediction). If that one is faster by more than
``parallel.replan_threshold`` of the measured step time, and by more than the measured
steps' own scatter ([Note: switching on noise]), and the run has steps left to measure
it, every rank saves a checkpoint, the loop ends, and :func:`train_planned` starts
``train`` again in the new layout resuming from that checkpoint (the resume path of
``checkpoint.resume``: bitwise, as any resume). Each layout is measured once, so a run
settles. Every decision is one JSON line of ``<log.dir>/plan_history.jsonl`` and one line
on the progress output.

comm_stats counts bytes and calls, not seconds, so live runs fit collective time only
through step times; a test or a profiler can inject full observations (``observe``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.distributed import comm
from shardwise.distributed.comm import objects as comm_objects
from shardwise.planner.calibrate import StepMeasurement, calibrate, constant
from shardwise.planner.cost_model import CostModel
from shardwise.planner.parallel_layout import Layout
from shardwise.train import plan_layout
from shardwise.train.config import Config
from shardwise.train.preflight import build_model_config
from shardwise.train.trainer import train

__all__ = ["Observation", "Decision", "decide", "step_spread", "Replanner", "train_planned",
           "HISTORY_FILE"]

HISTORY_FILE = "plan_history.jsonl"
_MIB = 2 ** 20


@dataclass(frozen=True)
class Observation:
    """What one layout was measured at (per step; the slowest rank's figures).

    Attributes:
        step_time: seconds per optimizer step.
        dp_collective_time: seconds of the data-parallel collectives per step, or None when
            not measured (comm_stats counts bytes, not time).
        comm: ``{operation: {"calls": n, "bytes_sent": b}}`` per step, from comm_stats.
        model_state_bytes: parameters + gradients + optimizer state (memory_report).
        spread: how far the measured steps lie from each other, relative to their median
            (half their range over the median, the largest rank's): the noise of
            ``step_time`` ([Note: switching on noise]).
    """

    step_time: float
    dp_collective_time: float | None = None
    comm: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    model_state_bytes: float | None = None
    spread: float = 0.0


def step_spread(times: list[float]) -> float:
    """Half the range of ``times`` over their median (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    return (max(times) - min(times)) / 2 / statistics.median(times)


@dataclass(frozen=True)
class Decision:
    """The outcome of comparing the measured layout with the best other one."""

    switch: bool
    best: Layout | None
    best_time: float | None
    best_measured: bool
    reason: str


def decide(current: Layout, measured_time: float, ranked: list[tuple[Layout, float]],
           measured: dict[Layout, float], threshold: float, steps_left: int,
           steps_needed: int, spread: float = 0.0) -> Decision:
    """Whether to switch from ``current``.

    [Note: switching on noise] A switch costs a checkpoint and a rebuild, and a gain smaller
    than the measured steps' own scatter may be nothing but the machine: on a shared CPU
    machine the same step varies by a fifth from one second to the next (docs/planner.md,
    "The machine's own noise"). So the gain must exceed both ``threshold`` and ``spread``,
    half the measured steps' range over their median; the reason names which one held the
    switch back.

    Args:
        current: the layout the run measured.
        measured_time: its measured step time (seconds).
        ranked: (layout, predicted step time) of the layouts the trainer can build.
        measured: step times of layouts already measured (they replace predictions).
        threshold: the least gain, as a fraction of ``measured_time``, worth a switch.
        steps_left: steps the run has left.
        steps_needed: steps a new layout needs to be measured (warm-up included).
        spread: the relative scatter of the measured steps (:func:`step_spread`).

    Returns:
        A :class:`Decision` (``best`` is None when no other layout is buildable).
    """
    others = [(L, measured.get(L, t), L in measured) for L, t in ranked if L != current]
    if not others:
        return Decision(False, None, None, False, "no other layout fits the constraints")
    best, t, was_measured = min(others, key=lambda x: x[1])
    gain = 1 - t / measured_time
    how = "measured" if was_measured else "predicted"
    if gain <= threshold:
        word = "faster" if gain >= 0 else "slower"
        return Decision(False, best, t, was_measured, f"the best other layout is {how} "
                        f"{abs(gain):.1%} {word}, within the threshold {threshold:.0%}")
    if gain <= spread:
        return Decision(False, best, t, was_measured, f"the best other layout is {how} "
                        f"{gain:.1%} faster, more than the threshold {threshold:.0%} but "
                        f"within the measured steps' spread (+-{spread:.1%})")
    if steps_left < steps_needed:
        return Decision(False, best, t, was_measured, f"{how} {gain:.1%} faster, but only "
                        f"{steps_left} steps are left (a switch needs {steps_needed})")
    return Decision(True, best, t, was_measured, f"{how} {gain:.1%} faster than measured, "
                    f"more than the threshold {threshold:.0%}")


def _per_step(before, after, steps: int) -> dict[str, dict[str, float]]:
    out = {}
    for op, s in after.by_label.items():
        b = before.label(op)
        calls = s.calls - b.calls
        if calls and op != "stats":  # the trainer's own statistics gather
            out[op] = {"calls": calls / steps, "bytes_sent": (s.bytes_sent - b.bytes_sent)
                       / steps}
    return out


class Replanner:
    """Per-rank state of ``--parallel.plan auto`` across the layouts of one run.

    Args:
        cfg: the run's config (the layout preflight planned).
        model_cfg: the model's LlamaConfig.
        env: this rank's DistEnv.
        observe: replaces the measurement (a test injects observations): called as
            ``observe(layout, measured)`` with the Observation measured here, returns the
            Observation to use.
    """

    def __init__(self, cfg: Config, model_cfg: Any, env, observe: Callable | None = None
                 ) -> None:
        self.cfg, self.model_cfg, self.env, self.observe = cfg, model_cfg, env, observe
        self.spec, self.hw, self.wl = plan_layout.planner_inputs(cfg, model_cfg)
        self.measured: dict[Layout, Observation] = {}
        self.switching: Config | None = None
        self._times: list[float] = []
        self._seg_first: int | None = None
        self._comm_before = None
        self._decided = False
        self.switch_step = 0

    # ------------------------------------------------------------------ the trainer's hook
    def begin(self, cfg: Config) -> None:
        """A new segment (the first, or after a switch) trains with ``cfg``."""
        self.cfg, self.switching = cfg, None
        self._times, self._seg_first, self._decided = [], None, False
        self.switch_step = 0

    def after_step(self, record: dict[str, Any], model, optimizer, logger) -> bool:
        """Called by the trainer after each step; True: save a checkpoint and stop (the
        caller resumes in ``self.switching``)."""
        step = record["step"]
        if self._seg_first is None:
            self._seg_first = step
            self._start(step - 1, logger)
        if self._decided or step == self._seg_first:  # the segment's warm-up step
            self._comm_before = comm.comm_stats()
            return False
        self._times.append(float(record["step_time_s"]))
        if len(self._times) < self.cfg.parallel.replan_steps:
            return False
        self._decided = True
        self.switch_step = step
        obs = self._measure(model, optimizer)
        decision = self._decide(step, obs, logger) if self.env.is_main else None
        decision = comm_objects.broadcast_object(decision, 0, label="replan.decision")
        if decision is not None:
            self.switching = plan_layout.with_layout(self.cfg, decision)
        return self.switching is not None

    # ------------------------------------------------------------------ internals
    def _start(self, done: int, logger) -> None:
        if not self.env.is_main:
            return
        L = plan_layout.layout_of(self.cfg)
        est = plan_layout.estimate(self.cfg, self.model_cfg, self.env.world_size, L, self.hw)
        fresh = done == 0 and not self.measured
        self._write({"event": "plan" if not self.measured else "resume", "step": done,
                     "layout": plan_layout.trainer_keys(L), "hardware": self.hw.name,
                     "predicted_step_s": est.step_time,
                     "predicted_memory_mib": est.memory.total / _MIB,
                     "fixed": list(self.cfg.parallel.plan_fixed),
                     "reason": "the planner's fastest fitting layout" if fresh else
                     "resumed in the layout chosen at the last decision"}, truncate=fresh)
        logger.echo(f"plan: {plan_layout.describe(L)}, predicted {est.step_time:.3g} s/step "
                    f"on {self.hw.name}; measuring {self.cfg.parallel.replan_steps} steps "
                    f"after step {done + 1}")

    def _measure(self, model, optimizer) -> Observation:
        import shardwise

        steps = len(self._times)
        mem = shardwise.memory_report(model, optimizer).model_state_bytes
        local = Observation(statistics.median(self._times), None,
                            _per_step(self._comm_before, comm.comm_stats(), steps), float(mem),
                            step_spread(self._times))
        if self.observe is not None:
            local = self.observe(plan_layout.layout_of(self.cfg), local)
        every = comm_objects.all_gather_object(local, label="replan.observations")
        dp = [o.dp_collective_time for o in every if o.dp_collective_time is not None]
        return Observation(max(o.step_time for o in every), max(dp) if dp else None,
                           every[0].comm, max(o.model_state_bytes or 0 for o in every),
                           max(o.spread for o in every))

    def _fit(self):
        ms = [StepMeasurement(self.spec, self.wl, L, o.step_time, o.dp_collective_time)
              for L, o in self.measured.items()]
        known = len(ms) + sum(bool(m.dp_collective_time) for m in ms)
        params = ("matmul_max", "intra_efficiency", "inter_efficiency")[:max(1, known)]
        if self.hw.gpus_per_node >= self.env.world_size and len(params) == 3:
            params = params[:2]  # one node: the inter-node link is not used
        if self.hw.cpu is not None and self.hw.cores and self.env.world_size > 1:
            params += ("cpu_busy",)  # CPU ranks: the cores' contention, seen only here
        return calibrate(ms, self.hw, params=params), params

    def _decide(self, step: int, obs: Observation, logger) -> Layout | None:
        cfg, world = self.cfg, self.env.world_size
        L = plan_layout.layout_of(cfg)
        before = plan_layout.estimate(cfg, self.model_cfg, world, L, self.hw)
        self.measured[L] = obs
        (hw, err), params = self._fit()
        after = plan_layout.estimate(cfg, self.model_cfg, world, L, hw)
        ranked = plan_layout.rank_layouts(cfg, self.model_cfg, world, hw)
        needed = 1 + cfg.parallel.replan_steps
        d = decide(L, obs.step_time, [(e.layout, e.step_time) for e in ranked],
                   {k: v.step_time for k, v in self.measured.items()},
                   cfg.parallel.replan_threshold, cfg.train.steps - step, needed,
                   obs.spread)
        cm = CostModel(self.spec, hw, self.wl)
        self._write({
            "event": "switch" if d.switch else "keep", "step": step,
            "layout": plan_layout.trainer_keys(L), "measured_step_s": obs.step_time,
            "measured_step_spread": obs.spread,
            "predicted_step_s_before_fit": before.step_time,
            "predicted_step_s": after.step_time,
            "measured_dp_collective_s": obs.dp_collective_time,
            "predicted_dp_collective_s": cm.dp_collective_seconds(L),
            "comm_per_step": obs.comm,
            "measured_model_state_mib": (obs.model_state_bytes or 0) / _MIB,
            "predicted_model_state_mib": (after.memory.params + after.memory.grads
                                          + after.memory.optimizer) / _MIB,
            "fitted": {p: constant(hw, p) for p in params}, "fit_error": err,
            "best_other": plan_layout.trainer_keys(d.best) if d.best else None,
            "best_other_step_s": d.best_time, "best_other_measured": d.best_measured,
            "threshold": cfg.parallel.replan_threshold, "reason": d.reason,
            "new_layout": plan_layout.trainer_keys(d.best) if d.switch else None})
        self.hw = hw
        what = (f"switching to {plan_layout.describe(d.best)} (checkpoint at step {step})"
                if d.switch else "keeping it")
        logger.echo(f"plan: step {step}: {obs.step_time:.3g} s/step measured in "
                    f"{plan_layout.describe(L)} (predicted {before.step_time:.3g}, "
                    f"{after.step_time:.3g} after refitting {', '.join(params)}); {d.reason}; "
                    f"{what}")
        return d.best if d.switch else None

    def _write(self, record: dict[str, Any], truncate: bool = False) -> None:
        path = Path(self.cfg.log.dir) / HISTORY_FILE
        with open(path, "w" if truncate else "a", encoding="ascii") as f:
            f.write(json.dumps(record) + "\n")


def _checkpoint_path(cfg: Config, step: int) -> str:
    from shardwise.checkpoint.atomic import step_name

    root = Path(cfg.checkpoint.dir or Path(cfg.log.dir) / "checkpoints").expanduser()
    return str(root / step_name(step))


def train_planned(cfg: Config, data: Any, env, observe: Callable | None = None
                  ) -> dict[str, Any] | None:
    """``train`` with ``parallel.plan = "auto"`` re-planning (see [Note: re-planning]);
    plain ``train`` with ``plan = "off"``.

    Args:
        cfg, data, env: as for :func:`shardwise.train.trainer.train`.
        observe: replaces measurements (see :class:`Replanner`); None: measure.

    Returns:
        The summary of the last layout's segment on rank 0, None elsewhere.
    """
    if cfg.parallel.plan != "auto":
        return train(cfg, data, env)
    planner = Replanner(cfg, build_model_config(cfg, data.vocab_size), env, observe)
    while True:
        planner.begin(cfg)
        summary = train(cfg, data, env, replan=planner)
        if planner.switching is None:
            return summary
        # The run folder is this run's now: resume into it, never clear it.
        cfg = dataclasses.replace(
            planner.switching,
            checkpoint=dataclasses.replace(cfg.checkpoint,
                                           resume=_checkpoint_path(cfg, planner.switch_step)),
            log=dataclasses.replace(cfg.log, overwrite=False))
