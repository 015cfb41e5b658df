#!/bin/bash
# shm TP head splits, 16-byte streaming stores (PDKV_BENCH_PIECE_COPY=sse: before) and the
# widest the CPU has (64-byte on the dev VM: after), each pair back to back; raw lines.
cd "$(dirname "$0")"
for rep in 1 2; do
for model in llama-3-70b-tp8 llama-3-8b; do
for m in "--hetero tp2:tp4" "--hetero tp4:tp2" "--hetero tp2:tp4 --hetero-mode pull" "--hetero tp4:tp2 --hetero-mode pull"; do
./run.sh sse "PDKV_BENCH_PIECE_COPY=sse" $m --transport shm --model $model
./run.sh wide "X=1" $m --transport shm --model $model
done; done; done
