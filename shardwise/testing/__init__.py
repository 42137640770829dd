"""Test helpers: multi-rank launch on Gloo and parity checks against one process."""

from shardwise.testing.dist import RankFailure, RankTimeout, run_ranks

__all__ = ["run_ranks", "RankFailure", "RankTimeout"]
