// Range checks shared by the options' validate() functions: each failure is an
// InvalidArgument naming the field and the bad value.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

#include "pdkv/status.h"

namespace pdkv::util {

// "1.5", "86400", "nan", "inf": shortest form that reads back as written.
inline std::string format_number(double v) {
  char buf[32];
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {  // whole seconds: "86400"
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string shortest = buf;
  for (int precision = 1; precision < 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) return buf;
  }
  return shortest;
}

// `field` must hold an integer in [lo, hi].
template <typename T>
Status check_in_range(std::string_view field, T value, T lo, T hi) {
  static_assert(std::is_integral_v<T>);
  if (value >= lo && value <= hi) return Status::Ok();
  return InvalidArgument(std::string(field) + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) +
                         ", got " + std::to_string(value));
}

// `field` must be a finite number of seconds in (0, max_s].
inline Status check_seconds(std::string_view field, double value, double max_s) {
  if (std::isfinite(value) && value > 0 && value <= max_s) return Status::Ok();
  return InvalidArgument(std::string(field) + " must be a number of seconds in (0, " + format_number(max_s) +
                         "], got " + format_number(value));
}

}  // namespace pdkv::util
