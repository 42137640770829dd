"""The device-model protocol: what the cost model asks a device (the planner's package
docstring tells the whole contract). GpuDevice (gpu.py) and CpuDevice (cpu/device.py)
implement it; ``registry.device_model`` picks one for a hardware entry.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["DeviceModel"]


class DeviceModel(Protocol):
    """Per-layer compute seconds, per-collective seconds, how a step's parts combine.

    Every method is a pure function of its arguments and the device's hardware entry
    ``hw``. ``cm`` is the :class:`~shardwise.planner.cost_model.CostModel` asking: a device
    may read its public methods (``all_ranks``, ``rank_plan``, ``rank_units``,
    ``optimizer_seconds``, ``cached``), never its private members. ``g`` is a placed group
    (``comm_model.Group``); ``w`` a layer's work (``work.LayerWork``).
    """

    hw: Any

    # ---- compute: one layer (or the embedding and loss) for one micro-batch on one rank
    def layer_seconds(self, spec, wl, w, tp: int, sp: bool, moe: bool
                      ) -> tuple[float, float, float, float]:
        """(forward, backward, weight-gradient, selective-recompute) seconds of ``w``."""

    def composition(self, spec) -> tuple[float, float]:
        """(multiplies', other kernels') factors on the layers and head of ``spec``."""

    def edge_seconds(self, spec, wl, tokens: float, tp: int, sp: bool, first: bool,
                     last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of the embedding and the final norm and loss."""

    def attention_seconds(self, spec, wl, w, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of ``w``'s attention core alone: what a
        context-parallel ring step's transfer hides behind ([Note: context-parallel
        exposure] in stage_cost.py)."""

    def accumulate_seconds(self, spec, wl, shapes: list, per_param: float,
                           kernel_factor: float) -> float:
        """Seconds a micro-batch adds ``per_param`` bytes a parameter of ``shapes``."""

    def optimizer_seconds(self, units: list, world: int, experts: bool, nbytes: float
                          ) -> float:
        """Seconds of the update of the rank's shards of ``units`` (``nbytes`` of state)."""

    # ---- communication: one collective
    def all_gather(self, shard_bytes: float, g) -> float: ...
    def reduce_scatter(self, shard_bytes: float, g) -> float: ...
    def all_reduce(self, nbytes: float, g) -> float: ...
    def dispatch(self, token_bytes: float, tokens: float, top_k: int, g,
                 node_limit: int = 0) -> float: ...
    def p2p(self, nbytes: float, across_nodes: bool) -> float: ...
    def all_to_all(self, nbytes: float, g) -> float:
        """An all-to-all of a ``nbytes`` tensor per rank, spread evenly over ``g``."""

    def tp_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, ac: str,
                   gemm: float, replay_gemm: float) -> float:
        """Exposed seconds of a layer's tensor-parallel collectives (``sends.tp_region``)."""

    def tp_edge_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, first: bool,
                        last: bool) -> float:
        """Exposed seconds of the embedding's, head's and loss's (``sends.tp_edges``)."""

    # ---- the step: how its parts combine
    def overlaps(self, ranks: int) -> bool:
        """Whether collectives can hide behind compute with ``ranks`` ranks."""

    def transient_bytes(self, cm, L, layers: list, first: bool, last: bool, states,
                        tokens: float) -> tuple[float, float, float]:
        """(gathered parameters, communication buffers, whole gradients) at the peak."""

    def combine(self, cm, L, breakdown: dict[str, float], layers: list, first: bool,
                last: bool) -> dict[str, float]:
        """The step's components with the device's own effects in (a new dict)."""

    def crowded(self, ranks: int) -> bool:
        """Whether one rank's timeline of ``ranks`` is priced apart (``in_world``)."""

    def in_world(self, ranks: int, gap_s: float | None = None) -> DeviceModel:
        """This device as one of ``ranks`` ranks meets collectives ``gap_s`` apart."""
