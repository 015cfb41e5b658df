// Abuse guards of the tcp listener: back-off for sources that fail authentication,
// and rate-limited logging of rejected connections.
//
// Both take the current time as an argument (no clock inside), so they are unit
// tested without sleeping. Thread safety: AuthBackoff and LogLimiter are internally
// locked; any thread may call them.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace pdkv::tcp {

using GuardClock = std::chrono::steady_clock;

// Per source address: after the n-th failed authentication in a row (n > free),
// hellos from that address are refused unread for min(max_s, base_s * 2^(n-free-1))
// seconds; the first `free` failures cost nothing (a typo). A successful
// authentication clears the address; so do 2 * max_s quiet seconds. The table holds at most
// `max_sources` addresses; beyond that the entry whose window ended first is evicted.
class AuthBackoff {
 public:
  AuthBackoff(double base_s, double max_s, size_t max_sources, uint32_t free = 0)
      : base_(base_s), max_(max_s), max_sources_(max_sources), free_(free) {}
  // Seconds the source must still wait (0: may authenticate now).
  double wait_s(const std::string& source, GuardClock::time_point now);
  // Records a failed authentication; returns the new window in seconds.
  double failed(const std::string& source, GuardClock::time_point now);
  void succeeded(const std::string& source);
  size_t size() const;

 private:
  struct Entry {
    uint32_t failures = 0;
    GuardClock::time_point until{};
  };
  void evict(GuardClock::time_point now);

  const double base_, max_;
  const size_t max_sources_;
  const uint32_t free_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> table_;
};

// Lets one line through per `interval`; counts the ones it holds back.
class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::milliseconds interval) : interval_(interval) {}
  // True if a line may be logged now; *suppressed is how many were held back since
  // the last line that went through.
  bool allow(GuardClock::time_point now, uint64_t* suppressed);

 private:
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  GuardClock::time_point next_{};
  uint64_t held_ = 0;
};

}  // namespace pdkv::tcp
