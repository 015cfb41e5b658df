#!/bin/bash
# tcp TP head splits, three plans in one build, each trio run back to back:
#   staged = PDKV_BENCH_STAGING_BY_PIECES=1 (the choice before lazy runs: staged where
#            this side's pieces are apart), lazy = the default (direct, runs walked
#            lazily), listed = PDKV_BENCH_NO_STAGING=1 PDKV_BENCH_TCP_PIECE_IOVECS=1
#            (direct, one iovec per local piece: the previous direct plan).
cd "$(dirname "$0")"
for model in llama-3-70b-tp8 llama-3-8b; do
for m in "--hetero tp2:tp4" "--hetero tp4:tp2" "--hetero tp2:tp4 --hetero-mode pull" "--hetero tp4:tp2 --hetero-mode pull"; do
./run.sh staged "PDKV_BENCH_STAGING_BY_PIECES=1" $m --transport tcp --model $model
./run.sh lazy "X=1" $m --transport tcp --model $model
./run.sh listed "PDKV_BENCH_NO_STAGING=1 PDKV_BENCH_TCP_PIECE_IOVECS=1" $m --transport tcp --model $model
done; done
