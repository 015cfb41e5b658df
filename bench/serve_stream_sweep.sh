#!/usr/bin/env bash
# `pdkv bench serve --compare-stream` (issue 15): the same trace against disagg with
# layer-wise streaming and with one write after prefill (--no-stream-layers), in one
# run per (model, link), each worker on its own netlab host behind the link (root).
# One report directory per run under OUT/serve-<model>-<prompt>-<link>/ (report.md,
# results.json, stream_comparison.json).
#   bash bench/serve_stream_sweep.sh [OUT] [REQUESTS]
#   MODELS="tiny-40m smollm2" bash bench/serve_stream_sweep.sh   # default: tiny-40m
set -euo pipefail
OUT=${1:-bench/results/stream}
REQUESTS=${2:-6}
PY=${PY:-.venv/bin/python}
run() {  # model prompt_len link rate
  local link_args=() tag="serve-$1-$2-$3"
  [[ $3 != lo ]] && link_args=(--link "$3")
  echo "== $tag" >&2
  PDKV_LOG=error "$PY" -m pdkv.cli bench serve --compare-stream --serve-model "$1" --prompt-len "$2" \
    --output-len 8 --rates "$4" --arrival periodic --num-requests "$REQUESTS" --duration 600 --warmup 1 \
    --no-progress --no-plots "${link_args[@]}" --out "$OUT/$tag" >/dev/null
}
# One request at a time (arrivals further apart than a prefill plus the transfer
# takes here), so the comparison is of the transfer, not of queueing.
for model in ${MODELS:-tiny-40m}; do
  rate=0.1
  [[ $model == smollm2 ]] && rate=0.05
  for link in 100mbit 1gbit; do run "$model" 1024 "$link" "$rate"; done
done
