// Benchmark switches: environment variables that select an older path in the same
// build so a benchmark compares both in one run (docs/benchmarks.md lists them).
// Read once per process by each caller's function-local static; never for production.
#pragma once

#include <cstdlib>
#include <cstring>

namespace pdkv::util {

// True when environment variable `name` is set to exactly `value`.
inline bool bench_switch_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace pdkv::util
