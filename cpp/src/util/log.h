// Minimal leveled logging to stderr. Level from env PDKV_LOG=error|warn|info|debug
// (default warn). Thread-safe (one fprintf per line).
#pragma once

#include <cstdio>

namespace pdkv::util {
enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
LogLevel log_level();
void log_line(LogLevel lvl, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
}  // namespace pdkv::util

#define PDKV_LOG_AT(lvl, ...)                                                   \
  do {                                                                          \
    if (static_cast<int>(lvl) <= static_cast<int>(::pdkv::util::log_level()))   \
      ::pdkv::util::log_line(lvl, __VA_ARGS__);                                 \
  } while (0)
#define PDKV_LOG_ERROR(...) PDKV_LOG_AT(::pdkv::util::LogLevel::kError, __VA_ARGS__)
#define PDKV_LOG_WARN(...) PDKV_LOG_AT(::pdkv::util::LogLevel::kWarn, __VA_ARGS__)
#define PDKV_LOG_INFO(...) PDKV_LOG_AT(::pdkv::util::LogLevel::kInfo, __VA_ARGS__)
#define PDKV_LOG_DEBUG(...) PDKV_LOG_AT(::pdkv::util::LogLevel::kDebug, __VA_ARGS__)
