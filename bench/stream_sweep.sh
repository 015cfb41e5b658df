#!/usr/bin/env bash
# Layer-wise streaming vs one write after prefill (issue 15, item 4): every
# (model, prompt length, link) of the sweep, one JSON report each under OUT.
# Links need root (pdkv netlab); "lo" is in-process loopback tcp.
#   bash bench/stream_sweep.sh [OUT] [TRIALS]
set -euo pipefail
OUT=${1:-bench/results/stream}
TRIALS=${2:-3}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
run() {  # preset prompt_len link
  local link_args=() tag="$1-$2-$3"
  [[ $3 != lo ]] && link_args=(--link "$3")
  echo "== $tag" >&2
  PDKV_LOG=error "$PY" -m pdkv.lab.serve.streambench --preset "$1" --prompt-len "$2" --trials "$TRIALS" \
    "${link_args[@]}" --out "$OUT/$tag.json" >/dev/null
}
for len in 1024 4096; do
  for link in lo 10gbit 1gbit; do run smollm2 "$len" "$link"; done
  for link in lo 1gbit; do run tiny-40m-8k "$len" "$link"; done
done
run smollm2 4096 100mbit   # where the link, not compute, sets the pace
