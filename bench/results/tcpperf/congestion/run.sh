#!/usr/bin/env bash
# pdkv and the socket pairs with the system's congestion control (bbr on the 2026-12-08 VM)
# and with TcpOptions.congestion_control cubic / reno, alternating invocations, 3 rounds each.
#   bash bench/results/tcpperf/congestion/run.sh
set -euo pipefail
out=bench/results/tcpperf/congestion
for i in 1 2 3; do
  for cc in bbr cubic reno; do
    name="$cc-$i"
    echo "# .venv/bin/pdkv bench transfer --transport tcp --payload 64M,1G --lat-iters 500 --prepare-blocks 0 --congestion-control $cc (build $(git rev-parse --short HEAD), load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee "$out/$name.txt"
    .venv/bin/pdkv bench transfer --transport tcp --payload 64M,1G --lat-iters 500 --prepare-blocks 0 \
      --congestion-control "$cc" --out "$out/$name.json" | tee -a "$out/$name.txt"
  done
done
