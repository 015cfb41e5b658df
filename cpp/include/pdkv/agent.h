// pdkv/agent.h (public, for users): one named endpoint per process; the facade
// over regions, layouts, peers, transports and notifications. A pImpl: the state and
// what transports may ask of the agent (AgentHooks, pdkv/spi/transport.h) live in
// agent.cc.
//
// Typical use (initiator):
//   auto agent = Agent::create(cfg);                  // starts transports
//   auto region = agent->register_memory(addr, len, MemKind::kHost, -1, true);
//   agent->add_layout("kv", KVLayout::per_layer(geo, k_addrs, v_addrs));
//   std::string peer = agent->add_peer(blob_from_peer, secret);
//   auto prep = agent->prepare_blocks(peer, OpKind::kWrite, {"kv", ids}, {"kv", remote_ids});
//   auto xfer = agent->post(*prep, "req-42", 5.0);   // async
//   xfer->wait(-1);
//
// Thread safety: every method may be called from any thread concurrently. Blocking
// calls (post when connecting, wait, deregister) never hold agent-wide locks while
// blocking.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/config.h"
#include "pdkv/kv_layout.h"
#include "pdkv/metadata.h"
#include "pdkv/notify.h"
#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/stream.h"
#include "pdkv/transfer.h"
#include "pdkv/types.h"

namespace pdkv {

class Agent;
class PreparedOps;  // a transport's own (pdkv/spi/transport.h)
class StagedTransfer;  // a transfer staged through a local buffer (core/relayout.h)

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
  // Set when a heterogeneous transfer goes through a local staging buffer (its
  // extents then name that buffer): a push gathers into it at each post, a pull
  // scatters from it before the transfer completes. Null otherwise.
  std::shared_ptr<StagedTransfer> staged;
};

// One side of a block transfer: blocks of a KV layout, named by id.
struct Blocks {
  // A layout name: this agent's (Agent::add_layout) on the local side, the peer's on
  // the remote side.
  std::string layout;
  // Block ids; position i on one side maps to position i on the other. The
  // destination side (remote for a write, local for a read) must not name one twice.
  std::vector<uint32_t> ids;
  // The owner's generations of these blocks (Agent::generations), one per id, as the
  // owner handed them out with the ids; empty = unchecked. Only the remote side's are
  // checked: the peer checks them at every post before any byte lands or is sent, and
  // a mismatch fails the transfer with StaleBlock (docs/generations.md). The local
  // side's must be empty (this agent owns those blocks).
  std::vector<uint32_t> generations;

  // InvalidArgument unless generations is empty or holds one per id.
  Status validate() const;
};

// How a prepared transfer travels (beyond what it moves).
struct XferOptions {
  std::string transport;  // force a transport ("" = the peer's chosen one)
  // Compression of this transfer's payload on the wire (tcp, host memory): overrides
  // the agent's TcpOptions::compress.mode for this transfer only (its other fields,
  // codec, dtype, FP8 grouping, apply as they are); nullopt: the agent's mode.
  std::optional<CompressMode> compress;

  Status validate() const { return Status::Ok(); }  // every value is valid (a transport is checked at routing)
};

class Agent final {
 public:
  static Result<std::unique_ptr<Agent>> create(AgentConfig cfg);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& name() const;
  const std::string& secret() const;
  uint64_t instance_id() const;
  // Equal for two agents iff they share a kernel (boot id).
  const std::string& host_id() const;
  const AgentConfig& config() const;
  std::vector<std::string> transports() const;
  std::vector<Endpoint> endpoints() const;

  // ---- memory ----
  // Registers [addr, addr+len). See region.h for overlap and lifetime rules.
  // `shm_fd` >= 0 marks the memory as a MAP_SHARED mapping of that memfd (see region.h).
  Result<RegionDesc> register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                     bool remote_access, int shm_fd = -1);
  // Removes a region; blocks until transfers using it finish. Layouts on it are removed.
  Status deregister_memory(uint64_t id);
  std::vector<RegionDesc> regions() const;

  // ---- layouts ----
  // Binds each segment to the registered region containing it and exports it
  // under `name`. Errors: AlreadyExists, NotFound (a segment outside registered memory).
  Status add_layout(const std::string& name, KVLayout layout);
  Status remove_layout(const std::string& name);
  Result<KVLayout> layout(const std::string& name) const;
  std::vector<std::string> layout_names() const;

  // ---- block generations ----
  // Every block of every exported layout has a generation (starting at 1) that the
  // owner bumps when it frees or reuses the block; a transfer that names an old one
  // fails with StaleBlock before any byte lands (see spi/generations.h).
  // Current generations of blocks of a local layout.
  Result<std::vector<uint32_t>> generations(const std::string& layout, const std::vector<uint32_t>& ids) const;
  // Bumps the generations of distinct blocks (call it when freeing or reusing them)
  // and returns the new values once no transfer accepted under the old ones still
  // touches them; Timeout after `timeout_s` (< 0: no limit), with the bump in force.
  Result<std::vector<uint32_t>> bump_generations(const std::string& layout, const std::vector<uint32_t>& ids,
                                                 double timeout_s);

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
  // Moves blocks `local` of this agent to or from blocks `remote` of the peer (op
  // kWrite: local -> remote; kRead: remote -> local), as `plan` says (plan_blocks,
  // pdkv/kv_layout.h). remote.generations, when given, are checked at every post.
  // Errors: NotFound (peer, layout), InvalidArgument (no blocks, a destination block
  // named twice, generations not one per block or given for the local side,
  // geometries that differ without a plan saying what to move), OutOfRange (block
  // ids, tokens, heads or layers beyond a side), NotSupported (a transport that
  // cannot do what was asked).
  Result<std::shared_ptr<PreparedTransfer>> prepare_blocks(const std::string& peer, OpKind op, const Blocks& local,
                                                           const Blocks& remote, const PlanOptions& plan = {},
                                                           const XferOptions& opts = {});
  // Raw extents: local_region/offset are this agent's, remote_* the peer's exported regions.
  Result<std::shared_ptr<PreparedTransfer>> prepare_extents(const std::string& peer, OpKind op,
                                                            const std::vector<Extent>& extents,
                                                            const XferOptions& opts = {});
  // Posts a prepared transfer. `timeout_s` < 0 uses the default timeout; 0 = none.
  // Errors after this point arrive through the Transfer, never as a return value,
  // except for a local region deregistered since prepare (NotFound).
  Result<std::shared_ptr<Transfer>> post(const PreparedTransfer& prep, std::string notif, double timeout_s);
  // Opens a layer-wise streaming write (pdkv/stream.h): blocks `local` into the peer's
  // blocks `remote`, layers [plan.first_layer, +plan.num_layers) (num_layers 0: to the
  // last), posted with StreamingWrite::post_layers as they become ready. `notif`
  // reaches the peer once every layer landed; `timeout_s` bounds the whole stream (< 0:
  // the default timeout; 0: none).
  // Errors: those of prepare_blocks (checked now, on the first layer), InvalidArgument.
  Result<std::shared_ptr<StreamingWrite>> open_stream(const std::string& peer, const Blocks& local,
                                                      const Blocks& remote, const PlanOptions& plan,
                                                      const XferOptions& opts, std::string notif, double timeout_s,
                                                      const StreamOptions& stream_opts = {});
  // Sends only a notification to a peer (delivered in order with that transport's data).
  Result<std::shared_ptr<Transfer>> send_notification(const std::string& peer, std::string notif,
                                                      double timeout_s);

  // ---- notifications ----
  NotifQueue& notifications();
  // Notifications sent by transfers that completed when they were sent
  // (ShmOptions::notify_on_send) and that the peer never acknowledged (its connection
  // closed, or the transfer's deadline passed, first). Monotonic.
  uint64_t notifications_unacknowledged() const;

 private:
  class Impl;  // agent.cc: the state, and what transports may ask of the agent (AgentHooks)
  explicit Agent(AgentConfig cfg);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdkv
