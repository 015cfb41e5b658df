#!/bin/bash
# Issue 14's heterogeneous targets, short runs: 64 MiB landing on one decode rank, 4 timed
# rounds of hetero and homogeneous alternating, verified bit-exact afterwards. Writes
# <transport>-<model>-<spec>[-pull].{json,txt} here. Run from anywhere:
#   bench/sweeps/hetero/run.sh          # push (prefill ranks write)
#   MODE=pull bench/sweeps/hetero/run.sh  # pull (decode rank 0 reads)
cd "$(dirname "$0")/../../.." || exit 1
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-bench/results/hetero}
MODE=${MODE:-push}
mkdir -p "$OUT"
SUFFIX=$([ "$MODE" = pull ] && echo -pull)
run() {  # transport model spec
  local name="$1-$2-${3//:/-}$SUFFIX"
  PDKV_LOG=error timeout 600 "$PY" -m pdkv.cli bench transfer --transport "$1" --model "$2" --hetero "$3" \
    --hetero-mode "$MODE" --payload 64M --iters 4 --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?"
}
for transport in tcp shm; do
  for model in llama-3-8b llama-3-70b-tp8; do
    for spec in tp2:tp4 tp4:tp2 bs16:bs32 nhd:hnd; do run $transport $model $spec; done
  done
  # llama-3-70b at its real TP8 split on one side: 1 head per prefill (or decode) rank
  for spec in tp8:tp4 tp4:tp8; do run $transport llama-3-70b-tp8 $spec; done
done
