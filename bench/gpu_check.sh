#!/usr/bin/env bash
# One-command proof of pdkv's CUDA paths on a GPU machine (< 5 minutes):
#   bench/gpu_check.sh
# Builds pdkv, runs the CUDA tests (two processes on one device through cuda_ipc),
# then measures cuda_ipc GB/s against a device-to-device copy of the same scattered
# blocks in the same run. Writes results to ${OUT:-.}/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
nvidia-smi -L || { echo "no NVIDIA GPU here"; exit 1; }
$PY -c "import torch; assert torch.cuda.is_available(), 'torch without CUDA'" 2>/dev/null || \
  $PY -m pip install -q torch
$PY -m pip install -q -e ".[test]"
$PY -m pytest tests/cuda -v -p no:cacheprovider
$PY bench/gpu_bench.py --out "${OUT:-.}/gpu_check.json"
