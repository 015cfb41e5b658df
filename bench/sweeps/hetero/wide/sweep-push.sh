#!/bin/bash
# shm tp2:tp4 push (issue 14's remaining shm mode), 16-byte (sse: before) and widest
# (wide: after) streaming stores back to back, three times per model. Raw lines.
cd "$(dirname "$0")"
for rep in 1 2 3; do
for model in llama-3-70b-tp8 llama-3-8b; do
./run.sh sse "PDKV_BENCH_PIECE_COPY=sse" --hetero tp2:tp4 --transport shm --model $model
./run.sh wide "X=1" --hetero tp2:tp4 --transport shm --model $model
done; done
