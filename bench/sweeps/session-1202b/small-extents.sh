#!/usr/bin/env bash
# tcp at llama-3-70b-tp8 geometry (4 KiB block-halves): the sender's gather threshold
# and the receiver's landing threshold switched in one build (PDKV_BENCH_TCP_GATHER_BELOW
# / PDKV_BENCH_TCP_LAND_BELOW, docs/benchmarks.md), R rounds, configurations interleaved.
# Each line: pdkv GB/s and its ratios to the plain and tuned socket pairs of that run.
# Usage: bash bench/sweeps/session-1202b/small-extents.sh [ROUNDS]
R=${1:-3}
export PDKV_LOG=error UCX_NET_DEVICES=lo
SUMMARY='
import json, sys
r = json.loads(sys.stdin.read())
r = r["results"][0] if "results" in r else r
q = r["ratios"]
print("pdkv %.2f GB/s  /plain %.2f  /tuned %.2f" % (r["gbps"], q["socket_plain"], q["socket_tuned"]))'
for r in $(seq "$R"); do
  for cfg in "8192 4096" "4096 4096" "8192 8192" "4096 8192"; do
    set -- $cfg
    out=$(PDKV_BENCH_TCP_GATHER_BELOW=$1 PDKV_BENCH_TCP_LAND_BELOW=$2 .venv/bin/pdkv bench transfer --transport tcp \
          --model llama-3-70b-tp8 --payload 64M --prepare-blocks 0 --lat-iters 100 --json 2>/dev/null | tail -1)
    echo "round=$r gather_below=$1 land_below=$2 load=$(cut -d' ' -f1 /proc/loadavg) | $(echo "$out" | .venv/bin/python -c "$SUMMARY")"
  done
done
