#!/usr/bin/env bash
# issue 29/30 after the --pin fix (target on the second CPU): tcp beside the tuned pair
# (32 KiB and 4 KiB extents) and the 32 KiB write with two busy co-runners, 3 runs each.
#   bash bench/results/tcpperf/pinned/run.sh
set -euo pipefail
out=bench/results/tcpperf/pinned
bench() { name=$1; shift; echo "# .venv/bin/pdkv bench transfer $* (build $(git rev-parse --short HEAD), load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$out/$name.txt"
          .venv/bin/pdkv bench transfer "$@" --out "$out/$name.json" | tee -a "$out/$name.txt"; }
for i in 1 2 3; do  # (part 1)
  bench "tcp-32k-$i" --transport tcp --payload 64M,1G --lat-iters 2000 --prepare-blocks 0
  bench "tcp-4k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 2000 --prepare-blocks 0
  bench "tcp-32k-busy2-$i" --transport tcp --payload 64M --lat-iters 2000 --prepare-blocks 0 --busy 2
done
# shm beside memcpy, and 4 KiB extents gathered (--gather-below 8192) against the default (4096: not gathered)
for i in 1 2 3; do  # (part 1)
  bench "shm-$i" --transport shm --payload 64M,1G --lat-iters 500 --prepare-blocks 0
  bench "tcp-4k-gather8k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 200 --prepare-blocks 0 --gather-below 8192
  bench "tcp-4k-default-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 200 --prepare-blocks 0
done
# after TcpOptions.land_below_bytes defaulted to 8192 (42cdd28): 4 KiB extents with the new default
for i in 1 2 3; do
  bench "tcp-4k-land8k-$i" --transport tcp --model llama-3-70b-tp8 --payload 64M --lat-iters 2000 --prepare-blocks 0
done
