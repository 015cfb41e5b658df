#!/bin/bash
# tcp two-level runs on the wire (issue 14, docs/wire.md flag 32): prepare of one
# 4096-token request in every mode, scattered and consecutive block ids, each row
# against PDKV_BENCH_TCP_ONE_LEVEL=1 (tcp taking one-level runs, staged where the agent
# staged before) measured by a child process right before; then the transfer benchmark
# of the brief (tp2:tp4 at llama-3-70b-tp8) and NHD <-> HND at llama-3-70b, each with
# the switch right before without it.
cd "$(dirname "$0")/../../../.." || exit 1
PY=.venv/bin/python
OUT=bench/results/hetero/twolevel
mkdir -p $OUT
PDKV_LOG=error $PY bench/layout_prepare.py --transport tcp --random-ids --no-direct \
  --compare-env PDKV_BENCH_TCP_ONE_LEVEL=1 > $OUT/prepare-tcp-random.txt 2>&1
PDKV_LOG=error $PY bench/layout_prepare.py --transport tcp --no-direct \
  --compare-env PDKV_BENCH_TCP_ONE_LEVEL=1 > $OUT/prepare-tcp-consecutive.txt 2>&1
: > $OUT/transfer.txt
for spec in "tp2:tp4 --model llama-3-70b-tp8" "tp4:tp2 --model llama-3-70b-tp8" "nhd:hnd --model llama-3-70b" \
            "tp2:tp4,nhd:hnd --model llama-3-70b"; do
  for env in PDKV_BENCH_TCP_ONE_LEVEL=1 PDKV_BENCH_TCP_ONE_LEVEL=0; do
    echo "== $env pdkv bench transfer --transport tcp --hetero $spec --payload 64M --iters 4" >> $OUT/transfer.txt
    env $env PDKV_LOG=error .venv/bin/pdkv bench transfer --transport tcp --hetero $spec --payload 64M --iters 4 \
      2>&1 | tail -3 >> $OUT/transfer.txt
  done
done
