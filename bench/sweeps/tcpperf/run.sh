#!/usr/bin/env bash
# issue 29, items 2-3: tcp beside the tuned socket pair (GB/s, CPU/GB) and small-write
# latency, three runs of each case, each run alternating pdkv / plain / tuned / memcpy
# (--rounds 3), beside the former single-shot measurement (--rounds 1) and the former
# gather threshold (--gather-below 8192) at 4 KiB extents.
#
#   bash bench/sweeps/tcpperf/run.sh bench/results/tcpperf
set -euo pipefail
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out"
bench() { name=$1; shift; echo "# pdkv bench transfer $* (load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$out/$name.txt"
          .venv/bin/pdkv bench transfer "$@" --out "$out/$name.json" | tee -a "$out/$name.txt"; }
for i in 1 2 3; do
  bench "tcp-32k-$i" --transport tcp --payload 64M,1G --lat-iters 2000 --prepare-blocks 0
  bench "tcp-32k-rounds1-$i" --transport tcp --payload 64M,1G --lat-iters 2000 --prepare-blocks 0 --rounds 1
  bench "tcp-4k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 2000 --prepare-blocks 0
  bench "tcp-4k-gather8k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 2000 --prepare-blocks 0 \
    --gather-below 8192
done
