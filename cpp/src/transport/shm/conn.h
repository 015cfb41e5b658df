// One shm control connection (a Unix socket to a same-host peer) and what hangs off
// it: the peer's regions this process maps, the notifications and block leases in
// flight, and the regions the peer confirmed from us.
//
// Roles: an outbound connection is ours to a target (we copy into its regions); an
// inbound one is a peer's to us (it copies into ours). Frames: wire.h.
//
// Ownership: identity (fd, direction, peer pid, hello deadline) is fixed at
// construction; the receive state is private and assembled by read_frame(); the
// shared state (ShmShared) is reachable only through lock(), which holds the mutex
// for as long as the returned guard lives.
//
// Locks of a ShmConn, in the order they may nest (outer first):
//   region slot  one region request in flight (take_region_request_slot: a flag under
//             mu_, waited for on its condition variable, held across the request)
//   rx_mu_    the receive state (lock_rx): the progress thread, or a posting thread
//             draining frames that arrived while it was not looking
//   mu_       the shared state (lock(), with a condition variable for answers,
//             acks and death)
//   send_mu_  whole frames on the socket (send_frame); a leaf
// ShmTransport::mu_ (its connection and peer tables) is taken before a connection's
// mu_, never after.
//
// Thread safety: as the locks above say; identity, gone() and authed() are readable
// without them.
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
#include "transport/shm/wire.h"

namespace pdkv::shm {

class ShmConn;

// A peer's region this process accesses directly, as the peer confirmed it.
struct RemoteRegion {
  uint64_t id = 0;
  uint64_t len = 0;
  // Bytes [shared_offset, shared_offset + shared_len) are mapped at base (the peer's
  // memfd); the rest (all of it when base is nullptr) is reached by cross-memory attach.
  char* base = nullptr;
  uint64_t shared_offset = 0;
  uint64_t shared_len = 0;
  uint64_t remote_addr = 0;  // the peer's address, for cross-memory attach
  std::string cma_denied;    // why cross-memory attach is refused (empty: it works)
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
  // ShmOptions::notify_on_send: the transfer completed when the Notify was sent; a
  // missing acknowledgement is counted and logged, not resolved into the transfer.
  bool resolved = false;
};

// A target's published generation table for one layout (GenReq/GenResp), mapped
// read-only: n u32 generations, read with acquire loads. Its values are the target's
// word only; the reader bounds-checks block ids against n (checked against the
// memfd's size and seals when mapped), never against anything in the table.
struct RemoteGens {
  const uint32_t* base = nullptr;
  uint32_t n = 0;
  ~RemoteGens();
};

// The target's answer to a generation table request.
struct GenAnswer {
  bool done = false;
  Status st;
  uint32_t n = 0;
  int fd = -1;  // owned
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

// The state of a connection that other threads share: guarded by the connection's
// mutex, reachable only through ShmConn::lock().
struct ShmShared {
  bool dead = false;
  Status dead_reason;
  // Inbound, unauthenticated: a refused hello whose answer is held back (back-off).
  Clock::time_point reject_at = Clock::time_point::max();
  Status reject;
  // Inbound (we are the target).
  std::set<uint64_t> confirmed;      // regions this peer asked about and got
  // Revokes sent and not yet acknowledged; a RevokeAck for anything else is a
  // protocol error (so revoke_acks never holds more than the revokes in flight).
  std::set<uint64_t> revoking;
  std::set<uint64_t> revoke_acks;    // regions the peer acknowledged (a subset of revoking's past)
  std::map<uint64_t, Lease> leases;  // granted, not yet ended; released when the connection dies
  uint64_t leased_blocks = 0;
  // Outbound (we are the initiator).
  uint64_t pending_req = 0;                  // region asked about, 0: none
  std::map<uint64_t, RegionAnswer> answers;  // at most one: pending_req's
  // Region requests whose asker stopped waiting (its transfer's deadline passed), in
  // the order sent: the target answers in order, so their late answers come first and
  // are dropped instead of being taken for the current request's.
  std::deque<uint64_t> abandoned_reqs;
  std::map<uint64_t, PendingNotify> notifies;
  std::unordered_map<uint64_t, std::shared_ptr<RemoteRegion>> regions;  // by region id
  std::set<uint64_t> revoked_ids;  // confirmed (or being confirmed) here, then revoked
  uint64_t next_seq = 1;
  std::map<uint64_t, std::optional<Status>> lease_answers;  // requested leases; set when answered
  std::map<std::string, std::shared_ptr<RemoteGens>> gen_tables;  // by layout name, mapped
  std::map<uint64_t, GenAnswer> gen_answers;                      // requested tables; done when answered
  uint64_t next_gen_req = 1;
  uint64_t next_lease = 1;
};

class ShmConn {
 public:
  // A connection this agent dialled and authenticated (handshake.h) to agent
  // `peer_name`, whose process is `peer_pid` (SO_PEERCRED), pinned by `peer_pidfd`
  // (owned).
  static std::shared_ptr<ShmConn> dialled(int fd, std::string desc, std::string peer_name, pid_t peer_pid,
                                          int peer_pidfd);
  // A connection accepted from local process `peer_pid` (SO_PEERCRED); it must say
  // hello before `hello_deadline`.
  static std::shared_ptr<ShmConn> accepted(int fd, pid_t peer_pid, Clock::time_point hello_deadline);
  ~ShmConn();
  ShmConn(const ShmConn&) = delete;
  ShmConn& operator=(const ShmConn&) = delete;

  // ---- Identity: fixed at construction, except the name an inbound connection
  // learns from its hello (authenticate). Readable from any thread.
  int fd() const { return fd_; }
  bool outbound() const { return outbound_; }
  pid_t peer_pid() const { return peer_pid_; }
  // Outbound: the peer process (peer_pid) has exited, so its pid may name another
  // process now; no cross-memory copy may address it any more. Any thread.
  bool peer_exited() const;
  Clock::time_point hello_deadline() const { return hello_deadline_; }
  // "peer 'x' (shm /path)" / "peer 'x' (local process 123)", for messages.
  std::string desc() const;
  // The remote agent's name; empty until an inbound connection's hello is accepted.
  const std::string& peer_name() const;
  bool authed() const { return authed_.load(std::memory_order_acquire); }
  // Inbound: the hello from agent `name` was accepted. Once, by the reading thread.
  void authenticate(std::string name);
  // Inbound, under lock_rx(): our half of the handshake between the challenge we sent
  // and the initiator's proof (null before the hello and after the proof).
  std::unique_ptr<auth::TargetHandshake>& handshake() { return handshake_; }
  // Killed (retire): set with the shared state's `dead`, readable without the lock.
  bool gone() const { return gone_.load(std::memory_order_acquire); }

  // ---- Shared state (ShmShared), under the connection's mutex.
  class Locked {
   public:
    ShmShared* operator->() const { return &c_->shared_; }
    ShmShared& operator*() const { return c_->shared_; }
    // Waits (releasing the lock meanwhile) until `done` or `deadline`; false on timeout.
    template <class Pred>
    bool wait_until(Clock::time_point deadline, Pred done) {
      return c_->cv_.wait_until(lk_, deadline, done);
    }
    // Wakes the threads waiting in wait_until (an answer, an ack, death).
    void notify_all() const { c_->cv_.notify_all(); }

   private:
    friend class ShmConn;
    explicit Locked(ShmConn* c) : c_(c), lk_(c->mu_) {}
    ShmConn* c_;
    std::unique_lock<std::mutex> lk_;
  };
  Locked lock() { return Locked(this); }
  // Marks the connection dead with `why` and hands over what waited on it (the
  // notifications to fail, the leases to release); wakes every waiter. False if it
  // already was dead (kill runs once).
  bool retire(const Status& why, std::map<uint64_t, PendingNotify>* notifies, std::map<uint64_t, Lease>* leases);

  // ---- Region requests: one in flight per connection (remote_region.h). The slot
  // is taken by waiting (until `until`) on the shared state's condition variable, not
  // a timed mutex: ThreadSanitizer does not model pthread_mutex_clocklock.
  class RegionRequestSlot {
   public:
    bool taken() const { return c_ != nullptr; }
    RegionRequestSlot(RegionRequestSlot&& o) noexcept : c_(o.c_) { o.c_ = nullptr; }
    RegionRequestSlot(const RegionRequestSlot&) = delete;
    RegionRequestSlot& operator=(const RegionRequestSlot&) = delete;
    ~RegionRequestSlot() {
      if (!c_) return;
      auto s = c_->lock();
      c_->region_req_busy_ = false;
      s.notify_all();
    }

   private:
    friend class ShmConn;
    explicit RegionRequestSlot(ShmConn* c) : c_(c) {}
    ShmConn* c_;
  };
  // The slot, or an empty one when another request still holds it at `until`.
  RegionRequestSlot take_region_request_slot(Clock::time_point until) {
    auto s = lock();
    if (!s.wait_until(until, [&] { return !region_req_busy_; })) return RegionRequestSlot(nullptr);
    region_req_busy_ = true;
    return RegionRequestSlot(this);
  }

  // ---- Sending: one control frame (passing `pass_fd` with it if >= 0), whole,
  // within 5 s. Any thread (frames never interleave).
  Status send_frame(Ctl type, uint64_t id, std::string_view aux, uint32_t status = 0, int pass_fd = -1);

  // ---- Receiving, under lock_rx(): the progress thread, or a posting thread
  // draining frames that arrived while nobody looked.
  std::unique_lock<std::mutex> lock_rx() { return std::unique_lock<std::mutex>(rx_mu_); }
  enum class RxStep {
    kFrame,      // a whole frame is in: frame_header(), frame_aux(), take_fd()
    kEmpty,      // the socket has nothing more now
    kBroken,     // *err: the socket failed or closed, or the peer sent too many fds
    kBadHeader,  // *err: check_ctl_header refused frame_header(); nothing was allocated
  };
  // Reads until one frame is complete or the socket is empty; the header is checked
  // for this connection's side (and `max_notif` bytes of notification) before its
  // body is allocated, and a started frame must be complete by frame_deadline().
  RxStep read_frame(uint32_t max_notif, Status* err);
  const CtlHdr& frame_header() const { return hdr_; }
  const std::string& frame_aux() const { return aux_; }
  // The oldest fd received with SCM_RIGHTS (owned by the caller), -1 if none.
  int take_fd();
  // When the frame now arriving must be complete; max() between frames.
  Clock::time_point frame_deadline() const {
    return Clock::time_point(Clock::duration(frame_deadline_.load(std::memory_order_acquire)));
  }

 private:
  ShmConn(int fd, bool outbound, std::string desc, std::string peer_name, pid_t peer_pid, int peer_pidfd,
          Clock::time_point hello_deadline);

  // ---- Identity.
  const int fd_;  // closed by the destructor (kill() only shuts it down)
  const bool outbound_;
  const std::string base_desc_;
  const pid_t peer_pid_;
  const int peer_pidfd_;  // outbound: a pidfd of the peer process (owned), else -1
  const Clock::time_point hello_deadline_;
  std::string peer_name_;  // written once, before authed_ is set
  std::atomic<bool> authed_{false};
  std::atomic<bool> gone_{false};

  std::mutex send_mu_;  // whole frames on the socket; a leaf
  bool region_req_busy_ = false;  // a region request holds the slot (under mu_)

  // ---- Receive state, guarded by rx_mu_.
  std::mutex rx_mu_;
  std::unique_ptr<auth::TargetHandshake> handshake_;
  CtlHdr hdr_{};
  size_t hdr_got_ = 0;
  std::string aux_;
  size_t aux_got_ = 0;
  bool in_aux_ = false;
  std::deque<int> fds_;  // fds received with SCM_RIGHTS, in order
  std::atomic<Clock::rep> frame_deadline_{Clock::time_point::max().time_since_epoch().count()};

  // ---- Shared state, guarded by mu_ (lock()).
  std::mutex mu_;
  std::condition_variable cv_;
  ShmShared shared_;
};

// Our state for one peer instance: its newest metadata and its connection.
struct ShmPeerState {
  uint64_t instance = 0;
  std::shared_ptr<const Peer> peer;  // guarded by mu
  std::mutex mu;
  std::shared_ptr<ShmConn> conn;  // guarded by mu
};

}  // namespace pdkv::shm
