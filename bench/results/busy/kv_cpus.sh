#!/bin/bash
# Where pdkv's threads should run when the engine keeps cores busy (docs/vllm.md kv_cpus).
# Initiator pinned to CPU 0, target to CPU 1 (--pin); pdkv's threads inherit the pin unless
# --thread-cpus. Spinning co-runners: both cores (--busy 2) or core 1 only (--busy-cpus 1).
# usage: bash bench/results/busy/kv_cpus.sh RUNS   (from the repo root; writes kv_cpus.txt beside)
RUNS=${1:-3}
OUT=bench/results/busy/kv_cpus
mkdir -p $OUT
run() {  # name, args...
  local name=$1; shift
  .venv/bin/python bench/busy_runs.py --runs $RUNS --out $OUT/$name -- --transport tcp --payload 64M \
    --lat-iters 1000 --prepare-blocks 0 "$@"
}
{
echo "# bash bench/results/busy/kv_cpus.sh $RUNS  ($(date -u), $(git rev-parse --short HEAD), uptime:$(uptime))"
echo "## A. engine on both cores, pdkv threads inherit (share a core with a spinner): --busy 2"
run both-inherit --busy 2
echo "## B. engine on both cores, pdkv threads on both (kv_cpus: all): --busy 2 --thread-cpus all"
run both-all --busy 2 --thread-cpus all
echo "## C. engine on core 1 only, pdkv threads inherit (the target's share core 1): --busy 1 --busy-cpus 1"
run one-inherit --busy 1 --busy-cpus 1
echo "## D. engine on core 1 only, pdkv threads on the spare core 0: --busy 1 --busy-cpus 1 --thread-cpus 0"
run one-spare --busy 1 --busy-cpus 1 --thread-cpus 0
echo "# end: $(date -u) uptime:$(uptime)"
} 2>&1 | tee bench/results/busy/kv_cpus.txt
