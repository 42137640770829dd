"""Exact byte accounting of what the engine holds, per rank.

The engine reports every buffer it allocates or frees to a :class:`MemoryTracker`; the
optimizer's state is read from the optimizer itself. Nothing here is estimated from
shapes: these are the bytes of tensors that exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.distributed.pool import POOL

__all__ = ["MemoryTracker", "MemoryReport", "build_memory_report"]

KINDS = ("params", "grads", "unsharded", "comm", "secondary", "tp_comm")


@dataclass
class MemoryTracker:
    """Current and peak bytes per kind: ``params`` (parameter shards or replicas), ``grads``
    (gradient shards or buckets), ``unsharded`` (gathered parameters and their gradients),
    ``comm`` (collective staging buffers), ``secondary`` (hierarchical partitions kept
    between a unit's forward and backward) and ``tp_comm`` (tensor-parallel collective
    buffers: a sequence-parallel region's gathered input, tracked by ``apply_tp``)."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_transient: int = 0
    peak_init: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.current[kind] += nbytes
        if self.current[kind] > self.peak[kind]:
            self.peak[kind] = self.current[kind]
        transient = self.current["unsharded"] + self.current["comm"]
        if transient > self.peak_transient:
            self.peak_transient = transient

    def sub(self, kind: str, nbytes: int) -> None:
        self.current[kind] -= nbytes
        assert self.current[kind] >= 0, (kind, self.current[kind])

    def reset_peak(self) -> None:
        self.peak = dict(self.current)
        self.peak_transient = self.current["unsharded"] + self.current["comm"]


@dataclass(frozen=True)
class MemoryReport:
    """This rank's bytes, as :func:`shardwise.memory_report` returns them.

    Attributes:
        param_bytes: parameter shards (or whole replicas at stage 0).
        grad_bytes: gradient shards (or stage-0 buckets).
        optimizer_bytes: optimizer state tensors of this rank's parameters.
        unsharded_bytes, comm_bytes: gathered parameters / collective buffers right now.
        peak_unsharded_bytes, peak_comm_bytes: their peaks since the last reset.
        peak_transient_bytes: peak of unsharded + comm together.
        secondary_bytes, peak_secondary_bytes: hierarchical secondary partitions held.
        peak_init_bytes: meta-device init only: peak bytes of full parameter values alive
            at once while materialising (one module's, plus tied parameters in flight).
        cached_bytes: free staging buffers this process keeps for reuse, shared by every
            sharded model (see [Note: buffer pool]; ``shardwise.empty_cache()`` frees them).
        tp_comm_bytes, peak_tp_comm_bytes: tensor-parallel collective buffers held now / at
            the peak: the gathered input of the sequence-parallel region computing (forward)
            and its gathered-again copy (backward); 0 without sequence parallelism.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    comm_bytes: int
    peak_unsharded_bytes: int
    peak_comm_bytes: int
    peak_transient_bytes: int
    secondary_bytes: int = 0
    peak_secondary_bytes: int = 0
    peak_init_bytes: int = 0
    cached_bytes: int = 0
    tp_comm_bytes: int = 0
    peak_tp_comm_bytes: int = 0

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (the ZeRO paper's "model states")."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, int]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["model_state_bytes"] = self.model_state_bytes
        return d


def _optimizer_bytes(optimizer: torch.optim.Optimizer | None, params: set[int]) -> int:
    if optimizer is None:
        return 0
    seen, total = set(), 0
    for p, st in optimizer.state.items():
        if id(p) not in params:
            continue
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def build_memory_report(trackers: list[MemoryTracker], params: list[torch.nn.Parameter],
                        optimizer: torch.optim.Optimizer | None) -> MemoryReport:
    """Sum trackers of every engine state in a model and add the optimizer's state bytes."""
    cur = {k: sum(t.current[k] for t in trackers) for k in KINDS}
    peak = {k: sum(t.peak[k] for t in trackers) for k in KINDS}
    return MemoryReport(
        param_bytes=cur["params"], grad_bytes=cur["grads"],
        optimizer_bytes=_optimizer_bytes(optimizer, {id(p) for p in params}),
        unsharded_bytes=cur["unsharded"], comm_bytes=cur["comm"],
        peak_unsharded_bytes=peak["unsharded"], peak_comm_bytes=peak["comm"],
        peak_transient_bytes=sum(t.peak_transient for t in trackers),
        secondary_bytes=cur["secondary"], peak_secondary_bytes=peak["secondary"],
        peak_init_bytes=max((t.peak_init for t in trackers), default=0),
        cached_bytes=POOL.cached_bytes,
        tp_comm_bytes=cur["tp_comm"], peak_tp_comm_bytes=peak["tp_comm"],
    )
