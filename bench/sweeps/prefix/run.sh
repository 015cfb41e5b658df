#!/usr/bin/env bash
# Prefix reuse on session workloads (issue 28): every mode with the workers' prefix cache
# off, then on; disagg-kv = disagg behind `pdkv serve proxy --routing kv` (cache on only).
# usage: bash bench/sweeps/prefix/run.sh [OUT_DIR]   (~15 min on 2 cores; tiny-40m, generated once)
# Reports: OUT_DIR/{multi-turn-1x1,multi-turn-2x2,agentic-1x1}/report.md (section "Prefix reuse").
set -euo pipefail
out=${1:-bench/results/prefix}
pdkv=${PDKV:-.venv/bin/pdkv}
$pdkv bench serve --serve-model tiny-40m --workload multi-turn --sessions 12 --rates 0.25 \
    --modes colocated,disagg,disagg-kv --prefix-cache both --no-progress --out "$out/multi-turn-1x1"
$pdkv bench serve --serve-model tiny-40m --workload multi-turn --sessions 12 --rates 0.25 --pd 2:2 \
    --modes disagg,disagg-kv --prefix-cache both --no-progress --out "$out/multi-turn-2x2"
$pdkv bench serve --serve-model tiny-40m --workload agentic --sessions 6 --rates 0.1 \
    --modes disagg,disagg-kv --prefix-cache both --no-progress --out "$out/agentic-1x1"
