#include "transport/tcp/guard.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace pdkv::tcp {

namespace {

double remaining_s(GuardClock::time_point until, GuardClock::time_point now) {
  return until <= now ? 0.0 : std::chrono::duration<double>(until - now).count();
}

}  // namespace

double AuthBackoff::wait_s(const std::string& source, const std::string& name, GuardClock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  if (it == table_.end()) return 0.0;
  const Source& s = it->second;
  double wait = remaining_s(s.whole.until, now);
  auto n = s.names.find(name);
  if (n != s.names.end()) wait = std::max(wait, remaining_s(n->second.until, now));
  return wait;
}

double AuthBackoff::failed(const std::string& source, const std::string& name, GuardClock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  if (it == table_.end()) {
    if (table_.size() >= max_sources_) evict(now);
    it = table_.emplace(source, Source{}).first;
  }
  Source& s = it->second;
  auto n = s.names.find(name);
  if (n == s.names.end()) {
    for (auto q = s.names.begin(); q != s.names.end();) {  // make room: forget names long quiet
      q = quiet(q->second, now) ? s.names.erase(q) : std::next(q);
    }
    if (s.names.size() >= names_per_source_) return charge(s.whole, 0, now);
    n = s.names.emplace(name, Entry{}).first;
  }
  return charge(n->second, free_, now);
}

void AuthBackoff::succeeded(const std::string& source, const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  if (it == table_.end()) return;
  it->second.names.erase(name);
  if (it->second.names.empty() && it->second.whole.failures == 0) table_.erase(it);
}

size_t AuthBackoff::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return table_.size();
}

size_t AuthBackoff::names(const std::string& source) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(source);
  return it == table_.end() ? 0 : it->second.names.size();
}

double AuthBackoff::charge(Entry& e, uint32_t free, GuardClock::time_point now) const {
  if (quiet(e, now)) e.failures = 0;  // quiet for long enough: start over
  if (e.failures < free + 64) ++e.failures;
  if (e.failures <= free) {
    e.until = now;
    return 0.0;
  }
  const double window = std::min(max_, base_ * std::ldexp(1.0, static_cast<int>(e.failures - free) - 1));
  e.until = now + std::chrono::duration_cast<GuardClock::duration>(std::chrono::duration<double>(window));
  return window;
}

bool AuthBackoff::quiet(const Entry& e, GuardClock::time_point now) const {
  return e.failures > 0 && e.until + std::chrono::duration_cast<GuardClock::duration>(
                                         std::chrono::duration<double>(2 * max_)) < now;
}

GuardClock::time_point AuthBackoff::ends(const Source& s) {
  GuardClock::time_point t = s.whole.until;
  for (const auto& [name, e] : s.names) t = std::max(t, e.until);
  return t;
}

void AuthBackoff::evict(GuardClock::time_point now) {
  // Drop every address whose windows are all over; if none is, the one that ends first.
  for (auto it = table_.begin(); it != table_.end();) {
    if (ends(it->second) <= now) {
      it = table_.erase(it);
    } else {
      ++it;
    }
  }
  if (table_.size() < max_sources_) return;
  auto first = std::min_element(table_.begin(), table_.end(),
                                [](const auto& a, const auto& b) { return ends(a.second) < ends(b.second); });
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
