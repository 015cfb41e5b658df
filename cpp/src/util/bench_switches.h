// Benchmark switches: the one table of environment variables that select an older
// path in the same build, so a benchmark compares both in one run (docs/benchmarks.md
// has the measurements behind each). They are A/B switches for benchmarks, never
// settings: a real setting is an option field (pdkv/options/*.h).
//
// This is the only place pdkv reads a PDKV_BENCH_* variable (tests/test_bench_switches.py
// greps the sources): every switch is declared here with its meaning and default, all
// are read together once, on first use (agent creation reads them, so never on a
// transfer's path), and `pdkv info` lists them with their values in force.
// Thread safety: the table is built once (a function-local static), then read-only.
#pragma once

#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

namespace pdkv::util {

enum class BenchSwitch : int {
  kPieceCopy,        // PDKV_BENCH_PIECE_COPY
  kDevicePieces,     // PDKV_BENCH_DEVICE_PIECES
  kShmOneLevel,      // PDKV_BENCH_SHM_ONE_LEVEL
  kTcpPieceIovecs,   // PDKV_BENCH_TCP_PIECE_IOVECS
  kTcpOneLevel,      // PDKV_BENCH_TCP_ONE_LEVEL
  kNoStaging,        // PDKV_BENCH_NO_STAGING
  kStagingByPieces,  // PDKV_BENCH_STAGING_BY_PIECES
  kPerSegmentRuns,   // PDKV_BENCH_PER_SEGMENT_RUNS
  kWaitYield,        // PDKV_BENCH_WAIT_YIELD
  kFreshPlan,        // PDKV_BENCH_FRESH_PLAN
  kCount,
};

struct BenchSwitchInfo {
  const char* name;     // the environment variable
  const char* values;   // what it may be set to ("1", "memcpy|sse")
  const char* meaning;  // the path it selects when set
  const char* dflt;     // the path when unset
};

// Every switch, in BenchSwitch order.
inline constexpr std::array<BenchSwitchInfo, static_cast<size_t>(BenchSwitch::kCount)> kBenchSwitches{{
    {"PDKV_BENCH_PIECE_COPY", "memcpy|sse",
     "strided piece copies (shm, tcp landing/gather, staging) use a memcpy per piece (memcpy) or 16-byte "
     "streaming stores (sse)",
     "the widest streaming stores the CPU has (AVX-512, AVX2, SSE)"},
    {"PDKV_BENCH_DEVICE_PIECES", "1", "device strided copies go one cuMemcpyAsync per piece",
     "the strided-copy CUDA kernel"},
    {"PDKV_BENCH_SHM_ONE_LEVEL", "1", "shm takes one-level runs only (the agent expands two-level runs)",
     "shm takes two-level runs"},
    {"PDKV_BENCH_TCP_PIECE_IOVECS", "1", "tcp prepare lists one iovec per local piece of a strided run",
     "strided runs walked lazily"},
    {"PDKV_BENCH_TCP_ONE_LEVEL", "1", "tcp takes one-level runs only (the agent expands two-level runs)",
     "tcp takes two-level runs"},
    {"PDKV_BENCH_NO_STAGING", "1", "every heterogeneous plan is direct (no staging through a buffer)",
     "a fragmented plan is staged where that is cheaper"},
    {"PDKV_BENCH_STAGING_BY_PIECES", "1",
     "the staging choice counts one extent per local piece of a run (as before lazy tcp runs)",
     "the staging choice counts runs as the transport takes them"},
    {"PDKV_BENCH_PER_SEGMENT_RUNS", "1", "two-level runs stay inside one (layer, part)",
     "two-level runs span segments (plan_across_segments)"},
    {"PDKV_BENCH_WAIT_YIELD", "1", "Transfer::wait's spin yields the CPU (sched_yield) each step",
     "the spin pauses (CPU pause hints)"},
    {"PDKV_BENCH_FRESH_PLAN", "1", "every prepare plans into a fresh vector", "plan vectors are reused"},
}};

// The values in force: each switch's environment variable, read once for all of them
// on first use ("" when unset).
inline const std::array<std::string, static_cast<size_t>(BenchSwitch::kCount)>& bench_switch_values() {
  static const auto values = [] {
    std::array<std::string, static_cast<size_t>(BenchSwitch::kCount)> v;
    for (size_t i = 0; i < v.size(); ++i) {
      const char* e = std::getenv(kBenchSwitches[i].name);
      v[i] = e ? e : "";
    }
    return v;
  }();
  return values;
}

// The value in force of switch `s` ("" when unset).
inline std::string_view bench_switch(BenchSwitch s) { return bench_switch_values()[static_cast<size_t>(s)]; }

// True when switch `s` is set to exactly `value`.
inline bool bench_switch_is(BenchSwitch s, std::string_view value) { return bench_switch(s) == value; }

}  // namespace pdkv::util
