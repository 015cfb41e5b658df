#!/bin/bash
# tcp, where the receiver lands pieces with streaming stores (tp4:tp2 push) or the
# sender gathers them (tp2:tp4 push): 16-byte (sse) and widest (wide) back to back. Raw lines.
cd "$(dirname "$0")"
for model in llama-3-70b-tp8 llama-3-8b; do
for m in "--hetero tp4:tp2" "--hetero tp2:tp4"; do
./run.sh sse "PDKV_BENCH_PIECE_COPY=sse" $m --transport tcp --model $model
./run.sh wide "X=1" $m --transport tcp --model $model
done; done
