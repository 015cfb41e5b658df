#!/bin/bash
# usage: run.sh LABEL "ENV..." ARGS...
cd "$(dirname "$0")/../../../.."
label=$1; shift; envs=$1; shift
out=$(env PDKV_LOG=error $envs .venv/bin/pdkv bench transfer --payload 64M --iters 4 "$@" 2>&1 | grep -E "^ +[0-9]+Mi")
echo "$label | $* | $out"
