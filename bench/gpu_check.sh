#!/usr/bin/env bash
# Run on a machine with CUDA GPUs, from the repository root, in an environment where
# shardwise is installed (pip install -c constraints.txt -e ".[test]"):
#     bash bench/gpu_check.sh
# Prints one summary table (parity on CUDA, the bf16 trainer with sync debugging, ~1B-param
# throughput eager and compiled, inductor parity) and what a single GPU cannot check.
# Writes the table to bench/results/gpu_check.txt as well. See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p bench/results
timeout 470 python bench/gpu_check.py "$@" 2>&1 | tee bench/results/gpu_check.txt
