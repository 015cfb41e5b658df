#include "transport/tcp/guard.h"

#include <algorithm>
#include <cmath>

namespace pdkv::tcp {

double AuthBackoff::wait_s(const std::string& source, GuardClock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  if (it == table_.end() || it->second.until <= now) return 0.0;
  return std::chrono::duration<double>(it->second.until - now).count();
}

double AuthBackoff::failed(const std::string& source, GuardClock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  if (it == table_.end()) {
    if (table_.size() >= max_sources_) evict(now);
    it = table_.emplace(source, Entry{}).first;
  } else if (it->second.until + std::chrono::duration<double>(2 * max_) < now) {
    it->second.failures = 0;  // quiet for long enough: start over
  }
  Entry& e = it->second;
  if (e.failures < free_ + 64) ++e.failures;
  if (e.failures <= free_) {
    e.until = now;
    return 0.0;
  }
  const double window = std::min(max_, base_ * std::ldexp(1.0, static_cast<int>(e.failures - free_) - 1));
  e.until = now + std::chrono::duration_cast<GuardClock::duration>(std::chrono::duration<double>(window));
  return window;
}

void AuthBackoff::succeeded(const std::string& source) {
  std::lock_guard<std::mutex> lk(mu_);
  table_.erase(source);
}

size_t AuthBackoff::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return table_.size();
}

void AuthBackoff::evict(GuardClock::time_point now) {
  // Drop every entry whose window is over; if none is, the one that ends first.
  for (auto it = table_.begin(); it != table_.end();) {
    if (it->second.until <= now) {
      it = table_.erase(it);
    } else {
      ++it;
    }
  }
  if (table_.size() < max_sources_) return;
  auto first = std::min_element(table_.begin(), table_.end(),
                                [](const auto& a, const auto& b) { return a.second.until < b.second.until; });
  table_.erase(first);
}

bool LogLimiter::allow(GuardClock::time_point now, uint64_t* suppressed) {
  std::lock_guard<std::mutex> lk(mu_);
  if (now < next_) {
    ++held_;
    return false;
  }
  next_ = now + interval_;
  *suppressed = held_;
  held_ = 0;
  return true;
}

}  // namespace pdkv::tcp
