#!/bin/bash
# Baseline for issue 30's closing note: main's code, 3 runs, 2 spinning co-runners.
# usage: bash bench/results/busy/baseline.sh [PDKV_REPO=/work/main]
REPO=${1:-/work/main}
OUT=$(cd "$(dirname "$0")" && pwd)
for i in 1 2 3; do
  f=$OUT/baseline-main-$i.txt
  { echo "# cd $REPO && .venv/bin/pdkv bench transfer --transport tcp --payload 64M --lat-iters 2000 --busy 2 --out $OUT/baseline-main-$i.json"
    echo "# $(date -u) $(cd $REPO && git rev-parse --short HEAD) uptime:$(uptime)"
    (cd $REPO && .venv/bin/pdkv bench transfer --transport tcp --payload 64M --lat-iters 2000 --busy 2 --out $OUT/baseline-main-$i.json) 2>&1
    echo "# after: uptime:$(uptime)"; } > $f
done
