#!/usr/bin/env bash
# The quiet-machine measurements of the 2026-12-02 evening stop, one after another,
# nothing else running: the connector's 1 MiB pull (x2), tcp at 4 KiB extents (x3),
# shm and tcp heterogeneous vs homogeneous in every issue-14 mode (x2 each).
# Usage: bash bench/sweeps/session-1202b/quiet.sh   (from the repo root; ~25 min)
set -u
OUT=bench/results/session-1202b
mkdir -p "$OUT"
export PDKV_LOG=error UCX_NET_DEVICES=lo
for i in 1 2; do
  echo "== shm_engine --vllm run $i load=$(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/python -m pdkv.lab.transfer.shm_engine --vllm --json > "$OUT/shm_engine-$i.json"
  .venv/bin/python - "$OUT/shm_engine-$i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d["vllm_pull"].items():
    print(name, json.dumps(r["us"]), "connector/bench transfer:", r["connector_vs_bench_transfer"])
PY
done
for i in 1 2 3; do
  echo "== tcp llama-3-70b-tp8 (4 KiB block-halves) run $i load=$(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/pdkv bench transfer --transport tcp --model llama-3-70b-tp8 --payload 64M --prepare-blocks 0 \
    --out "$OUT/tcp-70b-tp8-$i.json" 2>&1 | grep -E 'Mi |latency'
done
for transport in shm tcp; do
  for r in 1 2; do
    for model in llama-3-8b llama-3-70b-tp8; do
      for spec in tp2:tp4 tp4:tp2 bs16:bs32 nhd:hnd; do
        for mode in push pull; do
          line=$(.venv/bin/pdkv bench transfer --transport $transport --hetero "$spec" --hetero-mode "$mode" \
                 --model "$model" --payload 64M --iters 4 --hetero-request-tokens 0 2>&1 | grep -E '^ +[0-9]+Mi')
          echo "hetero transport=$transport round=$r model=$model spec=$spec mode=$mode load=$(cut -d' ' -f1 /proc/loadavg) | $line"
        done
      done
    done
  done
done
