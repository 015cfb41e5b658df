#!/bin/bash
# Prepare of one 4096-token request with scattered (random) block ids, every mode, each
# row against the older plan under a benchmark switch in the same run (a child process
# right before): shm across-segment runs vs per-segment (PDKV_BENCH_PER_SEGMENT_RUNS=1),
# tcp and shm plan memory reused vs fresh (PDKV_BENCH_FRESH_PLAN=1).
cd "$(dirname "$0")/../../../.." || exit 1
PY=.venv/bin/python
mkdir -p bench/results/hetero/wide
PDKV_LOG=error $PY bench/layout_prepare.py --transport shm --random-ids --no-direct \
  --compare-env PDKV_BENCH_PER_SEGMENT_RUNS=1 > bench/results/hetero/wide/prepare-shm-random.txt 2>&1
PDKV_LOG=error $PY bench/layout_prepare.py --transport tcp --random-ids --no-direct \
  --compare-env PDKV_BENCH_FRESH_PLAN=1 > bench/results/hetero/wide/prepare-tcp-random.txt 2>&1
PDKV_LOG=error $PY bench/layout_prepare.py --transport shm --no-direct \
  --compare-env PDKV_BENCH_PER_SEGMENT_RUNS=1 > bench/results/hetero/wide/prepare-shm-consecutive.txt 2>&1
