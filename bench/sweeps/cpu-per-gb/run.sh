#!/bin/bash
# CPU seconds per GB beside GB/s (issue 29, item 1): the runs behind docs/benchmarks.md,
# "CPU per GB". Three runs of each transfer case, one of each heterogeneous case.
# Usage: bash bench/sweeps/cpu-per-gb/run.sh [OUTDIR]; then python bench/sweeps/cpu-per-gb/summary.py OUTDIR  (from the repo root, pdkv on PATH)
set -euo pipefail
out=${1:-bench/results/cpu-per-gb}
export UCX_NET_DEVICES=lo
for i in 1 2 3; do
  pdkv bench transfer --transport tcp --payload 64M,1G --prepare-blocks 0 --lat-iters 200 --out "$out/tcp-$i.json" | tee "$out/tcp-$i.txt"
  pdkv bench transfer --transport shm --payload 64M,1G --prepare-blocks 0 --lat-iters 200 --out "$out/shm-$i.json" | tee "$out/shm-$i.txt"
  pdkv bench transfer --transport tcp --model llama-3-70b-tp8 --payload 64M --prepare-blocks 0 --lat-iters 200 --out "$out/tcp-70b-tp8-$i.json" | tee "$out/tcp-70b-tp8-$i.txt"
done
pdkv bench transfer --transport tcp --payload 64M --prepare-blocks 0 --lat-iters 200 --compare nixl,mooncake --out "$out/compare.json" | tee "$out/compare.txt"
for t in tcp shm; do
  for spec in tp2:tp4 tp4:tp2,nhd:hnd bs16:bs32; do
    for mode in push pull; do
      pdkv bench transfer --transport $t --hetero $spec --hetero-mode $mode --payload 64M --hetero-request-tokens 0 \
        --out "$out/hetero-$t-${spec//[:,]/-}-$mode.json" | tee "$out/hetero-$t-${spec//[:,]/-}-$mode.txt"
    done
  done
done
