#!/usr/bin/env bash
# tcp TP splits and NHD<->HND with 16-byte (PDKV_BENCH_PIECE_COPY=sse) and wide streaming stores back to back.
# Usage (repo root): bash bench/sweeps/hetero/tcp-quiet/wide-vs-sse.sh > OUT.txt
export PDKV_LOG=error UCX_NET_DEVICES=lo
for r in 1 2 3; do
 for model in llama-3-8b llama-3-70b-tp8; do
  for spec in tp2:tp4 tp4:tp2 nhd:hnd; do
   for mode in push pull; do
    for how in sse wide; do
      if [ $how = sse ]; then e="PDKV_BENCH_PIECE_COPY=sse"; else e="PDKV_BENCH_X=1"; fi
      line=$(env $e .venv/bin/pdkv bench transfer --transport tcp --hetero "$spec" --hetero-mode "$mode" --model "$model" --payload 64M --iters 4 --hetero-request-tokens 0 2>&1 | grep -E '^ +[0-9]+Mi')
      echo "round=$r model=$model spec=$spec mode=$mode how=$how load=$(cut -d' ' -f1 /proc/loadavg) | $line"
    done
   done
  done
 done
done
