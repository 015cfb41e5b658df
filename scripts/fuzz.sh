#!/usr/bin/env bash
# Builds every libFuzzer target (fuzz/targets/<name>_fuzz.cc) with clang, ASan and
# UBSan into build/fuzz, then runs each for SECONDS (default 60) over a scratch copy
# of its seed corpus fuzz/corpus/<name>/ (the committed corpus is never changed).
# Fails if any target crashes, leaks, hits undefined behaviour, takes more than 10 s
# on one input or more than 2 GiB; prints the input that did it.
#
#   scripts/fuzz.sh [SECONDS]          e.g. scripts/fuzz.sh 30 (what .ci/run does)
#   FUZZ_TARGETS="metadata tcp_frame" scripts/fuzz.sh 300    only these targets
#   scripts/fuzz.sh --build-only       build and stop (.ci/run builds while `make test` runs)
#   FUZZ_JOBS=1 scripts/fuzz.sh 60     one target at a time (default: nproc at once;
#                                      each target is one single-threaded libFuzzer process)
#
# Reproduce a failure: build/fuzz/fuzz/<name>_fuzz <crash file>  (runs that one input)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_ONLY=0
if [ "${1:-}" = --build-only ]; then BUILD_ONLY=1; shift; fi
SECONDS_PER_TARGET=${1:-60}
JOBS=${FUZZ_JOBS:-$(nproc)}
case $SECONDS_PER_TARGET in '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2 ;; esac
BUILD=build/fuzz
RUN=$BUILD/run

CXX_CLANG=${CLANGXX:-clang++}
if ! command -v "$CXX_CLANG" >/dev/null 2>&1; then
  echo "fuzz: $CXX_CLANG not found; install clang and libclang-rt-14-dev (scripts/sysdeps.sh)" >&2
  exit 1
fi
GEN=()
command -v ninja >/dev/null 2>&1 && [ ! -f "$BUILD/CMakeCache.txt" ] && GEN=(-G Ninja)

# PDKV_NVCC=OFF: the fuzzers need no GPU kernel; skipping nvcc keeps the build short.
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_CXX_COMPILER="$CXX_CLANG" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPDKV_BUILD_PYTHON=OFF -DPDKV_BUILD_FUZZERS=ON -DPDKV_NVCC=OFF >"$BUILD.configure.log" 2>&1 ||
  { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" >"$BUILD.build.log" 2>&1 || { tail -n 60 "$BUILD.build.log"; exit 1; }
if [ $BUILD_ONLY = 1 ]; then
  echo "fuzz: targets built in $BUILD/fuzz"
  exit 0
fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# One run of a target over a scratch copy of its corpus; its exit status is the fuzzer's.
run_target() {
  local name=$1 work=$RUN/$1
  "$BUILD/fuzz/${name}_fuzz" "$work/corpus" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/" -print_final_stats=1 >"$work/log" 2>&1
}

names=()
# One run per source file (a binary left in build/ by a removed target is not run).
for src in fuzz/targets/*_fuzz.cc; do
  name=$(basename "$src" _fuzz.cc)
  if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $name "* ]]; then continue; fi
  names+=("$name")
  work=$RUN/$name
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  if [ -d "fuzz/corpus/$name" ]; then
    cp -r "fuzz/corpus/$name/." "$work/corpus/"
    seeds=$(find "$work/corpus" -type f | wc -l)
  else
    seeds=0
    echo "fuzz: $name has no seed corpus (fuzz/corpus/$name/); starting from nothing"
  fi
  echo "fuzz: $name for ${SECONDS_PER_TARGET}s ($seeds seeds)"
done

# Up to JOBS targets at once; each one's exit status lands in its work dir.
for name in "${names[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  ( set +e; run_target "$name"; echo $? >"$RUN/$name/rc" ) &
done
wait

failed=()
for name in "${names[@]}"; do
  work=$RUN/$name
  rc=$(cat "$work/rc" 2>/dev/null || echo 1)
  if [ "$rc" -ne 0 ]; then
    failed+=("$name")
    echo "fuzz: FAILED $name (exit $rc); last lines of $work/log:"
    tail -n 40 "$work/log" | sed 's/^/    /'
    for a in "$work"/artifacts/*; do
      [ -e "$a" ] && echo "fuzz: $name failing input: $a  (reproduce: $BUILD/fuzz/${name}_fuzz $a)"
    done
  else
    echo "fuzz: $name passed"
    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::new_units_added)' "$work/log" | sed 's/^/    /' || true
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: all targets ran ${SECONDS_PER_TARGET}s without a finding"
