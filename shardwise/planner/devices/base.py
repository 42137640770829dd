"""The device-model protocol: what the cost model asks a device (the planner's package
docstring tells the whole contract). GPU devices are priced by :class:`~shardwise.planner.
devices.gpu.GpuDevice`, calibrated CPU ranks by :class:`~shardwise.planner.devices.cpu.
device.CpuDevice`; ``devices.registry.device_model`` picks one for a hardware entry.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["DeviceModel"]


class DeviceModel(Protocol):
    """Per-layer compute seconds, per-collective seconds, and how a step's parts combine.

    Every method is a pure function of its arguments and the device's hardware entry
    (``hw``); ``cm`` arguments are the :class:`~shardwise.planner.cost_model.CostModel`
    asking, whose public methods (``all_ranks``, ``rank_plan``, ``rank_units``,
    ``optimizer_seconds``, ``cached``) are what a device may read of the layout's other
    ranks.
    """

    hw: Any

    # ---- compute: one layer (or the embedding and loss) for one micro-batch on one rank
    def layer_seconds(self, spec, wl, w, tp: int, sp: bool, moe: bool
                      ) -> tuple[float, float, float, float]:
        """(forward, backward, weight-gradient, selective-recompute) seconds of one layer's
        work ``w`` (``work.LayerWork``)."""

    def composition(self, spec) -> tuple[float, float]:
        """(multiplies', other kernels') factors on the layers and head of ``spec`` (how
        parts timed alone compose into a layer; 1 where the parts are priced as composed)."""

    def edge_seconds(self, spec, wl, tokens: float, tp: int, sp: bool, first: bool,
                     last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of the embedding (``first``) and of the final norm and
        loss (``last``), the head's multiply aside."""

    def accumulate_seconds(self, spec, wl, shapes: list, per_param: float,
                           kernel_factor: float) -> float:
        """Seconds one micro-batch spends adding ``per_param`` bytes per parameter of these
        whole-parameter ``shapes`` into the accumulated gradients."""

    def optimizer_seconds(self, units: list, world: int, experts: bool, nbytes: float
                          ) -> float:
        """Seconds of the optimizer step over the rank's shards of ``units`` (sharded over
        ``world``; ``experts``: expert units too) moving ``nbytes`` of state."""

    # ---- communication: one collective on a placed group (comm_model.Group)
    def all_gather(self, shard_bytes: float, g) -> float:
        """Seconds of an all-gather of ``shard_bytes`` per rank."""

    def reduce_scatter(self, shard_bytes: float, g) -> float:
        """Seconds of a reduce-scatter whose output is ``shard_bytes`` per rank."""

    def all_reduce(self, nbytes: float, g) -> float:
        """Seconds of an all-reduce of ``nbytes``."""

    def dispatch(self, token_bytes: float, tokens: float, top_k: int, g,
                 node_limit: int = 0) -> float:
        """Seconds of an expert all-to-all's dispatch (or combine) of ``tokens`` tokens."""

    def p2p(self, nbytes: float, across_nodes: bool) -> float:
        """Seconds of one message between neighbouring pipeline stages."""

    def tp_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, ac: str,
                   gemm: float, replay_gemm: float) -> float:
        """Exposed seconds of one layer's tensor-parallel collectives per micro-batch
        (``sends.tp_region``); ``gemm``: its forward multiplies' seconds, ``replay_gemm``:
        those ``alternate_mm`` replays."""

    def tp_edge_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, first: bool,
                        last: bool) -> float:
        """Exposed seconds of the embedding's, head's and loss's tensor-parallel collectives
        per micro-batch (``sends.tp_edges``)."""

    # ---- the step: how its parts combine
    def overlaps(self, ranks: int) -> bool:
        """Whether collectives can overlap compute with ``ranks`` ranks."""

    def transient_bytes(self, cm, L, layers: list, first: bool, last: bool, states,
                        tokens: float) -> tuple[float, float, float]:
        """(gathered parameters, communication buffers, whole gradients) bytes at a rank's
        transient peak (``states``: its ``rank_memory.StateBytes``)."""

    def combine(self, cm, L, breakdown: dict[str, float], layers: list, first: bool,
                last: bool) -> dict[str, float]:
        """The step's components on the busiest rank (holding ``layers``) once the device's
        own effects are in (a new dict, the same keys)."""

    def crowded(self, ranks: int) -> bool:
        """Whether a job of ``ranks`` ranks meets its collectives amid other ranks' work, so
        that one rank's timeline is priced apart (:meth:`in_world`)."""

    def in_world(self, ranks: int, gap_s: float | None = None) -> DeviceModel:
        """This device as one rank of ``ranks`` meets its collectives, ``gap_s`` seconds of
        compute apart (None: the longest measured gap)."""
