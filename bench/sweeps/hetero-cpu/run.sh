#!/bin/bash
# Issue 29 item 4: CPU per GB of every heterogeneous case over its homogeneous transfer, same run.
# Usage (repo root, pdkv's venv): bash bench/sweeps/hetero-cpu/run.sh OUTDIR [RUNS]
#   then: python bench/sweeps/hetero-cpu/summary.py OUTDIR
set -uo pipefail
out=${1:?outdir}; runs=${2:-3}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  for t in ${TRANSPORTS:-tcp shm}; do
    for spec in tp2:tp4 tp4:tp2 nhd:hnd bs16:bs32; do
      for mode in push pull; do
        name="$t-${spec//:/-}-$mode-$i"
        cmd="pdkv bench transfer --transport $t --hetero $spec --hetero-mode $mode --payload 64M --hetero-request-tokens 0 --out $out/$name.json"
        { echo "# $cmd"; echo "# $(uptime)"; PDKV_LOG=error timeout 300 "$PY" -m pdkv.cli ${cmd#pdkv }; } > "$out/$name.txt" 2>&1
        echo "$name rc=$?"
      done
    done
  done
done
