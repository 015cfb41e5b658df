#!/bin/bash
# Issue 30's regime as it was measured: initiator and target on one core (--pin-cpus 0,0, what
# --pin did until 2026-12-07) with a spinner on each core; engine-like churn; and the receiver's
# SO_RCVLOWAT (TcpOptions.rcvlowat_bytes, default 1 MiB) off vs on in the same regime.
# usage: bash bench/results/busy/old_placement.sh RUNS   (from the repo root)
RUNS=${1:-10}
OUT=bench/results/busy/old-placement
mkdir -p $OUT
B=".venv/bin/python bench/busy_runs.py"
A="--transport tcp --payload 64M --lat-iters 500 --prepare-blocks 0 --pin-cpus 0,0 --busy 2"
{
echo "# bash bench/results/busy/old_placement.sh $RUNS  ($(date -u), $(git rev-parse --short HEAD), uptime:$(uptime))"
echo "## rcvlowat default (1 MiB) vs 0 vs 4M, 3 runs each, alternating (JSON: per_round[].wakeups_per_payload)"
for i in 1 2 3; do
  $B --runs 1 --out $OUT/lowat-default-$i -- $A | tail -2 | head -1 | sed 's/^/lowat=1M /'
  $B --runs 1 --out $OUT/lowat-0-$i -- $A --rcvlowat 0 | tail -2 | head -1 | sed 's/^/lowat=0  /'
  $B --runs 1 --out $OUT/lowat-4M-$i -- $A --rcvlowat 4M | tail -2 | head -1 | sed 's/^/lowat=4M /'
done
echo "## $RUNS runs with engine-like churn: $A --busy-threads 2 --busy-churn import,alloc"
$B --runs $RUNS --out $OUT/churn -- $A --busy-threads 2 --busy-churn import,alloc
echo "# end: $(date -u) uptime:$(uptime)"
} 2>&1 | tee bench/results/busy/old-placement.txt
