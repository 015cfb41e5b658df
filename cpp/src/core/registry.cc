#include "pdkv/spi/registry.h"

#include <algorithm>
#include <mutex>

namespace pdkv {
namespace {
std::vector<TransportFactory>& table() {
  static std::vector<TransportFactory> t;
  return t;
}
std::mutex& table_mu() {
  static std::mutex m;
  return m;
}
// Copies the table so that viable() (which may run Python) is called without the lock.
std::vector<TransportFactory> snapshot() {
  std::lock_guard<std::mutex> lk(table_mu());
  return table();
}
}  // namespace

bool register_transport(TransportFactory f) {
  std::lock_guard<std::mutex> lk(table_mu());
  for (auto& e : table())
    if (e.name == f.name) return false;
  table().push_back(std::move(f));
  return true;
}

std::optional<TransportFactory> find_transport(const std::string& name) {
  std::lock_guard<std::mutex> lk(table_mu());
  for (auto& e : table())
    if (e.name == name) return e;
  return std::nullopt;
}

std::vector<std::string> registered_transports() {
  std::vector<std::string> out;
  for (auto& e : snapshot()) out.push_back(e.name);
  return out;
}

std::vector<std::string> available_transports() {
  std::vector<std::string> out;
  for (auto& e : snapshot())
    if (e.viable().ok()) out.push_back(e.name);
  return out;
}

std::vector<std::string> default_transports() {
  std::vector<std::pair<int, std::string>> ranked;
  for (auto& e : snapshot()) {
    const int priority = e.host_priority ? e.host_priority() : e.priority;
    if (priority > 0 && e.viable().ok()) ranked.emplace_back(priority, e.name);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& [p, name] : ranked) out.push_back(name);
  return out;
}

}  // namespace pdkv
