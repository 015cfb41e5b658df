// pdkv/agent.h: one named endpoint per process; the facade over regions, layouts,
// peers, transports and notifications.
//
// Typical use (initiator):
//   auto agent = Agent::create(cfg);                  // starts transports
//   auto region = agent->register_memory(addr, len, MemKind::kHost, -1, true);
//   agent->add_layout("kv", KVLayout::per_layer(geo, k_addrs, v_addrs));
//   std::string peer = agent->add_peer(blob_from_peer, secret);
//   auto prep = agent->prepare_blocks(peer, OpKind::kWrite, "kv", ids, "kv", remote_ids, {});
//   auto xfer = agent->post(*prep, "req-42", 5.0);   // async
//   xfer->wait(-1);
//
// Thread safety: every method may be called from any thread concurrently. Blocking
// calls (post when connecting, wait, deregister) never hold agent-wide locks while
// blocking.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/config.h"
#include "pdkv/kv_layout.h"
#include "pdkv/metadata.h"
#include "pdkv/notify.h"
#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/types.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transport.h"

namespace pdkv {

class Agent;

// A transfer validated and laid out once; post it as often as needed.
struct PreparedTransfer {
  std::string peer;
  std::string transport;
  OpKind op = OpKind::kWrite;
  uint64_t bytes = 0;
  uint64_t num_extents = 0;
  uint64_t instance_id = 0;             // the peer instance it was prepared for
  bool checked = false;                 // carries a block generation claim
  std::vector<uint64_t> local_regions;  // pinned at each post
  std::shared_ptr<const PreparedOps> ops;
};

// Options applied when preparing.
struct XferOptions {
  std::string transport;  // force a transport ("" = the peer's chosen one)
  // prepare_blocks only: the generations the peer handed out with the remote block
  // ids (one per remote id; empty = unchecked). The target checks them at every post
  // before any byte lands or is sent; a mismatch fails the transfer with StaleBlock.
  std::vector<uint32_t> remote_generations;
};

class Agent final : private AgentHooks {
 public:
  static Result<std::unique_ptr<Agent>> create(AgentConfig cfg);
  ~Agent() override;
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& name() const { return cfg_.name; }
  const std::string& secret() const { return cfg_.secret; }
  uint64_t instance_id() const override { return instance_id_; }
  const std::string& host_id() const override { return host_id_; }
  const AgentConfig& config() const { return cfg_; }
  std::vector<std::string> transports() const;
  std::vector<Endpoint> endpoints() const;

  // ---- memory ----
  // Registers [addr, addr+len). See region.h for overlap and lifetime rules.
  // `shm_fd` >= 0 marks the memory as a MAP_SHARED mapping of that memfd (see region.h).
  Result<RegionDesc> register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                     bool remote_access, int shm_fd = -1);
  // Removes a region; blocks until transfers using it finish. Layouts on it are removed.
  Status deregister_memory(uint64_t id);
  std::vector<RegionDesc> regions() const { return regions_.list(); }

  // ---- layouts ----
  // Binds each segment to the registered region containing it and exports it
  // under `name`. Errors: AlreadyExists, NotFound (a segment outside registered memory).
  Status add_layout(const std::string& name, KVLayout layout);
  Status remove_layout(const std::string& name);
  Result<KVLayout> layout(const std::string& name) const;
  std::vector<std::string> layout_names() const;

  // ---- block generations (see generations.h) ----
  // Current generations of blocks of a local layout.
  Result<std::vector<uint32_t>> generations(const std::string& layout, const std::vector<uint32_t>& ids) const {
    return gens_.get(layout, ids);
  }
  // Bumps the generations of distinct blocks (call it when freeing or reusing them)
  // and returns the new values once no transfer accepted under the old ones still
  // touches them; Timeout after `timeout_s` (< 0: no limit), with the bump in force.
  Result<std::vector<uint32_t>> bump_generations(const std::string& layout, const std::vector<uint32_t>& ids,
                                                 double timeout_s) {
    return gens_.bump(layout, ids, timeout_s);
  }

  // ---- metadata and peers ----
  std::string metadata();
  // Imports a peer's blob; returns its name. Re-adding a name replaces it (and drops
  // its connections). `secret`: the peer's secret ("" = ours). `transport` forces one.
  // `via_host`: the host the blob was fetched from; replaces a wildcard or loopback
  // host of a network ("host:port") endpoint that would not be reachable from here.
  Result<std::string> add_peer(std::string_view blob, std::string secret, std::string transport,
                               std::string via_host = "");
  Status remove_peer(const std::string& name);
  std::vector<std::string> peer_names() const;
  Result<std::shared_ptr<const Peer>> peer(const std::string& name) const;
  // The transport transfers to `name` use.
  Result<std::string> peer_transport(const std::string& name) const;
  // Fetches a metadata blob from "host:port" (the peer's tcp endpoint) through the first
  // enabled transport that serves metadata (caps().serves_metadata).
  Result<std::string> fetch_metadata(const std::string& address, std::string secret, double timeout_s);
  // Opens connections to a peer now (optional warm-up).
  Status connect(const std::string& name, double timeout_s);

  // ---- transfers ----
  Result<std::shared_ptr<PreparedTransfer>> prepare_blocks(
      const std::string& peer, OpKind op, const std::string& local_layout, const std::vector<uint32_t>& local_ids,
      const std::string& remote_layout, const std::vector<uint32_t>& remote_ids, const PlanOptions& plan,
      const XferOptions& opts);
  // Raw extents: local_region/offset are this agent's, remote_* the peer's exported regions.
  Result<std::shared_ptr<PreparedTransfer>> prepare_extents(const std::string& peer, OpKind op,
                                                            const std::vector<Extent>& extents,
                                                            const XferOptions& opts);
  // Posts a prepared transfer. `timeout_s` < 0 uses the default timeout; 0 = none.
  // Errors after this point arrive through the Transfer, never as a return value,
  // except for a local region deregistered since prepare (NotFound).
  Result<std::shared_ptr<Transfer>> post(const PreparedTransfer& prep, std::string notif, double timeout_s);
  // Sends only a notification to a peer (delivered in order with that transport's data).
  Result<std::shared_ptr<Transfer>> send_notification(const std::string& peer, std::string notif,
                                                      double timeout_s);

  // ---- notifications ----
  NotifQueue& notifications() { return notifs_; }


  // ---- AgentHooks ----
  const std::string& agent_name() const override { return cfg_.name; }
  bool secret_matches(std::string_view presented) const override;
  const std::string& agent_secret() const override { return cfg_.secret; }

 private:
  explicit Agent(AgentConfig cfg);
  const RegionTable& region_table() const override { return regions_; }
  void deliver_notification(Notification n) override { notifs_.push(std::move(n)); }
  std::string metadata_blob() override { return metadata(); }
  uint32_t max_notif_bytes() const override { return cfg_.max_notif_bytes; }
  Result<GenPin> check_generations(const GenClaim& claim) override { return gens_.check_and_pin(claim); }
  void relay_notification(const std::shared_ptr<const Peer>& peer, const std::shared_ptr<Transfer>& xfer,
                          std::string notif, const Transport* from) override;
  Result<std::string> fetch_peer_metadata(const std::string& address, std::string_view secret,
                                          double timeout_s) override {
    return fetch_metadata(address, std::string(secret), timeout_s);
  }

  Transport* transport_by_name(std::string_view name) const;
  Result<std::shared_ptr<PreparedTransfer>> prepare_resolved(const std::string& peer, OpKind op,
                                                             const std::vector<Extent>& extents,
                                                             const XferOptions& opts,
                                                             std::shared_ptr<const GenClaim> claim = nullptr);

  struct PeerEntry {
    std::shared_ptr<const Peer> peer;
    Transport* transport = nullptr;
  };

  AgentConfig cfg_;
  uint64_t instance_id_ = 0;
  std::string host_id_;
  RegionTable regions_;
  GenerationTable gens_;
  NotifQueue notifs_;
  // Created in full before any is started, never resized afterwards; the first
  // started_ of them are running (what inbound traffic may see while create() runs).
  std::vector<std::unique_ptr<Transport>> transports_;
  std::atomic<size_t> started_{0};
  std::atomic<uint64_t> next_xfer_id_{1};

  mutable std::mutex mu_;  // guards layouts_ and peers_
  std::map<std::string, KVLayout> layouts_;
  std::map<std::string, PeerEntry> peers_;
};

}  // namespace pdkv
