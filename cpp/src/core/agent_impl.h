// Agent::Impl, the agent's state and what its transports may ask of it (AgentHooks),
// shared by the files that implement it: agent.cc (the public API, lifetime, memory,
// layouts, peers) and agent_transfer.cc (preparing and posting transfers).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/relayout.h"
#include "core/stream_pump.h"
#include "pdkv/agent.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transport.h"

namespace pdkv {

// The agent's state, and what its transports may ask of it (AgentHooks). Every public
// Agent method forwards to the method of the same name here.
class Agent::Impl final : public AgentHooks {
 public:
  explicit Impl(AgentConfig cfg) : cfg_(std::move(cfg)) {
    secrets_.push_back(cfg_.secret);
    for (const std::string& s : cfg_.accepted_secrets)
      if (std::find(secrets_.begin(), secrets_.end(), s) == secrets_.end()) secrets_.push_back(s);
    for (const std::string& s : secrets_) keys_.push_back(auth::derive_key(s));
    notifs_.set_limits(cfg_.max_queued_notifs, cfg_.max_queued_notif_bytes);
  }
  ~Impl() override;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Creates the configured transports, then starts them.
  Status start();

  const AgentConfig& config() const { return cfg_; }
  std::vector<std::string> transports() const;
  std::vector<Endpoint> endpoints() const;
  uint64_t notifications_unacknowledged() const {
    uint64_t n = 0;
    for (const auto& t : transports_) n += t->notifications_unacknowledged();
    return n;
  }

  Result<RegionDesc> register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                     bool remote_access, int shm_fd);
  Status deregister_memory(uint64_t id);
  std::vector<RegionDesc> regions() const { return regions_.list(); }

  Status add_layout(const std::string& name, KVLayout layout);
  Status remove_layout(const std::string& name);
  Result<KVLayout> layout(const std::string& name) const;
  std::vector<std::string> layout_names() const;
  GenerationTable& gens() { return gens_; }
  const GenerationTable& gens() const { return gens_; }

  std::string metadata();
  Result<std::string> add_peer(std::string_view blob, std::string secret, std::string transport,
                               std::string via_host);
  Status remove_peer(const std::string& name);
  std::vector<std::string> peer_names() const;
  Result<std::shared_ptr<const Peer>> peer(const std::string& name) const;
  Result<std::string> peer_transport(const std::string& name) const;
  Result<std::string> fetch_metadata(const std::string& address, std::string secret, double timeout_s);
  Status connect(const std::string& name, double timeout_s);

  Result<std::shared_ptr<PreparedTransfer>> prepare_blocks(const std::string& peer, OpKind op, const Blocks& local,
                                                           const Blocks& remote, const PlanOptions& plan,
                                                           const XferOptions& opts);
  Result<std::shared_ptr<PreparedTransfer>> prepare_extents(const std::string& peer, OpKind op,
                                                            const std::vector<Extent>& extents,
                                                            const XferOptions& opts);
  Result<std::shared_ptr<Transfer>> post(const PreparedTransfer& prep, std::string notif, double timeout_s);
  Result<std::shared_ptr<Transfer>> send_notification(const std::string& peer, std::string notif,
                                                      double timeout_s);
  NotifQueue& notifications() { return notifs_; }
  // The pump of this agent's streaming writes (stream_pump.h), created on first use.
  std::shared_ptr<StreamPump> stream_pump(Agent* self);
  uint64_t next_transfer_id() { return next_xfer_id_.fetch_add(1); }

  // ---- AgentHooks ----
  const std::string& agent_name() const override { return cfg_.name; }
  uint64_t instance_id() const override { return instance_id_; }
  const std::string& host_id() const override { return host_id_; }
  const std::vector<auth::Key>& accepted_keys() const override { return keys_; }
  const std::vector<std::string>& accepted_secrets() const override { return secrets_; }
  const std::string& agent_secret() const { return cfg_.secret; }
  const RegionTable& region_table() const override { return regions_; }
  Status deliver_notification(Notification n) override {
    Status st = notifs_.push(std::move(n));
    if (st.ok()) return st;
    return ResourceExhausted("agent '" + cfg_.name + "': " + st.message());
  }
  std::string metadata_blob() override { return metadata(); }
  uint32_t max_notif_bytes() const override { return cfg_.max_notif_bytes; }
  Result<GenPin> check_generations(const GenClaim& claim) override { return gens_.check_and_pin(claim); }
  Result<int> share_generations(const std::string& layout, uint32_t* num_blocks) override {
    return gens_.dup_shared_fd(layout, num_blocks);
  }
  void relay_notification(const std::shared_ptr<const Peer>& peer, const std::shared_ptr<Transfer>& xfer,
                          std::string notif, const Transport* from) override;
  Result<std::string> fetch_peer_metadata(const std::string& address, std::string_view secret,
                                          double timeout_s) override {
    return fetch_metadata(address, std::string(secret), timeout_s);
  }

 private:
  struct PeerEntry {
    std::shared_ptr<const Peer> peer;
    Transport* transport = nullptr;
  };

  Transport* transport_by_name(std::string_view name) const;
  // The peer `peer_name` and the transport a transfer to it uses: the peer's own, or the
  // one `opts.transport` names (which must reach it). NotFound / NotSupported otherwise.
  Result<PeerEntry> route(const std::string& peer_name, const XferOptions& opts) const;
  // Checks every run against its regions (the whole run: first and last piece) and
  // hands the transport the resolved runs: strided as planned when it takes them
  // (caps().strided_extents), piece by piece otherwise (expand_strided).
  Result<std::shared_ptr<PreparedTransfer>> prepare_resolved(const std::string& peer, OpKind op,
                                                             const std::vector<planner::StridedExtent>& extents,
                                                             const XferOptions& opts,
                                                             std::shared_ptr<const GenClaim> claim = nullptr);
  Result<std::shared_ptr<PreparedTransfer>> prepare_resolved(const std::string& peer, OpKind op,
                                                             const std::vector<Extent>& extents,
                                                             const XferOptions& opts,
                                                             std::shared_ptr<const GenClaim> claim = nullptr);
  // A transfer staged through a local buffer (core/relayout.h), or null when the
  // direct plan is as good.
  Result<std::shared_ptr<PreparedTransfer>> prepare_staged(
      const std::string& peer, OpKind op, const KVLayout& local, const std::vector<uint32_t>& local_ids, const KVLayout& remote,
      const std::vector<uint32_t>& remote_ids, const PlanOptions& plan, const XferOptions& opts,
      std::shared_ptr<const GenClaim> claim);
  std::shared_ptr<Transfer> post_staged_read(const PreparedTransfer& prep, const std::shared_ptr<Transfer>& xfer,
                                             std::string notif, Transport* t);
  // A registered staging buffer of at least `bytes` that no prepared transfer holds.
  Result<std::shared_ptr<StagingBuffer>> staging_buffer(uint64_t bytes);

  AgentConfig cfg_;
  std::vector<std::string> secrets_;  // cfg_.secret, then cfg_.accepted_secrets (deduplicated)
  std::vector<auth::Key> keys_;       // auth::derive_key of each of secrets_
  uint64_t instance_id_ = 0;
  std::string host_id_;
  RegionTable regions_;
  GenerationTable gens_;
  NotifQueue notifs_;
  // Created in full before any is started, never resized afterwards; the first
  // started_ of them are running (what inbound traffic may see while start() runs).
  std::vector<std::unique_ptr<Transport>> transports_;
  std::atomic<size_t> started_{0};
  std::atomic<uint64_t> next_xfer_id_{1};

  std::mutex staging_mu_;  // guards staging_
  std::vector<std::shared_ptr<StagingBuffer>> staging_;  // registered; reused once no prepared transfer holds one
  mutable std::mutex mu_;  // guards layouts_ and peers_
  std::map<std::string, KVLayout> layouts_;
  std::map<std::string, PeerEntry> peers_;
  std::shared_ptr<StreamPump> pump_;  // guarded by mu_
};

}  // namespace pdkv
