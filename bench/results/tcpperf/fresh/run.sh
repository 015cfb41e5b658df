#!/usr/bin/env bash
# Issues 29 and 30, every tcp and shm target re-measured on a quiet machine (2026-12-08,
# a fresh 2-core VM, nothing else of ours running), 3 runs each, in one pass:
#   bash bench/results/tcpperf/fresh/run.sh && python bench/results/tcpperf/fresh/summary.py
set -euo pipefail
out=bench/results/tcpperf/fresh
bench() { name=$1; shift; echo "# .venv/bin/pdkv bench transfer $* (build $(git rev-parse --short HEAD), load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$out/$name.txt"
          .venv/bin/pdkv bench transfer "$@" --out "$out/$name.json" | tee -a "$out/$name.txt"; }
for i in 1 2 3; do
  bench "tcp-32k-$i" --transport tcp --payload 64M,1G --lat-iters 2000 --prepare-blocks 0
  bench "tcp-4k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 2000 --prepare-blocks 0
  bench "tcp-32k-busy2-$i" --transport tcp --payload 64M --lat-iters 2000 --prepare-blocks 0 --busy 2
  bench "shm-$i" --transport shm --payload 64M,1G --lat-iters 500 --prepare-blocks 0
done
