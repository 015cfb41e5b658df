// Guards for Unix-socket control listeners (shm, cuda_ipc): a global back-off for
// failed handshakes and rate-limited warnings.
//
// On a Unix socket every client has the same uid and pids are cheap, so a
// per-source limit means nothing: failures are counted globally in a token bucket.
// While tokens last a rejected hello is answered at once; once they run out each
// rejection is held back (`delay_s`) before the error is sent and the connection
// closed, so the guess rate is bounded by (pending-connection cap / delay).
// A correct secret is never delayed.
//
// Thread safety: both classes lock internally.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace pdkv::util {

class HandshakeThrottle {
 public:
  using Clock = std::chrono::steady_clock;
  HandshakeThrottle(double burst = 20, double refill_per_s = 5, double delay_s = 1.0)
      : burst_(burst), refill_(refill_per_s), delay_(delay_s), tokens_(burst) {}
  // Records one failed handshake at `now`; returns how long to hold the rejection.
  Clock::duration on_failure(Clock::time_point now) {
    std::lock_guard<std::mutex> lk(mu_);
    refill(now);
    if (tokens_ >= 1) {
      tokens_ -= 1;
      return Clock::duration::zero();
    }
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay_));
  }

 private:
  void refill(Clock::time_point now) {
    if (last_ != Clock::time_point{}) {
      const double dt = std::chrono::duration<double>(now - last_).count();
      tokens_ = std::min(burst_, tokens_ + dt * refill_);
    }
    last_ = now;
  }
  std::mutex mu_;
  const double burst_, refill_, delay_;
  double tokens_;
  Clock::time_point last_{};
};

// At most one line per `period`; the next line that gets through reports how many
// were suppressed in between.
class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogLimiter(double period_s = 1.0)
      : period_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(period_s))) {}
  // True: log now, and *suppressed is how many calls were dropped since the last line.
  bool allow(Clock::time_point now, uint64_t* suppressed) {
    std::lock_guard<std::mutex> lk(mu_);
    if (logged_once_ && now - last_ < period_) {
      ++suppressed_;
      return false;
    }
    logged_once_ = true;
    last_ = now;
    *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  std::mutex mu_;
  const Clock::duration period_;
  bool logged_once_ = false;
  Clock::time_point last_{};
  uint64_t suppressed_ = 0;
};

}  // namespace pdkv::util
