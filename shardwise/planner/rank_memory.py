"""Bytes one rank holds: the engine's own accounting for model states, plus activations.

[Note: planner memory mirrors the engine] Parameter, gradient and optimizer bytes are not
estimated from parameter counts: every sharding unit is laid out with the engine's
``build_layout`` (shardwise/shard/layout.py, [Note: unit layout]) over the shard group, so
padding of uneven rows is counted exactly as ``Unit`` allocates it:

* params: each unit's flat shard buffer, ``shard_numel`` elements of the parameter dtype
  plus, where the engine tags its gathers (shard/identity.py), a ``TAG_BYTES`` trailer
  (stage 0: whole parameters);
* grads: each unit's gradient shard, ``grad_numel`` elements of the parameter dtype
  (stage 0: DDP-style buckets of whole gradients);
* optimizer: the state tensors ``torch.optim`` creates for this rank's *unpadded* shard of
  each parameter (AdamW: ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype plus a 4-byte
  ``step``), read by ``memory_report`` from the optimizer itself;
* unsharded: gathered parameters in the compute dtype, kept between steps at stages 1 and 2
  (and at stage 0 with a compute dtype, units over one-rank groups); at stage 3 the root
  unit (not freed after forward) plus the unit computing and ``prefetch`` gathered ahead;
* full grads: whole gradients outside the shards: stage 1 holds them until the end of
  backward ([Note: stage 1 vs 2] in shard/state.py; counted in the peak), and accumulation
  without synchronisation (``no_sync``, pipeline micro-batches) until the last micro-batch.

tests/test_planner_memory.py builds models with ``shardwise.shard`` on Gloo ranks and checks
params, grads and optimizer bytes against ``shardwise.memory_report`` exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache

import torch

from shardwise.shard.layout import build_layout

from shardwise.shard.identity import TAG_BYTES  # each unit's gather trailer

__all__ = ["UnitState", "StateBytes", "MemoryBreakdown", "unit_state", "state_bytes",
           "workload_state_kwargs", "OPTIMIZER_STATES", "TAG_BYTES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}
"""State tensors per parameter (SGD: its momentum buffer); each also gets a 4-byte step
for the Adam family."""


@dataclass(frozen=True)
class UnitState:
    """Element counts of one unit on one rank of a ``world``-rank shard group."""

    shard_numel: int
    full_numel: int
    numel: int
    local_numel: int
    n_params: int


@lru_cache(maxsize=4096)
def unit_state(shapes: tuple[tuple[int, ...], ...], world: int, rank: int = 0) -> UnitState:
    """The engine's layout of a unit with these (all trainable) parameter shapes."""
    if not shapes:
        return UnitState(0, 0, 0, 0, 0)
    lay = build_layout([torch.Size(s) for s in shapes], [True] * len(shapes), world)
    local = sum(p.local_rows(rank) * p.row_numel for p in lay.params)
    numel = sum(math.prod(s) for s in shapes)
    return UnitState(lay.shard_numel, lay.full_numel, numel, local, len(shapes))


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank (see [Note: planner memory mirrors the engine])."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    unsharded: float = 0.0
    full_grads: float = 0.0
    comm: float = 0.0

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(*(getattr(self, f.name) + getattr(other, f.name)
                            for f in fields(self)))


def state_bytes(units: list[tuple[tuple[int, ...], ...]], world: int, *, zero: int,
                rank: int = 0, param_bytes: int = 4, compute_bytes: int = 4,
                optimizer: str = "adamw", prefetch: int = 1, accumulate: bool = False,
                root: int | None = 0, reshard_after_forward: bool = True,
                moment_bytes: int | None = None, accum_bytes: int | None = None,
                ema_bytes: int = 0) -> StateBytes:
    """Bytes one rank holds for these units sharded over ``world`` ranks.

    Args:
        units: each unit's parameter shapes (trainable).
        world: ranks of the shard group (stage 0: ignored, nothing is sharded).
        zero: ZeRO stage 0-3.
        rank: this rank's index in the shard group (rank 0 holds the most rows).
        param_bytes: bytes of the parameter (master) dtype; compute_bytes: of the compute
            dtype (gathered parameters, gradients before reduction).
        optimizer: "adamw", "adam" or "sgd" (momentum).
        prefetch: units gathered ahead of the computing one (stage 3).
        accumulate: micro-batches accumulate whole gradients before one reduction.
        root: index of the root unit in ``units`` (stage 3 keeps it gathered), or None.
        reshard_after_forward: stage 3 frees gathered units after forward (True); False
            keeps every unit gathered between its forward and backward (all of them at
            the peak).
        moment_bytes: bytes of an optimizer moment element (default ``param_bytes``;
            DeepSeek-V3 keeps AdamW's moments in bf16).
        accum_bytes: bytes of a whole-gradient element held across micro-batches or,
            at stage 1, until the end of backward (default ``compute_bytes``; DeepSeek-V3
            accumulates in fp32).
        ema_bytes: bytes per element of an exponential moving average of this rank's
            parameter shard kept in device memory (0: none, or kept on the host).

    Raises:
        ValueError: an unknown optimizer or stage.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got "
                         f"{optimizer!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    n_states = OPTIMIZER_STATES[optimizer]
    step = 4 if optimizer != "sgd" else 0
    group = 1 if zero == 0 else world
    states = [unit_state(tuple(u), group, rank if group > 1 else 0) for u in units]
    numel = sum(s.numel for s in states)
    trailer = TAG_BYTES // param_bytes if zero > 0 or compute_bytes != param_bytes else 0
    params = sum(s.shard_numel + (trailer if s.n_params else 0) for s in states) * param_bytes
    grads = sum(s.shard_numel for s in states) * param_bytes
    moments = param_bytes if moment_bytes is None else moment_bytes
    opt = sum(s.local_numel * (n_states * moments + ema_bytes) + s.n_params * step
              for s in states)
    full = [s.full_numel * compute_bytes for s in states]
    if zero == 3 and not reshard_after_forward:
        unsharded = sum(full)
    elif zero == 3:
        blocks = sorted((b for i, b in enumerate(full) if i != root), reverse=True)
        unsharded = (full[root] if root is not None and full else 0) + sum(blocks[:1 + prefetch])
    else:
        unsharded = sum(full) if (zero > 0 or compute_bytes != param_bytes) else 0
    whole = compute_bytes if accum_bytes is None else accum_bytes
    full_grads = numel * whole if (zero == 1 or (accumulate and zero >= 2)) else 0
    # Staging of the largest unit: gathered buffer (stage 3 in flight) and packed gradients.
    comm = max(full, default=0) * (2 if zero == 3 else 1) if zero > 0 else 0
    return StateBytes(params, grads, opt, unsharded, full_grads, comm)


def workload_state_kwargs(wl) -> dict:
    """:func:`state_bytes` keywords a :class:`~shardwise.planner.workload.Workload` sets."""
    return dict(param_bytes=wl.param_bytes, compute_bytes=wl.act_bytes,
                optimizer=wl.optimizer, moment_bytes=wl.moment_bytes,
                accum_bytes=wl.accum_bytes,
                ema_bytes=wl.param_bytes if wl.ema == "device" else 0)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes of one rank, by kind (the pipeline rank holding the most)."""

    params: float
    grads: float
    optimizer: float
    unsharded: float
    full_grads: float
    comm: float
    activations: float
    logits: float
    reserved: float
    fragmentation: float
    pp_rank: int = 0
    """The pipeline rank these bytes are of."""
    total: float = field(init=False)
    """Sum of every kind (the rank aside)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer
                           + self.unsharded + self.full_grads + self.comm + self.activations
                           + self.logits + self.reserved + self.fragmentation)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
