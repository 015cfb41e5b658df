#!/bin/bash
# The issue-14 hetero matrix, short runs: 64 MiB per decode rank, 4 timed rounds each.
cd /work/wt/hetero
OUT=bench/results/hetero
for transport in tcp shm; do
  for model in llama-3-8b llama-3-70b-tp8; do
    for spec in tp2:tp4 tp4:tp2 bs16:bs32 nhd:hnd; do
      name="$transport-$model-${spec//:/-}"
      PDKV_LOG=error timeout 600 .venv/bin/python -m pdkv.cli bench transfer --transport $transport --model $model \
        --hetero $spec --payload 64M --iters 4 --out $OUT/$name.json > $OUT/$name.txt 2>&1
      echo "$name rc=$?"
    done
  done
done
for transport in tcp shm; do
  for spec in tp8:tp4 tp4:tp8; do
    name="$transport-llama-3-70b-tp8-${spec//:/-}"
    PDKV_LOG=error timeout 600 .venv/bin/python -m pdkv.cli bench transfer --transport $transport --model llama-3-70b-tp8 \
      --hetero $spec --payload 64M --iters 4 --out $OUT/$name.json > $OUT/$name.txt 2>&1
    echo "$name rc=$?"
  done
done
