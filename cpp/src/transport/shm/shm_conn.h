// One shm control connection (a Unix socket to a same-host peer) and what hangs off
// it: the peer's regions this process maps, the notifications and block leases in
// flight, and the regions the peer confirmed from us.
//
// Roles: an outbound connection is ours to a target (we copy into its regions); an
// inbound one is a peer's to us (it copies into ours). Frames: shm_ctl.h.
//
// Locks of a ShmConn, in the order they may nest (outer first):
//   map_mu   one region request in flight per connection (remote_region.h)
//   rx_mu    the receive state: the progress thread, or a posting thread draining
//            frames that arrived while it was not looking
//   mu       the shared state below (with cv for answers, acks and death)
//   send_mu  whole frames on the socket (send_frame); a leaf
// ShmTransport::mu_ (its connection and peer tables) is taken before a connection's
// mu, never after.
//
// Thread safety: as the locks above say; `gone` and `authed` are readable without them.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include "pdkv/spi/generations.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/spi/transport.h"
#include "transport/shm/shm_ctl.h"

namespace pdkv::shm {

struct ShmConn;

// A peer's region this process accesses directly, as the peer confirmed it.
struct RemoteRegion {
  uint64_t id = 0;
  uint64_t len = 0;
  char* base = nullptr;      // mapped (shareable) or nullptr (cross-memory attach)
  uint64_t remote_addr = 0;  // the peer's address, for cross-memory attach
  std::atomic<int64_t> inflight{0};  // copies using it now
  std::atomic<bool> revoked{false};  // the peer deregistered it: ack once inflight is 0
  std::atomic<bool> ack_sent{false};
  std::weak_ptr<ShmConn> conn;
  ~RemoteRegion();
};

// A notification sent and not yet acknowledged.
struct PendingNotify {
  std::shared_ptr<Transfer> xfer;
  Clock::time_point deadline;
};

// The target's answer to a region request.
struct RegionAnswer {
  Status st;
  RegionInfo info;
  int fd = -1;  // the memfd of a shareable region (owned)
};

// Blocks a peer pinned for one copy (block generations, docs/generations.md).
struct Lease {
  GenPin pin;
  uint64_t blocks = 0;
  Clock::time_point expires;
};

struct ShmConn {
  ShmConn(int fd, bool outbound, std::string desc) : fd(fd), outbound(outbound), desc(std::move(desc)) {}
  ~ShmConn();
  ShmConn(const ShmConn&) = delete;
  ShmConn& operator=(const ShmConn&) = delete;

  int fd;
  const bool outbound;
  std::string desc;
  std::string peer_name;
  pid_t peer_pid = 0;
  Clock::time_point hs_deadline = Clock::time_point::max();
  std::atomic<bool> authed{false};
  std::atomic<bool> gone{false};  // set with `dead`, readable without the lock
  std::mutex send_mu;
  std::mutex map_mu;  // one region request in flight per connection
  // ---- Receive state, guarded by rx_mu.
  std::mutex rx_mu;
  CtlHdr hdr{};
  size_t hdr_got = 0;
  std::string aux;
  size_t aux_got = 0;
  bool in_aux = false;
  std::deque<int> fds;  // fds received with SCM_RIGHTS, in order
  // A frame has started arriving and must be complete by then (steady-clock ticks).
  std::atomic<Clock::rep> frame_deadline{Clock::time_point::max().time_since_epoch().count()};
  // ---- Shared state, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  bool dead = false;
  Status dead_reason;
  // Inbound, unauthenticated: a refused hello whose answer is held back (back-off).
  Clock::time_point reject_at = Clock::time_point::max();
  Status reject;
  // Inbound (we are the target).
  std::set<uint64_t> confirmed;      // regions this peer asked about and got
  std::set<uint64_t> revoke_acks;    // regions the peer acknowledged
  std::map<uint64_t, Lease> leases;  // granted, not yet ended; released when the connection dies
  uint64_t leased_blocks = 0;
  // Outbound (we are the initiator).
  uint64_t pending_req = 0;                  // region asked about, 0: none
  std::map<uint64_t, RegionAnswer> answers;  // at most one: pending_req's
  std::map<uint64_t, PendingNotify> notifies;
  std::unordered_map<uint64_t, std::shared_ptr<RemoteRegion>> regions;  // by region id
  std::set<uint64_t> revoked_ids;  // confirmed (or being confirmed) here, then revoked
  uint64_t next_seq = 1;
  std::map<uint64_t, std::optional<Status>> lease_answers;  // requested leases; set when answered
  uint64_t next_lease = 1;
};

// Our state for one peer instance: its newest metadata and its connection.
struct ShmPeerState {
  uint64_t instance = 0;
  std::shared_ptr<const Peer> peer;  // guarded by mu
  std::mutex mu;
  std::shared_ptr<ShmConn> conn;  // guarded by mu
};

// Sends one control frame (passing `pass_fd` with it if >= 0), whole, within 5 s.
Status send_frame(ShmConn& c, Ctl type, uint64_t id, std::string_view aux, uint32_t status = 0, int pass_fd = -1);

}  // namespace pdkv::shm
