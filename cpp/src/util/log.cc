#include "util/log.h"

#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace pdkv::util {

LogLevel log_level() {
  static const LogLevel lvl = [] {
    const char* e = std::getenv("PDKV_LOG");
    if (!e) return LogLevel::kWarn;
    if (!strcmp(e, "error")) return LogLevel::kError;
    if (!strcmp(e, "info")) return LogLevel::kInfo;
    if (!strcmp(e, "debug")) return LogLevel::kDebug;
    return LogLevel::kWarn;
  }();
  return lvl;
}

void log_line(LogLevel lvl, const char* fmt, ...) {
  static const char* names[] = {"E", "W", "I", "D"};
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t;
  localtime_r(&ts.tv_sec, &t);
  fprintf(stderr, "[pdkv %s %02d:%02d:%02d.%03ld] %s\n", names[static_cast<int>(lvl)], t.tm_hour, t.tm_min, t.tm_sec,
          ts.tv_nsec / 1000000, msg);
}

}  // namespace pdkv::util
