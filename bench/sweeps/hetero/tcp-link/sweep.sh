#!/usr/bin/env bash
# tcp heterogeneous vs homogeneous behind an emulated link (pdkv netlab: two network
# namespaces, RATE via tc), every issue-14 mode, push and pull, R rounds; one line per
# run: bench transfer's own hetero/homogeneous ratio of that run. Needs root.
# Usage: bash bench/sweeps/hetero/tcp-link/sweep.sh [ROUNDS] [LINK] > OUT.txt
R=${1:-1}
LINK=${2:-10gbit,rtt=0.2ms}
export PDKV_LOG=error UCX_NET_DEVICES=lo
for r in $(seq "$R"); do
  for model in llama-3-8b llama-3-70b-tp8; do
    for spec in tp2:tp4 tp4:tp2 bs16:bs32 nhd:hnd; do
      for mode in push pull; do
        line=$(.venv/bin/pdkv bench transfer --transport tcp --link "$LINK" --hetero "$spec" --hetero-mode "$mode" \
               --model "$model" --payload 64M --iters 4 --hetero-request-tokens 0 2>&1 | grep -E '^ +[0-9]+Mi')
        echo "round=$r link=$LINK model=$model spec=$spec mode=$mode load=$(cut -d' ' -f1 /proc/loadavg) | $line"
      done
    done
  done
done
