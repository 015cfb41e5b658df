#!/usr/bin/env bash
# Runs Python tests against a sanitizer build of the C++ extension.
#
#   scripts/sanitize.sh asan [PYTEST ARGS]   ASan + UBSan (and LeakSanitizer): the core,
#                                            shm, bad-input, two-process and hostile-peer tests
#   scripts/sanitize.sh tsan [PYTEST ARGS]   ThreadSanitizer: the agent, thread and compressed-tcp tests
#   scripts/sanitize.sh asan tests/library/shm/test_shm.py -k alloc     only these tests
#   scripts/sanitize.sh asan --build-only    build (or bring up to date) and stop: .ci/run
#                                            builds both kinds in the background while
#                                            `make test` runs
#
# The instrumented extension lives in its own venv, build/sanitize/<kind>/venv, which
# sees the main .venv's packages (pytest, numpy) through a .pth line but not its
# editable pdkv, so .venv and its normal build are left alone. The sanitizer runtime
# (g++'s, matching the compiler that builds the extension) is LD_PRELOADed into
# python, and inherited by the peer processes the tests spawn. Any report fails the
# run. Needs `make install` first (the Makefile's `sanitize` target does it).
set -euo pipefail
cd "$(dirname "$0")/.."

KIND=${1:-}
shift || true
BUILD_ONLY=0
if [ "${1:-}" = --build-only ]; then
  BUILD_ONLY=1
  shift
fi
case $KIND in
  asan)
    FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
    RUNTIME=libasan.so
    # Every file that exists of these (some are added by other work in progress).
    CANDIDATES="tests/library/test_agent.py tests/library/shm/test_shm.py tests/library/tcp/test_bad_input.py tests/library/test_two_process.py
                tests/library/tcp/test_hostile_tcp.py tests/library/shm/test_shm_trust.py tests/library/test_api_validation.py tests/library/test_threads.py
                tests/library/test_codec.py tests/library/tcp/test_compress_tcp.py tests/library/shm/test_shm_engine_memory.py
                tests/library/test_codec_kernels.py tests/library/tcp/test_hetero_strided_hostile.py tests/library/tcp/test_compress_read.py
                tests/library/tcp/test_hetero_strided_landing.py tests/library/test_hetero_strided.py tests/library/shm/test_shm_strided2.py
                tests/library/tcp/test_tcp_small_extents.py tests/library/test_generations.py tests/library/shm/test_shm_gen_table.py
                tests/library/shm/test_shm_notify_on_send.py tests/library/tcp/test_tcp_two_level.py tests/library/tcp/test_handshake_auth.py
                tests/library/tcp/test_tcp_tls.py tests/library/shm/test_shm_identity.py tests/library/shm/test_shm_fd_seals.py tests/library/shm/test_shm_peer_bounds.py"
    ;;
  tsan)
    FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
    RUNTIME=libtsan.so
    CANDIDATES="tests/library/test_agent.py tests/library/test_threads.py tests/library/tcp/test_compress_tcp.py tests/library/tcp/test_compress_read.py
                tests/library/shm/test_shm_strided2.py tests/library/test_generations.py tests/library/test_thread_cpus.py
                tests/library/shm/test_shm_gen_table.py tests/library/shm/test_shm_notify_on_send.py tests/library/tcp/test_handshake_auth.py
                tests/library/tcp/test_tcp_tls.py"
    ;;
  *)
    echo "usage: $0 asan|tsan [pytest args]" >&2
    exit 2
    ;;
esac

MAIN_PY=.venv/bin/python
if [ ! -x "$MAIN_PY" ]; then
  echo "sanitize: no .venv; run 'make install' first" >&2
  exit 1
fi
if ! "$MAIN_PY" -c 'import scikit_build_core, pybind11' 2>/dev/null; then
  echo "sanitize: .venv lacks the build backend; run: .venv/bin/pip install 'scikit-build-core>=0.10' 'pybind11>=2.13'" >&2
  exit 1
fi
CXX=${CXX:-g++}
PRELOAD=$("$CXX" -print-file-name="$RUNTIME")
if [ ! -f "$PRELOAD" ]; then
  echo "sanitize: $CXX has no $RUNTIME (install g++'s sanitizer runtimes)" >&2
  exit 1
fi
# python is a C program: without libstdc++ loaded at start-up the runtime cannot
# intercept C++ throws (ASan: CHECK failed ... real___cxa_throw), so preload it too.
PRELOAD="$PRELOAD:$("$CXX" -print-file-name=libstdc++.so.6)"

ROOT=build/sanitize/$KIND
VENV=$ROOT/venv
if [ ! -x "$VENV/bin/python" ]; then
  base=$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')
  "$base" -m venv --without-pip "$VENV"
  main_site=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  san_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A plain path line: .venv's packages become importable, but its .pth files (the
  # editable pdkv's import hook) are not run.
  realpath "$main_site" >"$san_site/_pdkv_main_venv.pth"
fi

echo "sanitize: building the $KIND extension into $ROOT"
# pip and the build backend come from .venv (through the .pth line); the wheel is
# installed into $VENV only. PDKV_NVCC=OFF: no GPU kernel is needed here.
# -O1 -g1: what the sanitizers' own docs advise (-O1 keeps the instrumented tests fast,
# -g1's line tables give symbolized reports) and a third less compile time than -O2 -g.
CXX="$CXX" "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps --no-compile \
  -C build-dir="$ROOT/cmake" -C cmake.build-type=RelWithDebInfo \
  -C cmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -C cmake.define.CMAKE_CXX_FLAGS="$FLAGS" -C cmake.define.PDKV_NVCC=OFF . >"$ROOT/build.log" 2>&1 ||
  { tail -n 60 "$ROOT/build.log"; exit 1; }

where=$("$VENV/bin/python" -c 'import pdkv, os; print(os.path.realpath(pdkv.__file__))')
case $where in
  "$(realpath "$VENV")"/*) ;;
  *) echo "sanitize: 'import pdkv' found $where, not the $KIND build in $VENV" >&2; exit 1 ;;
esac

if [ $BUILD_ONLY = 1 ]; then
  echo "sanitize: $KIND build ready ($where)"
  exit 0
fi

FILES=()
# Test paths given after the kind replace the default list (e.g. to re-run one file).
if [ $# -eq 0 ] || [ ! -e "${1%%::*}" ]; then
  for f in $CANDIDATES; do [ -f "$f" ] && FILES+=("$f"); done
fi

SUPP=$PWD/scripts/lsan.supp
TSAN_SUPP=$PWD/scripts/tsan.supp
# ASan, LSan and TSan reports are written to files, one per process, printed below;
# UBSan's go to stderr, which pytest leaves alone (--capture=sys: only Python-level
# output is captured, so a report from a process a sanitizer stops is never lost).
REPORTS=$PWD/$ROOT/reports
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
LOG="log_path=$REPORTS/$KIND"
export PDKV_LOG=${PDKV_LOG:-error}
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=66:$LOG"
# A report turns into exit code 66, in this process and
# in every peer process the tests start (they inherit LD_PRELOAD and these options).
export ASAN_OPTIONS="$LOG:detect_leaks=1:exitcode=66:abort_on_error=0:strict_init_order=1:detect_stack_use_after_return=0"
# use_tls=0: LeakSanitizer's tracer crashes scanning thread-local storage once the
# loader has resized the threads' DTV (many dlopen'ed libraries with TLS: NIXL, UCX);
# without TLS as roots it can only report more, never fewer, leaks (the loader's own
# allocations it then reports are suppressed in lsan.supp).
export LSAN_OPTIONS="suppressions=$SUPP:print_suppressions=0:exitcode=66:use_tls=0"
# tsan.supp: only glibc's dynamic-TLS free of a finished thread (a known false report).
export TSAN_OPTIONS="$LOG:halt_on_error=1:exitcode=66:second_deadlock_stack=1:report_signal_unsafe=0:suppressions=$TSAN_SUPP:print_suppressions=0"
# tests/conftest.py then blocks `import torch`: the few tests that use it skip with a
# reason (torch's own import-time allocations and threads are not pdkv's to check).
export PDKV_SANITIZER=$KIND

echo "sanitize: $KIND over ${FILES[*]} $*"
set +e
# -p no:benchmark: pytest-benchmark runs `git` at start-up, and git's own leaks would be
# reported (the preloaded runtime reaches every child process, not only python ones).
LD_PRELOAD=$PRELOAD "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:benchmark --capture=sys "${FILES[@]}" "$@"
rc=$?
set -e
for r in "$REPORTS"/*; do
  [ -s "$r" ] || continue
  echo "sanitize: report $r:"
  cat "$r"
  [ $rc -ne 0 ] || rc=66  # a report from a peer process whose exit status no test checked
done
if [ $rc -ne 0 ]; then
  echo "sanitize: $KIND FAILED (exit $rc; 66 = a sanitizer report, see above)"
  exit $rc
fi
echo "sanitize: $KIND passed"
