// pdkv/spi/transport.h (SPI, for transport authors; users never need it): THE backend
// interface. Nothing backend-specific lives here. The rest of the SPI: registry.h
// (registration), region_table.h (validating accesses), transfer_control.h (resolving
// a transfer's parts), generations.h (block generation claims).
//
// A transport moves bytes between this agent's registered memory and a peer's.
// The agent does all validation against regions and layouts before calling
// prepare(); prepare() does the transport's own setup once (batching, wire
// descriptors); post() only queues work and must not block on the network except
// to (re)establish a connection, bounded by the connect timeout.
//
// Inbound requests are validated by the transport through AgentHooks::regions()
// (every remote access is checked against what this agent exported).
//
// Thread safety: prepare(), post(), connect(), drop_peer() and fetch_metadata() may
// be called concurrently from any thread. start() and shutdown() are called once.
//
// A transport is one class implementing this interface plus one registration line
// (registry.h). Python classes implement it too, through the `pdkv.Transport`
// trampoline (cpp/bindings/py_transport.cc); the agent treats them like any other.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/metadata.h"
#include "pdkv/notify.h"
#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/types.h"
#include "pdkv/spi/auth.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transfer_control.h"

namespace pdkv {

struct TransportCaps {
  bool write = true;
  bool read = true;
  bool notify = true;
  bool cross_host = true;        // false: both agents must share a host
  uint32_t local_mem_kinds = 0;  // bit per MemKind this transport can read/write locally
  uint32_t remote_mem_kinds = 0; // bit per MemKind it can reach in a peer
  bool generations = false;      // implements prepare_checked() (block generation claims)
  bool serves_metadata = false;  // implements fetch_metadata() and answers peers' fetches
  // Many small extents cost this transport about what their bytes cost (a memcpy
  // engine): the core hands it a fragmented host transfer as planned instead of staging
  // it through a buffer (core/relayout.h), which would only add a copy.
  bool direct_small_extents = false;
  // Takes strided ResolvedExtents (count > 1) as they are. Without it the agent hands
  // the transport every piece as its own extent (expand_strided), as before.
  bool strided_extents = false;
  // Takes two-level runs (ResolvedExtent count2 > 1) as they are; needs
  // strided_extents. Without it a transport never gets count2 > 1.
  bool two_level_extents = false;
};

class Transport;

// What a transport may ask of the agent that owns it.
class AgentHooks {
 public:
  virtual ~AgentHooks() = default;
  virtual const std::string& agent_name() const = 0;
  virtual uint64_t instance_id() const = 0;
  // Equal for two agents iff they share a kernel (boot id).
  virtual const std::string& host_id() const = 0;
  // The handshake keys (pdkv/spi/auth.h) of every secret this agent accepts, its own
  // secret's first. A target checks an initiator's proof against each and proves
  // itself with the one that matched.
  virtual const std::vector<auth::Key>& accepted_keys() const = 0;
  // The secrets themselves, its own first, for a transport written in Python that
  // derives the same keys (pdkv.credential). Never put them on a wire.
  virtual const std::vector<std::string>& accepted_secrets() const = 0;
  virtual const RegionTable& region_table() const = 0;
  // Queues a received notification for the application, or refuses it
  // (ResourceExhausted: the agent's queue is full, AgentConfig::max_queued_notifs /
  // max_queued_notif_bytes). A transport calls it before acknowledging the
  // notification and, when refused, fails the sender's transfer with that status
  // instead of acknowledging it.
  virtual Status deliver_notification(Notification n) = 0;
  virtual std::string metadata_blob() = 0;
  virtual uint32_t max_notif_bytes() const = 0;
  // Checks an initiator's claim about this agent's block generations and pins the
  // blocks until the returned pin is dropped (see generations.h). Call it before any
  // byte of the transfer lands or is sent; drop the pin once the bytes have landed
  // (or been sent) or the transfer died.
  virtual Result<GenPin> check_generations(const GenClaim& claim) = 0;
  // A new fd of `layout`'s published generation table (GenerationTable::dup_shared_fd),
  // for a same-host transport whose readers validate claims without a round trip.
  virtual Result<int> share_generations(const std::string& layout, uint32_t* num_blocks) {
    (void)layout;
    (void)num_blocks;
    return NotSupported("this agent does not share generation tables");
  }
  // Delivers a notification to `peer` through another transport that can reach it
  // (for transports without a control channel of their own); resolves one part of
  // `xfer`, with ConnectionError when no other transport reaches the peer.
  virtual void relay_notification(const std::shared_ptr<const Peer>& peer, const std::shared_ptr<Transfer>& xfer,
                                  std::string notif, const Transport* from) = 0;
  // Fetches a remote agent's metadata blob by address through a transport of this
  // agent that serves metadata (e.g. to ask a peer that looks dead whether it restarted).
  // Blocks up to `timeout_s`.
  virtual Result<std::string> fetch_peer_metadata(const std::string& address, std::string_view secret,
                                                  double timeout_s) = 0;
};

// One resolved run of a transfer: `count` pieces of `len` bytes; piece i moves
// [local_addr + i * local_stride, +len) to or from the peer's region `remote_region`
// at remote_offset + i * remote_stride. count == 1 is a plain extent (strides unused).
// The agent has checked the whole run against both regions (first and last piece,
// no u64 overflow) and, for count > 1, that both strides are at least `len` (pieces
// never overlap). Only a transport with caps().strided_extents gets count > 1.
// A two-level run (count2 > 1, only for caps().two_level_extents) repeats that run
// count2 times, repetition j shifted by j * local_stride2 / j * remote_stride2; the
// agent has checked the whole of it against both regions and that one level nests
// in the other's gaps (its count * count2 pieces are disjoint on each side).
struct ResolvedExtent {
  uint64_t local_addr = 0;
  uint64_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t len = 0;
  MemKind local_kind = MemKind::kHost;  // of the local region
  int32_t local_device = -1;            // CUDA ordinal of the local region (-1: host)
  uint64_t count = 1;
  uint64_t local_stride = 0;
  uint64_t remote_stride = 0;
  uint64_t count2 = 1;
  uint64_t local_stride2 = 0;
  uint64_t remote_stride2 = 0;

  uint64_t bytes() const { return count2 * count * len; }
  // Piece i (of the first repetition) as a plain extent.
  ResolvedExtent piece(uint64_t i) const {
    return ResolvedExtent{local_addr + i * local_stride, remote_region, remote_offset + i * remote_stride, len,
                          local_kind, local_device};
  }
  // Repetition j of a two-level run as a one-level run.
  ResolvedExtent repetition(uint64_t j) const {
    ResolvedExtent r = *this;
    r.local_addr += j * local_stride2;
    r.remote_offset += j * remote_stride2;
    r.count2 = 1;
    r.local_stride2 = r.remote_stride2 = 0;
    return r;
  }
};

// The shared expansion of two-level runs for transports without
// caps().two_level_extents: each repetition as its own one-level run, in order.
inline std::vector<ResolvedExtent> expand_two_level(const std::vector<ResolvedExtent>& in) {
  uint64_t n = 0;
  for (const ResolvedExtent& e : in) n += e.count2;
  std::vector<ResolvedExtent> out;
  out.reserve(n);
  for (const ResolvedExtent& e : in)
    for (uint64_t j = 0; j < e.count2; ++j) out.push_back(e.repetition(j));
  return out;
}

// The shared expansion for transports without caps().strided_extents: every piece of
// `in` as a plain extent, in order (a run whose pieces touch on both sides stays one).
inline std::vector<ResolvedExtent> expand_strided(const std::vector<ResolvedExtent>& in_runs) {
  const bool two_level =
      std::any_of(in_runs.begin(), in_runs.end(), [](const ResolvedExtent& e) { return e.count2 > 1; });
  const std::vector<ResolvedExtent> flat = two_level ? expand_two_level(in_runs) : std::vector<ResolvedExtent>();
  const std::vector<ResolvedExtent>& in = two_level ? flat : in_runs;
  uint64_t n = 0;
  for (const ResolvedExtent& e : in) n += e.count;
  std::vector<ResolvedExtent> out;
  out.reserve(n);
  for (const ResolvedExtent& e : in) {
    if (e.count <= 1 || (e.local_stride == e.len && e.remote_stride == e.len)) {
      ResolvedExtent whole = e.piece(0);
      whole.len = e.bytes();
      out.push_back(whole);
      continue;
    }
    for (uint64_t i = 0; i < e.count; ++i) out.push_back(e.piece(i));
  }
  return out;
}

// What the caller asked of one transfer beyond its extents (XferOptions), for the
// transport to honour where it can.
struct TransferHints {
  // Overrides the transport's compression default for this transfer (nullopt: the
  // default). A transport that does not compress ignores it: it moves the bytes
  // exactly, which every mode allows.
  std::optional<CompressMode> compress;
};

// Transport-owned, immutable result of prepare(); may be posted many times.
class PreparedOps {
 public:
  virtual ~PreparedOps() = default;
};

class Transport {
 public:
  Transport() = default;
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  Transport(Transport&&) = delete;
  Transport& operator=(Transport&&) = delete;

  virtual std::string_view name() const = 0;
  virtual TransportCaps caps() const = 0;
  // Binds listeners and starts progress threads. `hooks` outlives the transport.
  virtual Status start(AgentHooks* hooks) = 0;
  // Fails everything in flight (ConnectionError "agent shutting down") and joins threads.
  virtual void shutdown() = 0;
  // Addresses to publish in metadata.
  virtual std::vector<Endpoint> endpoints() const = 0;
  // Opaque extra metadata this transport publishes (may be empty).
  virtual std::string metadata_extra() const { return {}; }
  // Whether this transport can reach `peer` from here (e.g. same host for shm).
  virtual bool can_reach(const AgentMetadata& peer) const = 0;

  virtual Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                             std::vector<ResolvedExtent> extents) = 0;
  // prepare() with a claim about the target's block generations (caps().generations):
  // every post checks `claim` at the target before any byte lands or is sent, and
  // fails the transfer with StaleBlock on a mismatch (nothing lands, no notification).
  virtual Result<std::shared_ptr<const PreparedOps>> prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                     std::vector<ResolvedExtent> extents,
                                                                     std::shared_ptr<const GenClaim> claim) {
    (void)peer; (void)op; (void)extents; (void)claim;
    return NotSupported(std::string(name()) + " cannot check block generations");
  }
  // prepare() (claim null) or prepare_checked() with the caller's per-transfer hints.
  // The default ignores the hints.
  virtual Result<std::shared_ptr<const PreparedOps>> prepare_with(std::shared_ptr<const Peer> peer, OpKind op,
                                                                  std::vector<ResolvedExtent> extents,
                                                                  std::shared_ptr<const GenClaim> claim,
                                                                  const TransferHints& hints) {
    (void)hints;
    if (claim) return prepare_checked(std::move(peer), op, std::move(extents), std::move(claim));
    return prepare(std::move(peer), op, std::move(extents));
  }
  // Queues a prepared transfer. Completion (and any error) arrives through `xfer`.
  // `notif` (may be empty = none) reaches the peer only after all bytes landed.
  virtual void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                    std::string notif) = 0;
  // Sends a notification with no data; resolves exactly one part of `xfer` (the
  // caller has declared it with TransferControl::set_parts) once the peer has queued it.
  virtual void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer,
                      std::string notif) = 0;
  // Establishes connections now instead of on first use (optional).
  virtual Status connect(std::shared_ptr<const Peer> peer, double timeout_s) {
    (void)peer; (void)timeout_s;
    return Status::Ok();
  }
  // Closes connections to a peer; its in-flight transfers fail with ConnectionError.
  virtual void drop_peer(const std::string& name) = 0;
  // Notifications that completed their transfer when sent and that the peer then
  // never acknowledged (ShmOptions::notify_on_send); 0 for transports without it.
  virtual uint64_t notifications_unacknowledged() const { return 0; }
  // Exported host memory the engine allocated itself whose whole pages span at least
  // this many bytes is re-mapped at registration onto a memfd, so that this transport
  // reaches it as it reaches Agent.alloc memory (ShmOptions::share_pages_min_bytes).
  // 0 (the default): this transport has no use for it. The agent takes the smallest
  // non-zero value of its transports.
  virtual uint64_t share_pages_min_bytes() const { return 0; }
  // Called after a region was registered, before anyone can name it in a transfer: a
  // transport whose library must register memory itself (NIXL) does it here. An error
  // undoes the registration and is returned to the caller of register_memory.
  virtual Status region_added(const RegionDesc& region) {
    (void)region;
    return Status::Ok();
  }
  // Called before a region (exported or not) is removed: a transport through which peers
  // access it directly (shm) must make them stop, and return once none does; one that
  // registered it with its library (region_added) deregisters it once its own transfers
  // no longer use it.
  virtual void region_removed(const RegionDesc& region) { (void)region; }
  // Fetches a remote agent's metadata blob given only an address (optional; a
  // transport that implements it sets caps().serves_metadata).
  virtual Result<std::string> fetch_metadata(const std::string& address, std::string_view secret,
                                             double timeout_s) {
    (void)address; (void)secret; (void)timeout_s;
    return NotSupported(std::string(name()) + " cannot fetch metadata");
  }
};

}  // namespace pdkv
