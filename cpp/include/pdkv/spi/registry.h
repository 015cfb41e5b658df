// pdkv/spi/registry.h (SPI, for transport authors): transport name -> factory.
//
// Native transports register themselves at static-init time (one line in their .cc;
// no dlopen yet). Python transports register at run time (pdkv.register_transport),
// into the same table. `available_transports()` lists those viable on this host right
// now; `default_transports()` is the order an agent uses when none is given.
//
// A transport with options registers its options type with its factory
// (`default_options`, e.g. default_options_of<TcpOptions>): the agent hands `create`
// the options its config holds under the transport's name (AgentConfig::options), or
// those defaults, and refuses options for a transport that declares none.
// Thread safety: every function may be called from any thread (one mutex guards the
// table); a registration is never removed.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pdkv/config.h"
#include "pdkv/status.h"
#include "pdkv/spi/transport.h"

namespace pdkv {

struct TransportFactory {
  std::string name;
  std::string description;
  std::function<Status()> viable;  // OK if it can run on this host, else why not
  // Creates the transport of one agent. `options`: the transport's own options (those
  // in cfg.options under its name, else default_options()); null when the transport
  // declares no options type. The factory checks their type (options_as<T>) and
  // validates them (AgentConfig::validate did too, but a transport may be created alone).
  std::function<Result<std::unique_ptr<Transport>>(const AgentConfig& cfg, const TransportOptions* options)> create;
  // Place in the default order: viable transports with priority > 0 are enabled by
  // default, highest first (a peer uses the first that reaches it). 0: only when asked
  // for by name (examples, mocks). Native: cuda_ipc 300, shm 200, tcp 100; nixl 400.
  int priority = 0;
  // When set, replaces `priority` with one that depends on the host (nixl: 400 with an
  // RDMA device, else 0 — usable when asked for, never chosen by default over tcp).
  std::function<int()> host_priority;
  // A transport that cannot exchange metadata by address itself names one that can
  // (e.g. nixl: "tcp"); an agent enabling it without that one gets it added, last.
  std::string metadata_via;
  // The transport's options type, as its defaults (empty: it takes no options).
  std::function<std::unique_ptr<TransportOptions>()> default_options;
};

// `create` of a transport whose options type is Opts (TransportOptionsOf<Opts>):
// `make(cfg, opts)` gets them checked for type and validated.
template <typename Opts, typename Make>
std::function<Result<std::unique_ptr<Transport>>(const AgentConfig&, const TransportOptions*)> create_with(Make make) {
  return [make](const AgentConfig& cfg, const TransportOptions* options) -> Result<std::unique_ptr<Transport>> {
    const Opts defaults;
    const Opts* opts = &defaults;
    if (options != nullptr) {
      PDKV_ASSIGN_OR_RETURN(opts, options_as<Opts>(*options));
    }
    PDKV_RETURN_IF_ERROR(opts->validate());
    return make(cfg, *opts);
  };
}

// `default_options` of a transport whose options type is Opts.
template <typename Opts>
std::unique_ptr<TransportOptions> default_options_of() {
  return std::make_unique<Opts>();
}

// False (and nothing changes) when a transport of that name is registered already.
bool register_transport(TransportFactory f);
// A copy of the factory registered under `name`, or nullopt.
std::optional<TransportFactory> find_transport(const std::string& name);
std::vector<std::string> registered_transports();  // every registered transport
std::vector<std::string> available_transports();   // those viable here
std::vector<std::string> default_transports();     // viable, priority > 0, highest first

}  // namespace pdkv
