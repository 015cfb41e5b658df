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

// Back-off for failed authentications, keyed on (source address, the agent name the
// hello claims), so that a misconfigured peer (wrong secret) backs off alone and a
// good peer on the same host keeps authenticating at once.
//
// Per key: after the n-th failed authentication in a row (n > free), hellos for that
// key are refused (secret not compared) for min(max_s, base_s * 2^(n-free-1)) seconds;
// the first `free` failures cost nothing (a typo). A successful authentication clears
// the key; so do 2 * max_s quiet seconds.
//
// Names are chosen by the peer, so an address that fails under many names must not get
// a fresh back-off per name: at most `names_per_source` names are tracked per address;
// a failure under any further name is charged to the address as a whole (no free
// failures there), whose window refuses every name from it -- the old per-address
// back-off, which a success does not clear. A guesser at one address thus gets at most
// (names_per_source + 1) times the guesses of a single name.
//
// The table holds at most `max_sources` addresses; beyond that the one whose windows
// ended first is evicted.
class AuthBackoff {
 public:
  AuthBackoff(double base_s, double max_s, size_t max_sources, uint32_t free = 0, size_t names_per_source = 8)
      : base_(base_s), max_(max_s), max_sources_(max_sources), free_(free), names_per_source_(names_per_source) {}
  // Seconds a hello from `source` claiming `name` must still wait (0: may authenticate now).
  double wait_s(const std::string& source, const std::string& name, GuardClock::time_point now);
  // Records a failed authentication; returns the new window of that hello's key in seconds.
  double failed(const std::string& source, const std::string& name, GuardClock::time_point now);
  void succeeded(const std::string& source, const std::string& name);
  // The same, keyed on the address alone (a hello whose name is not known).
  double wait_s(const std::string& source, GuardClock::time_point now) { return wait_s(source, "", now); }
  double failed(const std::string& source, GuardClock::time_point now) { return failed(source, "", now); }
  void succeeded(const std::string& source) { succeeded(source, ""); }
  // Addresses tracked.
  size_t size() const;
  // Names tracked for one address (at most names_per_source).
  size_t names(const std::string& source) const;

 private:
  struct Entry {
    uint32_t failures = 0;
    GuardClock::time_point until{};
  };
  struct Source {
    Entry whole;                                   // failures under names beyond the bound
    std::unordered_map<std::string, Entry> names;  // at most names_per_source_
  };
  double charge(Entry& e, uint32_t free, GuardClock::time_point now) const;
  bool quiet(const Entry& e, GuardClock::time_point now) const;
  static GuardClock::time_point ends(const Source& s);
  void evict(GuardClock::time_point now);

  const double base_, max_;
  const size_t max_sources_;
  const uint32_t free_;
  const size_t names_per_source_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Source> table_;
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
