"""Benchmarks of shardwise; bench/README.md describes zero_bench.py and profile_step.py."""
