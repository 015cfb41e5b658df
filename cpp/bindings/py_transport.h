// py_transport.h: the trampoline through which Python classes implement
// pdkv::Transport (see py_transport.cc), and the bindings transport authors use.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "pdkv/transfer.h"
#include "pdkv/spi/transport.h"

namespace pdkv::bindings {

// The Status a Python exception stands for: a pdkv error keeps its code; anything else
// is an Internal error naming the exception and `what` raised it. GIL held.
Status status_from(const pybind11::error_already_set& e, std::string_view what);

// A transport implemented by a Python object (a pdkv.transport.Transport subclass).
// Owns a reference to it for as long as the agent holds the transport.
class __attribute__((visibility("hidden"))) PyTransport final : public Transport {
 public:
  explicit PyTransport(pybind11::object impl);  // GIL held
  ~PyTransport() override;

  std::string_view name() const override { return name_; }
  // Read once, in start(): capabilities are constant.
  TransportCaps caps() const override;
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override;
  std::string metadata_extra() const override;
  bool can_reach(const AgentMetadata& peer) const override;
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override;
  Status connect(std::shared_ptr<const Peer> peer, double timeout_s) override;
  void drop_peer(const std::string& name) override;
  Status region_added(const RegionDesc& region) override;
  void region_removed(const RegionDesc& region) override;
  Result<std::string> fetch_metadata(const std::string& address, std::string_view secret, double timeout_s) override;

 private:
  static void fail_unless_terminal(const std::shared_ptr<Transfer>& xfer, const Status& st);

  pybind11::object impl_;
  // impl_'s post and notify, bound once in start(): they run once per transfer.
  pybind11::object post_, notify_;
  std::string name_;
  TransportCaps caps_;
};

// True when `transport` was registered from Python (its post runs under the GIL).
// Call with the GIL held: the GIL guards the set of such names.
bool is_python_transport(std::string_view transport);

// Binds TransportCaps, AgentMetadata, Peer, AgentHooks, register_transport,
// default_transports and the transport-side methods of Transfer.
void bind_transport_sdk(pybind11::module_& m, pybind11::class_<Transfer, std::shared_ptr<Transfer>>& transfer);

}  // namespace pdkv::bindings
