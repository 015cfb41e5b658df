#!/bin/bash
# The copy with shm's across-segment runs (default) against per-segment runs
# (PDKV_BENCH_PER_SEGMENT_RUNS=1), each pair back to back; the bench's block ids are
# random, so the measured plan is the scattered one. Raw lines.
cd "$(dirname "$0")"
for model in llama-3-70b-tp8 llama-3-8b; do
for m in "--hetero tp2:tp4" "--hetero tp4:tp2" "--hetero nhd:hnd" "--hetero tp2:tp4 --hetero-mode pull"; do
./run.sh per-segment "PDKV_BENCH_PER_SEGMENT_RUNS=1" $m --transport shm --model $model
./run.sh across "X=1" $m --transport shm --model $model
done; done
