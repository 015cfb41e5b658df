#!/usr/bin/env bash
# One-command proof of pdkv's CUDA paths on a GPU machine (< 5 minutes):
#   bench/gpu_check.sh
# Runs the CUDA tests (cuda_ipc between two processes on one device, tcp staging of
# device memory in every direction, and the fake-driver tests), then measures cuda_ipc
# GB/s against a device-to-device copy of the same scattered blocks, and staged tcp
# from GPU pools against tcp from host pools, in the same run; then compressed tcp
# writes of GPU pools (fp8 quantized on the GPU: bit-exact vs the host codec, GB/s
# plain vs fp8); then heterogeneous (tp4:tp2, tp2:tp4) device pushes over cuda_ipc and
# tcp staging vs homogeneous vs the old per-piece path (bench/gpu_hetero.py); then
# `pdkv doctor` and device pools from Agent.alloc(nbytes, device=N) through cuda-python
# (issue 32: the devices, peer matrix and two-process CUDA IPC doctor reports; pools moved
# bit exact over tcp staging and cuda_ipc). Writes
# ${OUT:-.}/gpu_check.json. Uses $PYTHON, else .venv/bin/python, else python3; builds
# pdkv only when it is missing, without network access (the lent H200 machines have
# python3 with torch, numpy, pybind11, scikit-build-core, cmake, ninja, nvcc and pytest):
#   device run: bash bench/gpu_check.sh   (timeout_s 600; results come back from $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
nvidia-smi -L || { echo "no NVIDIA GPU here"; exit 1; }
# Offline: build against what is installed (pybind11, scikit-build-core, cmake, numpy, pytest).
$PY -c "import pdkv" 2>/dev/null || $PY -m pip install -q --no-build-isolation --no-deps -e .
$PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || \
  echo "note: torch with CUDA is missing; the torch-based GPU tests and gpu_bench.py need it (pip install torch)"
rc=0
$PY -m pytest tests/library/cuda -v -p no:cacheprovider || rc=$?   # measure even when a check fails
if $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  $PY bench/gpu_bench.py --out "${OUT:-.}/gpu_check.json"
fi
$PY -m pdkv.cli bench transfer --transport tcp --memory cuda --payload 256M,1G --prepare-blocks 0 \
  --out "${OUT:-.}/gpu_tcp_staging.json"
# FP8 of device memory as CUDA kernels (issue 16): the fake-driver checks again on the real
# kernels (every dtype, lossless, every direction, exact bytes vs the host codec), then
# plain vs fp8 device writes (GB/s in one run) with every landed byte checked.
for spec in fp8:bfloat16 fp8:float16 fp8:float32 lossless:bfloat16; do
  COMPRESS=${spec%%:*} DTYPE=${spec##*:} PYTHONPATH=tests PDKV_LOG=error \
    $PY tests/library/cuda/compress_device_child.py > "${OUT:-.}/gpu_compress_${spec/:/_}.json" || rc=$?
done
$PY bench/gpu_fp8.py --mib 256 --out "${OUT:-.}/gpu_fp8.json" || rc=$?
# Heterogeneous device transfers (issue 14): tp4:tp2 and tp2:tp4 pushes of llama-3-70b
# ranks (4096 tokens, 80 layers: ~655k pieces of 512 B) over cuda_ipc and tcp staging,
# one strided-kernel launch per transfer / batch, against homogeneous pushes of the same
# bytes and the old per-piece path (PDKV_BENCH_DEVICE_PIECES=1), GB/s in one run, every
# line checked bit exact.
PDKV_LOG=error $PY bench/gpu_hetero.py --iters 3 --out "${OUT:-.}/gpu_hetero.json" || rc=$?
# pdkv doctor and device pools through cuda-python (issue 32). The lent machines are
# offline: without cuda-python installed, it comes from wheels carried with the tree in
# ${PDKV_WHEELS:-build/wheels} (fill it beforehand: pip download --no-deps -d build/wheels
# "cuda-bindings==12.*" "cuda-bindings==13.*" cuda-pathfinder), the major version of the
# driver's CUDA.
if ! $PY -c "import cuda.bindings" 2>/dev/null; then
  major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -1)
  $PY -m pip install -q --no-index --find-links "${PDKV_WHEELS:-build/wheels}" "cuda-bindings==${major}.*" \
    cuda-pathfinder || echo "note: cuda-python is missing (no wheels in ${PDKV_WHEELS:-build/wheels}): pdkv doctor's GPU facts and Agent.alloc(device=N) need it"
fi
$PY -m pdkv.cli doctor || rc=$?
$PY -m pdkv.cli doctor --json > "${OUT:-.}/gpu_doctor.json" || rc=$?
$PY - "${OUT:-.}/gpu_doctor.json" <<'EOF' || rc=$?
import json, sys
g = json.load(open(sys.argv[1]))["gpu"]
assert g["available"], f"pdkv doctor sees no GPU: {g['reason']}"
assert g["cuda_ipc"]["works"], f"CUDA IPC between two processes: {g['cuda_ipc']['detail']}"
print(f"doctor: {len(g['devices'])} device(s), driver {g['driver_version']}, CUDA IPC works")
EOF
# Device pools (Agent.alloc(nbytes, device=N), no torch) bit exact over tcp staging and cuda_ipc.
PDKV_LOG=error $PY tests/library/cuda/device_pool_child.py > "${OUT:-.}/gpu_device_pool.json" || rc=$?
cat "${OUT:-.}/gpu_device_pool.json"
exit $rc
