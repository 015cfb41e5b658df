#!/usr/bin/env bash
# Transfer::wait's spin: pause (default) vs sched_yield (PDKV_BENCH_WAIT_YIELD=1), a 4 KiB
# tcp write's post().wait() alone and with a busy process pinned to the waiter's core.
# Usage: bash bench/sweeps/session-1202b/wait_shared_core.sh [ROUNDS]
R=${1:-9}
for r in $(seq "$R"); do
  for y in 0 1; do
    echo "yield=$y $(PDKV_BENCH_WAIT_YIELD=$y PDKV_LOG=error .venv/bin/python bench/sweeps/session-1202b/wait_shared_core.py | tr '\n' ' ')"
  done
done
