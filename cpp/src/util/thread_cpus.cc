#include "util/thread_cpus.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "util/log.h"

namespace pdkv::util {
namespace {

std::mutex g_mu;
std::vector<int> g_cpus;                 // guarded by g_mu
std::atomic<bool> g_set{false};          // fast path: nothing to apply
std::atomic<bool> g_warned{false};

cpu_set_t to_mask(const std::vector<int>& cpus) {
  cpu_set_t m;
  CPU_ZERO(&m);
  for (int c : cpus) CPU_SET(c, &m);
  return m;
}

std::string list(const std::vector<int>& cpus) {
  std::string s;
  for (int c : cpus) s += (s.empty() ? "" : ",") + std::to_string(c);
  return s;
}

}  // namespace

Status set_thread_cpus(const std::vector<int>& cpus) {
  if (cpus.empty()) {
    std::lock_guard<std::mutex> lk(g_mu);
    g_cpus.clear();
    g_set.store(false, std::memory_order_release);
    return Status::Ok();
  }
  std::vector<int> sorted = cpus;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  for (int c : sorted)
    if (c < 0 || c >= CPU_SETSIZE)
      return Status(StatusCode::kInvalidArgument,
                    "thread cpus: CPU " + std::to_string(c) + " is out of range [0, " + std::to_string(CPU_SETSIZE) + ")");
  // The kernel decides which sets a thread may take (online CPUs, the cpuset): ask it
  // on a thread of our own, so the caller's affinity is left alone.
  const cpu_set_t mask = to_mask(sorted);
  int err = 0;
  std::thread probe([&] { err = pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask); });
  probe.join();
  if (err != 0)
    return Status(StatusCode::kInvalidArgument, "thread cpus {" + list(sorted) +
                                                    "}: the kernel refuses this set for this process's threads (" +
                                                    std::strerror(err) + "): are these CPUs online and in its cpuset?");
  std::lock_guard<std::mutex> lk(g_mu);
  g_cpus = std::move(sorted);
  g_set.store(true, std::memory_order_release);
  g_warned.store(false, std::memory_order_relaxed);
  return Status::Ok();
}

std::vector<int> thread_cpus() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_cpus;
}

void apply_thread_cpus() {
  if (!g_set.load(std::memory_order_acquire)) return;
  std::vector<int> cpus;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    cpus = g_cpus;
  }
  if (cpus.empty()) return;
  const cpu_set_t mask = to_mask(cpus);
  const int err = pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask);
  if (err != 0 && !g_warned.exchange(true))
    PDKV_LOG_WARN("thread cpus {%s}: the kernel refused them for a new pdkv thread (%s); it runs where it was "
                  "started",
                  list(cpus).c_str(), std::strerror(err));
}

}  // namespace pdkv::util
