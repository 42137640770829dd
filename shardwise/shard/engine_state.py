"""The contract between a ``shard`` call's runtime state and everything that uses it.

Every module passed to ``shardwise.shard`` (or ``shardwise.replicate``) carries one engine
state (registry.py). Two kinds exist: :class:`~shardwise.shard.state.ShardState` (ZeRO 1-3,
and stage 0 with a compute dtype, as units) and
:class:`~shardwise.shard.replicate.ReplicateState` (plain data parallelism with DDP-style
buckets). Gradient clipping, the per-micro-batch controls, state dicts, offload, compile and
checkpoints program against :class:`EngineState` and never probe which kind they hold.

The ZeRO stage is turned once, in ``shard``, into a :class:`ZeroPolicy` of booleans (what is
sharded), which the runtime reads instead of comparing stage numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from torch import nn

__all__ = ["ZeroPolicy", "EngineState", "ParamRows"]


@dataclass(frozen=True)
class ZeroPolicy:
    """What a ZeRO stage shards (FSDP2's ``reshard_after_forward`` / DeepSpeed's stages as
    data).

    Attributes:
        shard_optimizer: optimizer state and fp32 masters are this rank's shards only
            (stages 1-3).
        shard_grads: each unit's gradients are reduce-scattered as soon as backward is done
            with the unit, and freed (stages 2-3); otherwise every unit's at the end of
            backward ([Note: stage 1 vs 2] in state.py).
        shard_params: gathered parameters are freed after use and gathered again (stage 3).
    """

    shard_optimizer: bool = True
    shard_grads: bool = True
    shard_params: bool = True

    @classmethod
    def from_stage(cls, stage: int) -> "ZeroPolicy":
        """The policy of ZeRO stage ``stage`` (0-3).

        Raises:
            ValueError: ``stage`` is not 0, 1, 2 or 3.
        """
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(stage >= 1, stage >= 2, stage >= 3)

    @property
    def reduce_at_end(self) -> bool:
        """Whether every unit is reduced once backward has finished (stage 1, as DeepSpeed's
        ZeRO-1) rather than as soon as backward is done with it (stages 0 as units, 2, 3:
        overlapping the rest of backward); [Note: stage 1 vs 2] in state.py."""
        return self.shard_optimizer and not self.shard_grads

    @property
    def zero(self) -> int:
        """The ZeRO stage this policy is (for messages and records)."""
        return int(self.shard_optimizer) + int(self.shard_grads) + int(self.shard_params)


class ParamRows(NamedTuple):
    """Which rows of a parameter this rank holds, for state dicts."""

    fqns: list[str]
    param: nn.Parameter
    row_offset: int
    local_rows: int
    shard_group: Any  # the group its rows are split over (None: one rank)
    whole: bool = False  # every data-parallel rank holds all of it (bucketed stage 0)


class EngineState(Protocol):
    """The runtime state of one ``shard`` call (see the module docstring).

    Attributes:
        module: the module passed to ``shard``.
        groups: its data-parallel process groups.
        tracker: its memory accounting.
        policy: what it shards.
        units: its sharding units (empty for bucketed stage 0).
        offload: the CPU / disk offload policy of its optimizer state, if any.
        after_reduce: callbacks run after every gradient reduction ([Note: partial
            gradients] in placed.py).
        sync: whether the coming backward passes reduce gradients.
        paused: whether its backward hooks ignore autograd calls (split backward).
        reshard_after_forward / reshard_after_backward: the per-micro-batch controls.
        meshes: DTensor meshes the state dict built over this state's groups (cached: a
            DeviceMesh is built once per layout).
    """

    module: nn.Module
    groups: Any
    tracker: Any
    policy: ZeroPolicy
    units: list
    offload: Any
    after_reduce: list[Callable[[], None]]
    sync: bool
    paused: bool
    reshard_after_forward: bool
    reshard_after_backward: bool
    meshes: dict

    def graph_parameters(self) -> list[nn.Parameter]:
        """The tensors through which trainable parameters enter autograd graphs."""

    def param_rows(self) -> list[ParamRows]:
        """Every parameter and the rows of it this rank holds."""

    def unshard_all(self) -> None:
        """Gather every unit now (a no-op where parameters are whole)."""

    def reshard_all(self) -> None:
        """Free every gathered unit now (a no-op where parameters are whole)."""

    def mark_stale(self) -> None:
        """Parameters changed outside the optimizer step: re-gather before next use."""

    def remove(self) -> None:
        """Remove its hooks."""
