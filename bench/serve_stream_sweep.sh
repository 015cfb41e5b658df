#!/usr/bin/env bash
# `pdkv bench serve --compare-stream` (issue 15): the same trace against disagg with
# layer-wise streaming and with one write after prefill (--no-stream-layers), in one
# run per (model, link), each worker on its own netlab host behind the link (root).
# One report directory per run under OUT/serve-<model>-<prompt>-<link>/ (report.md,
# results.json, stream_comparison.json).
#   bash bench/serve_stream_sweep.sh [OUT] [REQUESTS]
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
# One request at a time (rate well below a prefill's time), so the comparison is of
# the transfer, not of queueing.
run tiny-40m 1024 100mbit 0.1
run tiny-40m 1024 1gbit 0.1
if [[ ${SMOLLM2:-0} == 1 ]]; then
  run smollm2 1024 100mbit 0.05
  run smollm2 1024 1gbit 0.05
fi
