// One tcp connection: its socket, its send queue, the parts waiting for an answer
// on it, and the state of the frame being received.
//
// Life: an outbound connection is dialled and authenticated by the posting thread
// (handshake.h) before it is shared; an inbound one is accepted by the listener and
// must say hello before its deadline(). Either belongs from construction to one
// ProgressThread (`owner`), which reads it, flushes its queued output and enforces
// its deadlines. TcpTransport::kill() retires it exactly once (`dead_`): every
// pending part is resolved with the reason, queued output is dropped, and the socket
// lingers (draining()) so an error frame we sent is read before the peer sees a reset.
//
// Who owns what: identity (direction, owner, source, slot) is fixed at construction;
// the receive state (RxState) belongs to FrameReceiver, the only holder of an
// RxAccess; the send queue and the pending table are private behind the methods
// below, which keep their invariants (sq_cost_, the owner's npending and epoll
// interest, the deadline flags the owner counts) in step.
//
// Locks, one per side, each guarding the fields listed under it below:
//   rx_mu_ the receive state (lock_rx / try_lock_rx). Held by whoever reads the socket: the owner thread
//          (try_lock: it skips a connection someone else is reading), a caller
//          driving its own small transfer (TcpTransport::drive, try_lock), or
//          kill()/the staging thread (blocking) to tear the connection down.
//   pmu_   the pending parts table.
//   smu_   the send queue and epoll interest.
// `dead_` is written with both pmu_ and smu_ held, so either one is enough to read it.
//
// Lock order (a thread holding one of these takes only locks further down):
//   TcpConn::rx_mu  >  TcpTransport::mu_ (peers)  >  PeerConns::mu
//                   >  TcpConn::pmu_  >  TcpConn::smu_
//   ProgressThread::mu_, TcpPost::mu, the staging lock and Transfer's lock are
//   leaves: nothing else is taken while one is held.
// rx_mu is a plain mutex taken once per call chain: functions named *_locked
// expect the caller to hold it (the receive path, the deadline scan, drive);
// their plain twins take it. Two connections' rx_mu are never held together.
//
// Thread safety: see the lock of each field; identity and the atomics (socket,
// draining, deadline flags) are read without locks, e.g. by the owner's deadline scan.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/staging.h"
#include "pdkv/status.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transfer_control.h"
#include "pdkv/transfer.h"
#include "pdkv/codec.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/tls.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/transfer_parts.h"

namespace pdkv::tcp {

class ProgressThread;

// Back-pressure on an inbound connection: while more than this much bookkeeping
// (iovecs, pins, aux) or this many frames wait to be sent, its requests are not read;
// they wait in the peer's socket buffers, not in our memory.
inline constexpr size_t kMaxQueuedCost = 8u << 20;
inline constexpr size_t kMaxQueuedFrames = 256;

// Which part of a frame the receiver expects next.
enum class RxStage { kHeader, kControl, kPayload };

// The frame arriving on a connection, as FrameReceiver (receiver.h) reads it.
// Guarded by the connection's rx_mu_; only FrameReceiver touches it.
struct RxState {
  RxStage stage = RxStage::kHeader;
  FrameHeader hdr{};  // next header being read
  size_t hdr_got = 0;
  FrameHeader cur{};  // frame being processed
  std::string ctrl;   // its extents and aux
  // Inbound, between our challenge and the initiator's proof (handshake.h).
  std::unique_ptr<auth::TargetHandshake> proof;
  size_t ctrl_got = 0;
  // Where its payload lands: dst[dst_idx] + dst_off onwards, `remaining` bytes.
  std::vector<iovec> dst_own;
  const iovec* dst = nullptr;
  size_t ndst = 0;
  size_t dst_idx = 0;
  size_t dst_off = 0;
  uint64_t remaining = 0;
  // Or (landed payloads only) into strided runs: the write's descriptors, or a lazy
  // read's local runs, walked from `run_cur` (dst is null then).
  std::vector<PieceRun> runs_own;
  const PieceRun* runs = nullptr;
  size_t nruns = 0;
  RunCursor run_cur;
  // Small extents (out_msg.h gathers()): the payload is received into `landing`, a
  // chunk at a time, and copied out to dst (or runs) from there.
  bool gather = false;
  std::unique_ptr<char[]> landing;  // kStageBytes, allocated on first use
  std::vector<RegionPin> pins;  // the write's destination regions
  GenPin gens;                  // blocks the write being received was checked against
  Status reject;                // the write's block generations failed: its payload is discarded
  size_t notif_off = 0;         // where the write's notification starts in ctrl
  PendingPart read_part;        // the read response being received
  // Payload bound for device memory: received into pinned buffers, copied out
  // (device_staging.h).
  std::unique_ptr<cuda::ScatterPipe> pipe;
  bool staged = false;
  int cur_lowat = 1;  // SO_RCVLOWAT now set on the socket
  // Bytes the last read asked the socket for (FrameReceiver::receive: a read that got
  // fewer found the socket empty, so no read is spent to see EAGAIN).
  size_t asked = 0;
  // A compressed write (kWriteZ): its payload is received into `zbuf`; then both it
  // and `zdst`, the checked extents, go to a decode thread (compress.h Decoder).
  // zbuf grows as the payload's bytes arrive (doubling from kZbufFirstBytes), never
  // to the declared size at the header: a peer that announces 64 MiB and trickles
  // makes the receiver hold about what it sent.
  std::vector<uint8_t> zbuf;
  bool zgrow = false;  // the payload stage reads into zbuf (read_zbuf_payload)
  uint64_t zgot = 0;   // payload bytes in zbuf so far
  std::vector<iovec> zdst;
  int zdevice = -1;  // CUDA device of zdst (device_staging.h decodes it), or -1: host memory

  // True while a frame is partly received (its bytes must keep coming).
  bool mid_frame() const { return stage != RxStage::kHeader || hdr_got != 0; }
  // Lets go of what a killed connection was receiving: no device copy may land
  // after this, pins and block generations are released.
  void abandon();
};

// Only FrameReceiver makes one of these: the receive state is its to read and write
// (TcpConn::rx_state). A passkey rather than a friend, so the receiver sees nothing
// else of the connection's private state.
class RxAccess {
  RxAccess() {}  // user-provided: `RxAccess{}` elsewhere does not compile
  friend class FrameReceiver;
};

class TcpConn : public std::enable_shared_from_this<TcpConn> {
 public:
  // A connection this agent dialled and authenticated (handshake.h), to `peer_name`,
  // sitting in `slot` of `pc`. `owner` (null only in unit tests) reads it.
  static std::shared_ptr<TcpConn> dialled(int fd, ProgressThread* owner, std::string desc, std::string peer_name,
                                          std::weak_ptr<PeerConns> pc, uint32_t slot);
  // A connection accepted from `source` (an IP address), which must say hello
  // before `hello_deadline`.
  static std::shared_ptr<TcpConn> accepted(int fd, ProgressThread* owner, std::string desc, std::string source,
                                           Clock::time_point hello_deadline);
  ~TcpConn();
  TcpConn(const TcpConn&) = delete;
  TcpConn& operator=(const TcpConn&) = delete;

  // ---- Identity: fixed at construction, except the name an inbound connection
  // learns from its hello (authenticate). Readable from any thread.
  bool outbound() const { return outbound_; }  // dialled by this agent (we are the initiator)
  ProgressThread* owner() const { return owner_; }
  const std::string& source() const { return source_; }  // inbound: the peer's IP address
  // "peer 'x' at 1.2.3.4:5" / "peer 'x' (inbound connection from ...)", for messages.
  std::string desc() const;
  // The remote agent's name; empty until an inbound connection's hello is accepted.
  const std::string& peer_name() const;
  bool authed() const { return authed_.load(std::memory_order_acquire); }
  // The socket, -1 once closed for good (close_socket).
  int fd() const { return fd_.load(std::memory_order_acquire); }

  // ---- Receive side. lock_rx / try_lock_rx take rx_mu (see the top of this file);
  // everything below them expects it held.
  std::unique_lock<std::mutex> lock_rx() { return std::unique_lock<std::mutex>(rx_mu_); }
  std::unique_lock<std::mutex> try_lock_rx() { return std::unique_lock<std::mutex>(rx_mu_, std::try_to_lock); }
  RxState& rx_state(RxAccess) { return rx_; }
  // The inbound connection's hello from agent `name` was accepted. Once.
  void authenticate(std::string name);
  // The TLS session this connection's fd is the plaintext end of (tls.h), or null.
  // Set once, before the connection is handed to a progress thread.
  void set_tls(std::shared_ptr<TlsChannel> ch) { tls_ = std::move(ch); }
  const TlsChannel* tls() const { return tls_.get(); }
  // The socket is open and not lingering after kill(): frames may be read.
  bool open() const { return fd() >= 0 && !draining(); }
  // Killed: the write side is shut and the socket lingers until deadline().
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Inbound before its hello: when the hello is due. Draining: when lingering ends.
  Clock::time_point deadline() const { return Clock::time_point(Clock::duration(deadline_.load(std::memory_order_acquire))); }
  // Back-pressure: too much output is queued, or too many compressed batches are
  // decoding (decode_started): the connection must not be read.
  bool reading_paused() const {
    return rx_paused_.load(std::memory_order_acquire) || decode_paused_.load(std::memory_order_acquire);
  }
  // A compressed batch of this connection went to the decode threads (receiver_data.cc);
  // at kDecodeAhead (compress.h) of them reading pauses until decode_done().
  // Any thread (take smu_).
  void decode_started();
  void decode_done();
  // After a receive that took `got` bytes: records whether a frame is left half-read,
  // and when bytes last came, for frame_stalled().
  void note_received(uint64_t got);
  // Lets go of what a killed connection was receiving (RxState::abandon).
  void abandon_rx() { rx_.abandon(); }
  // After retire(): shuts the write side and lingers for `linger` so an error frame
  // we sent is read before the peer sees a reset. No-op without an owner or socket.
  void start_draining(Clock::duration linger);
  // Closes the socket for good (the owner removed it from epoll first).
  void close_socket();
  // Keeps an admission slot (admission.h) until close_socket() (or destruction).
  void hold(std::shared_ptr<void> ticket);
  // An authenticated peer's slot was taken (TcpTransport::admit): admitted once.
  bool admitted() const { return admitted_.load(std::memory_order_acquire); }
  void set_admitted() { admitted_.store(true, std::memory_order_release); }

  // ---- Deadlines (any thread, no lock). Timeout if a frame is half-read, or queued
  // output has not moved, for `limit` (`limit_s` in the message); OK otherwise.
  Status frame_stalled(Clock::time_point now, Clock::duration limit, double limit_s);

  // ---- Pending parts (each takes pmu_; the owner's npending follows the table).
  size_t pending_count();
  // Adds `part` of transfer `xfer_id`; false when the connection is dead.
  bool track(PendingPart part, uint64_t xfer_id);
  // Removes the pending part (xfer, batch) into *out; false if there is none.
  bool take_pending(uint64_t xfer, uint32_t batch, PendingPart* out);
  // Copies the pending read part (xfer, batch) into *out, leaving it pending until
  // its payload is in; false if there is none.
  bool find_pending_read(uint64_t xfer, uint32_t batch, PendingPart* out);
  // The id of a pending transfer past its deadline, 0 if none (looks only once
  // the earliest deadline has passed).
  uint64_t expired_transfer(Clock::time_point now);

  // ---- Send side (each takes smu_). The owner's epoll interest follows the queue:
  // EPOLLOUT while output waits, EPOLLIN unless a caller drives the connection or
  // back-pressure paused it.
  enum class SendResult {
    kSent,    // all of it left at once
    kQueued,  // the rest leaves when the socket is writable (the owner flushes it)
    kDead,    // dropped: the connection is dead, kill() resolved its parts
    kFailed,  // the send failed: kill_reason() says why; the owner must kill it
  };
  // Queues `m`, sending at once when nothing is queued. An inbound connection whose
  // queue passes kMaxQueuedCost / kMaxQueuedFrames stops being read (back-pressure).
  SendResult send(std::unique_ptr<OutMsg> m);
  // Sends queued output until the socket is full; reading resumes once the queue is
  // half drained. True when the connection must be killed (a send failed).
  bool flush();
  // Sends `m` now if nothing is queued (best effort: an error frame before closing).
  void send_if_idle(OutMsg& m);
  // Queued output that did not move for `limit`.
  bool output_stalled(Clock::time_point now, Clock::duration limit);
  // A caller starts (true) or stops reading the connection itself, so the owner
  // stops or resumes watching EPOLLIN. Starting fails on a dead connection.
  bool set_driven(bool on);
  size_t queued_frames();
  bool is_dead();
  void set_kill_reason(Status why);
  Status kill_reason();

  // ---- Both tables (take pmu_, then smu_).
  // Marks the connection dead and hands over what was in flight; its deadline flags
  // stop counting at the owner, and a pending handshake ends. False if it already
  // was dead (kill() runs once).
  bool retire(std::unordered_map<uint64_t, PendingPart>* pending, std::deque<std::unique_ptr<OutMsg>>* sq);
  // Removes the not yet started request frames of transfer `id` from the send
  // queue together with their pending parts, which are returned.
  std::vector<PendingPart> drop_unsent(uint64_t id);
  // Outbound: frees this connection's slot in its PeerConns (takes PeerConns::mu),
  // so the next post dials afresh.
  void leave_slot();

 private:
  TcpConn(int fd, bool outbound, ProgressThread* owner, std::string desc, std::string source, std::string peer_name,
          std::weak_ptr<PeerConns> pc, uint32_t slot, Clock::time_point deadline);
  // Re-registers the owner's epoll interest from the state below (holds smu_).
  void update_interest_locked();

  // ---- Identity (see above).
  const bool outbound_;
  ProgressThread* const owner_;
  const std::string base_desc_;
  const std::string source_;
  const std::weak_ptr<PeerConns> pc_;  // outbound: the slot table it sits in
  const uint32_t slot_;
  std::string peer_name_;           // written once, before authed_ is set
  std::shared_ptr<TlsChannel> tls_;
  std::atomic<bool> authed_{false};
  std::atomic<int> fd_;             // closed by close_socket() or the destructor
  std::atomic<bool> admitted_{false};
  std::mutex tickets_mu_;  // guards tickets_
  std::vector<std::shared_ptr<void>> tickets_;  // admission slots, released at close_socket

  // ---- Deadline bookkeeping, read by the owner's scan without locks: output is
  // stuck in the send queue (tx_blocked_), or a frame is partly received (rx_mid_)
  // and rx_progress_ is when bytes last came.
  std::atomic<bool> tx_blocked_{false};
  std::atomic<bool> rx_mid_{false};
  std::atomic<int64_t> rx_progress_{0};
  std::atomic<bool> rx_paused_{false};  // back-pressure (set and cleared under smu_)
  std::atomic<bool> decode_paused_{false};  // decodes_ reached kDecodeAhead (under smu_)
  std::atomic<bool> draining_{false};
  std::atomic<Clock::rep> deadline_;    // deadline()

  // ---- Receive side, guarded by rx_mu_.
  std::mutex rx_mu_;
  RxState rx_;

  // ---- Guarded by both pmu_ and smu_ (set while holding both).
  bool dead_ = false;

  // ---- Send side, guarded by smu_.
  std::mutex smu_;
  std::deque<std::unique_ptr<OutMsg>> sq_;
  uint32_t decodes_ = 0;  // compressed batches at the decode threads
  size_t sq_cost_ = 0;   // sum of cost() over sq_
  bool want_out_ = false;
  bool driven_ = false;  // a waiting caller is reading this connection (EPOLLIN off)
  Clock::time_point tx_progress_{};  // last time queued output moved (while want_out_)
  Status kill_reason_;               // why the owner should kill it
  bool kill_requested_ = false;      // a send failed: the owner must kill it

  // ---- Pending parts (initiator side), guarded by pmu_.
  std::mutex pmu_;
  std::unordered_map<uint64_t, PendingPart> pending_;               // by pending_key()
  Clock::time_point earliest_deadline_ = Clock::time_point::max();  // of the parts in pending_
};

}  // namespace pdkv::tcp
