#!/bin/bash
# usage: bash bench/sweeps/hetero-cpu/perf_split.sh NAME het|hom SECS <pdkv bench transfer --hetero args>
# perf record -g of the initiator and target while only the hetero (or only the homogeneous) rounds are
# timed (only.py: the other side's rounds are skipped, so its figures and verification are meaningless); OUT=dir.
name=$1; which=$2; secs=$3; shift 3
cd "$(dirname "$0")/../../.."
PDKV_LOG=error .venv/bin/python bench/sweeps/hetero-cpu/only.py $which "$@" > ${OUT:-/tmp}/$name.txt 2>&1 &
bp=$!
sleep 7
pids="$bp,$(pgrep -P $bp | tr '\n' ',' | sed 's/,$//')"
perf record -g -F 1999 -o ${OUT:-/tmp}/$name.data -p "$pids" -- sleep $secs > /dev/null 2>&1
wait $bp
tail -1 ${OUT:-/tmp}/$name.txt
perf report -i ${OUT:-/tmp}/$name.data -n --no-children --sort pid -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -4
for t in $(perf report -i ${OUT:-/tmp}/$name.data -n --no-children --sort pid -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -3 | awk '{print $3}' | cut -d: -f1); do
  echo "== $t"; perf report -i ${OUT:-/tmp}/$name.data -n --no-children --tid $t --sort dso,sym -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -8
done
