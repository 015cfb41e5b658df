#include "pdkv/registry.h"

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
}  // namespace

bool register_transport(TransportFactory f) {
  std::lock_guard<std::mutex> lk(table_mu());
  for (auto& e : table())
    if (e.name == f.name) return false;
  table().push_back(std::move(f));
  return true;
}

const TransportFactory* find_transport(const std::string& name) {
  std::lock_guard<std::mutex> lk(table_mu());
  for (auto& e : table())
    if (e.name == name) return &e;
  return nullptr;
}

std::vector<std::string> registered_transports() {
  std::lock_guard<std::mutex> lk(table_mu());
  std::vector<std::string> out;
  for (auto& e : table()) out.push_back(e.name);
  return out;
}

std::vector<std::string> available_transports() {
  std::vector<TransportFactory> copy;
  {
    std::lock_guard<std::mutex> lk(table_mu());
    copy = table();
  }
  std::vector<std::string> out;
  for (auto& e : copy)
    if (e.viable().ok()) out.push_back(e.name);
  return out;
}

}  // namespace pdkv
