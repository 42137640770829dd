"""planner_choice's jobs and the layouts it measures for each: the planner's top, the trainer's
default and the brute-force space (every buildable layout the planner enumerates that fits).

[Note: the brute-force space] ``search_space`` yields every layout the planner enumerates
for a job, dominated ones included (399 buildable layouts of the debug model on 2 ranks,
1,470 on 4, 1,962 of the small model on 4). Timing each for several steps and rounds on
two shared cores would take hours, so the space is reduced, before anything is measured, only
by rules that do not come from the cost model:

* a layout the planner prices over the job's memory cap is dropped (its memory, not its
  time: the cap is the job's constraint, as ``--parallel.plan auto`` applies it; priced
  exactly, every pipeline rank with the simulated schedule's in-flight micro-batches, as the
  search prices what it ranks first);
* activation checkpointing: of the layouts that differ only in ``ac``, the one recomputing
  least that fits (recomputation adds a forward's work and saves only memory);
* ZeRO stage with ``dp_shard`` 1: sharding over one rank holds and moves the same bytes at
  every stage, so one of them (the lowest) stands for all;
* tensor parallelism with sequence parallelism on (the trainer's default when tp > 1), the
  1F1B family without GPipe (the same work, more micro-batches in flight) and interleaved
  1F1B at 2 stages per rank only (a reduction for time, not a rule: more stages per rank
  are left out).

Layouts the trainer refuses (``plan_layout``'s checks, as ``--parallel.plan auto`` applies
them) are not in the space.

What remains is screened (every layout measured once, a few steps) and its fastest are
measured in the rounds beside the top and the default (planner_choice.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.planner.cost_model import CostModel
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.search import search_space
from shardwise.train import plan_layout
from shardwise.train.config import Config, load_config, resolve_world
from shardwise.train.preflight import build_model_config

__all__ = ["Job", "JOBS", "CAP_SHARE", "job_config", "job_cap", "capped", "top_layout",
           "default_layout", "brute_force", "name_of", "layout_from"]

_MIB = 2 ** 20
CAP_SHARE = {"debug": 0.7, "small": 0.7}
"""A capped job's memory per rank: the planner's reserved bytes plus this share of what it
prices the trainer's default layout at beyond them, so the default does not fit and the
planner must trade time for memory (smaller micro-batches, checkpointing, a pipeline,
tensor parallelism)."""
_AC_ORDER = {"none": 0, "selective": 1, "full": 2}


@dataclasses.dataclass(frozen=True)
class Job:
    """One job: a model on ``ranks`` CPU ranks, with or without a memory cap."""

    model: str
    ranks: int
    capped: bool

    @property
    def name(self) -> str:
        return f"{self.model} x{self.ranks}" + (", cap" if self.capped else "")


JOBS = [Job(m, r, c) for m in ("debug", "small") for r in (2, 4) for c in (False, True)]


def job_config(job: Job) -> Config:
    """What ``shardwise train --model.name M --nproc R`` resolves to (no parallel flags):
    the trainer's default layout (ZeRO-3 over every rank, 4 sequences of 128 tokens)."""
    over = {"model.name": job.model, "log.progress": "false", "parallel.watchdog": "off"}
    return resolve_world(load_config(None, over), job.ranks)


def job_cap(job: Job, hw) -> float | None:
    """The job's memory per rank in bytes (None: the device's own, ``hbm_gib``); see
    ``CAP_SHARE``."""
    if not job.capped:
        return None
    cfg = job_config(job)
    est = _model(cfg, hw).estimate(plan_layout.layout_of(cfg))
    reserved = hw.reserved_bytes
    return reserved + CAP_SHARE[job.model] * (est.memory.total - reserved)


def capped(hw, cap: float | None):
    """``hw`` with ``cap`` bytes per rank: what a calibration file with ``hbm_gib`` set to
    the cap gives ``--parallel.plan auto`` (``--parallel.plan_calibration``)."""
    return hw if cap is None else hw.replace(hbm_bytes=cap)


def _model(cfg: Config, hw) -> CostModel:
    spec, hw, wl = plan_layout.planner_inputs(cfg, build_model_config(cfg), hw)
    return CostModel(spec, hw, wl)


def top_layout(job: Job, hw) -> Layout:
    """The layout ``--parallel.plan auto`` builds for the job on ``hw`` (capped).

    Raises:
        ValueError: nothing the trainer can build fits.
    """
    cfg = job_config(job)
    ranked = plan_layout.rank_layouts(cfg, build_model_config(cfg), job.ranks, hw)
    if not ranked:
        raise ValueError(f"job {job.name!r}: no buildable layout fits")
    return ranked[0].layout


def default_layout(job: Job) -> Layout:
    """The trainer's default layout at the job's rank count."""
    return plan_layout.layout_of(job_config(job))


def _representative(L: Layout) -> tuple[Layout, tuple]:
    """The key of L's class in [Note: the brute-force space] and its rank within it."""
    key = L.replace(ac="none", zero=0 if L.dp_shard == 1 else L.zero)
    return key, (_AC_ORDER[L.ac], L.zero)


def brute_force(job: Job, hw) -> list[Layout]:
    """The job's brute-force space ([Note: the brute-force space]), fastest predicted first
    (the order only; every one is measured)."""
    cfg = job_config(job)
    model_cfg = build_model_config(cfg)
    cm = _model(cfg, hw)
    best: dict[Layout, tuple[tuple, Any]] = {}
    for L in search_space(cm.spec, hw, cm.wl, job.ranks, plan_layout.plan_constraints(cfg)):
        if (L.tp > 1 and not L.sp) or L.pp_schedule == "gpipe" or L.pp_virtual > 2:
            continue
        if not plan_layout._buildable(plan_layout.with_layout(cfg, L), model_cfg, job.ranks):
            continue
        est = cm.estimate(L, exact=True)  # as the search prices its best: every rank
        if est.memory.total > hw.hbm_bytes:
            continue
        key, rank = _representative(L)
        if key not in best or rank < best[key][0]:
            best[key] = (rank, est)
    return [e.layout for _, e in sorted(best.values(), key=lambda v: v[1].step_time)]


def name_of(L: Layout) -> str:
    """A layout in a few words (``plan_layout.describe``, with interleaved stages)."""
    s = plan_layout.describe(L)
    return s + (f", v {L.pp_virtual}" if L.pp_schedule == "interleaved_1f1b" else "")


def layout_from(d: dict[str, Any]) -> Layout:
    """A layout from its ``as_dict`` record."""
    return Layout(**d)
