"""One priced layout: :class:`Estimate`, what ``CostModel.estimate`` returns (step time and
its components, memory, utilisation) and the ``shardwise plan --json`` record."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.parallel_layout import Layout
from shardwise.planner.rank_memory import MemoryBreakdown

__all__ = ["Estimate", "BOTTLENECKS"]

BOTTLENECKS = ("compute", "dp_comm", "tp_comm", "pp_bubble", "pp_comm", "ep_all_to_all",
               "offload")
_GIB = 2 ** 30


@dataclass(frozen=True)
class Estimate:
    """The prediction for one layout (seconds, bytes, fractions)."""

    layout: Layout
    step_time: float
    breakdown: dict[str, float]
    memory: MemoryBreakdown
    fits: bool
    model_flops: float
    hardware_flops: float
    gpus: int
    tokens: int
    peak_flops: float

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / (self.step_time * self.gpus)

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the devices' peak."""
        return self.model_flops / (self.step_time * self.gpus * self.peak_flops)

    @property
    def hfu(self) -> float:
        """Executed FLOPs (recomputation included) per second over the devices' peak."""
        return self.hardware_flops / (self.step_time * self.gpus * self.peak_flops)

    @property
    def bottleneck(self) -> str:
        cats = {k: self.breakdown.get(k, 0.0) for k in BOTTLENECKS}
        cats["compute"] += self.breakdown.get("optimizer", 0.0)
        cats["tp_comm"] += self.breakdown.get("cp_comm", 0.0)
        return max(cats, key=cats.get)

    def record(self) -> dict[str, object]:
        """The JSON record of ``shardwise plan --json``."""
        return {"layout": self.layout.as_dict(), "step_time_s": self.step_time,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "hfu": self.hfu, "memory_per_gpu_gib": self.memory.total / _GIB,
                "fits": self.fits, "bottleneck": self.bottleneck}
