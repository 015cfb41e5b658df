// pdkv/registry.h: transport name -> factory.
//
// Transports register themselves at static-init time (in the same library; no
// dlopen yet). `available()` lists those viable on this host right now.
// Thread safety: register_transport() during static init only; the rest any time.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pdkv/config.h"
#include "pdkv/status.h"
#include "pdkv/transport.h"

namespace pdkv {

struct TransportFactory {
  std::string name;
  std::string description;
  std::function<Status()> viable;  // OK if it can run on this host, else why not
  std::function<Result<std::unique_ptr<Transport>>(const AgentConfig&)> create;
};

bool register_transport(TransportFactory f);
const TransportFactory* find_transport(const std::string& name);
std::vector<std::string> registered_transports();  // every compiled-in transport
std::vector<std::string> available_transports();   // those viable here

}  // namespace pdkv
