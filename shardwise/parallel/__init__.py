"""shardwise.parallel."""

from shardwise.parallel.moe_stats import AllReduceStats, apply_global_balance

__all__ = ["AllReduceStats", "apply_global_balance"]
