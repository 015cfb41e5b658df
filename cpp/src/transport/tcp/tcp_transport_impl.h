// TcpTransport: the Transport implementation (tcp_transport.h) and the services
// its parts share. It wires together, in the roles every transport folder shares
// (docs/architecture.md, "One shape per transport folder"):
//   conn.h            one connection: its queues, tables, locks and lock order
//   handshake.h       dialling a peer (blocking, on the posting thread)
//   progress.h        the epoll threads that own connections (accept, back-pressure,
//                     deadlines) and their FrameReceiver (receiver.h)
//   wire.h            the frames, their rules and decoders (pure, fuzzed)
//   options.cc        TcpOptions::validate (pdkv/options/tcp.h)
// and tcp's own:
//   device_staging.h  device memory through pinned buffers
//   transfer_parts.h  prepared transfers, posts and parts in flight
//   out_msg.h, scatter.h, compress.h, guard.h, admission.h, tls.h
// and itself holds the peers' connection slots and the teardown of a connection
// (kill), which every part may need (tcp_transport.cc), prepare (prepare.cc), and
// post/notify/cancel (post.cc).
//
// Thread safety: the Transport methods as pdkv/transport.h says; the services below
// from any thread, with the locking each states.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pdkv/options/tcp.h"
#include "pdkv/spi/transport.h"
#include "transport/tcp/admission.h"
#include "transport/tcp/compress.h"
#include "transport/tcp/conn.h"
#include "transport/tcp/device_staging.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/guard.h"
#include "transport/tcp/progress.h"
#include "transport/tcp/transfer_parts.h"
#include "util/socket.h"

namespace pdkv::tcp {

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TcpOptions& opts);
  ~TcpTransport() override { shutdown(); }

  std::string_view name() const override { return "tcp"; }
  TransportCaps caps() const override;
  // Host memory, and device memory staged through pinned buffers. The CUDA driver is
  // loaded only when a transfer touches device memory (never at start-up: cuInit in
  // a process that later forks would break CUDA in its children); without one that
  // transfer fails with NotSupported naming the reason.
  static uint32_t mem_kinds() { return mem_kind_bit(MemKind::kHost) | mem_kind_bit(MemKind::kCuda); }
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override { return {Endpoint{"tcp", addr_.str()}}; }
  // Says that this agent accepts compressed writes, answers compressed reads, and
  // which codecs it decodes and encodes.
  std::string metadata_extra() const override { return encode_extra(encoder_->threads()); }
  bool can_reach(const AgentMetadata& peer) const override { return peer.find_endpoint("tcp") != nullptr; }
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  // Cuts `extents` into `prep`'s wire batches of at most `batch_bytes`.
  Status cut_batches(TcpPrepared& prep, const std::vector<ResolvedExtent>& extents, uint64_t batch_bytes) const;
  Result<std::shared_ptr<const PreparedOps>> prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                             std::vector<ResolvedExtent> extents,
                                                             std::shared_ptr<const GenClaim> claim) override;
  // Honours hints.compress (this transfer's compression mode instead of the agent's).
  Result<std::shared_ptr<const PreparedOps>> prepare_with(std::shared_ptr<const Peer> peer, OpKind op,
                                                          std::vector<ResolvedExtent> extents,
                                                          std::shared_ptr<const GenClaim> claim,
                                                          const TransferHints& hints) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override;
  Status connect(std::shared_ptr<const Peer> peer, double timeout_s) override;
  void drop_peer(const std::string& name) override;
  Result<std::string> fetch_metadata(const std::string& address, std::string_view secret, double timeout_s) override;

  // ---- Shared with the connections' parts.
  AgentHooks* hooks() const { return hooks_; }
  const TcpOptions& opts() const { return opts_; }
  FrameLimits frame_limits() const { return FrameLimits{hooks_->max_notif_bytes()}; }
  AuthBackoff& auth_backoff() { return backoff_; }
  // Counts inbound connections (TcpOptions::max_inbound_conns, max_inbound_per_peer).
  Admission& admission() { return admission_; }
  // Takes a slot for the inbound connection c, authenticated as `name`
  // (max_inbound_per_peer): OK (once per connection; again is a no-op), or
  // ResourceExhausted naming the peer, which the caller answers by failing c.
  // Call it right after the handshake authenticated c (receiver.cc on_proof, after
  // c->authenticate); the receiver also calls it at c's first frame after the
  // handshake (on_header), so the cap holds either way.
  Status admit(const std::shared_ptr<TcpConn>& c, const std::string& name);
  const std::shared_ptr<const TlsContext>& tls() const { return tls_; }
  DeviceStaging& staging() { return staging_; }
  Decoder& decoder() { return decoder_; }
  Encoder& encoder() { return *encoder_; }
  bool shutting_down() const { return shut_.load(std::memory_order_acquire); }
  // The progress thread that gets the next connection (round robin).
  ProgressThread* pick_thread() { return threads_[next_thread_++ % threads_.size()].get(); }
  // Logs a closed or refused connection: at most one line per second, with a count
  // of the lines held back (a flood of bad clients must not flood the log).
  void log_rejected(const std::string& line);

  // Retires c once: resolves its pending parts with `why` (other transfers than
  // `culprit` of a timeout get a ConnectionError naming it), drops its queued
  // output, frees its slot and lets the socket drain. kill() takes c's receive lock;
  // kill_locked() expects the caller to hold it.
  void kill(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit = 0);
  void kill_locked(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit = 0);
  // Sends an error frame (best effort, only if no output is queued), then
  // kill_locked(). Caller holds c's receive lock.
  void fail_conn_locked(const std::shared_ptr<TcpConn>& c, const Status& st, uint64_t xfer = 0, uint32_t batch = 0);
  // Resolves one part of a posted transfer; sends its separate notification once
  // the last data part succeeded.
  void resolve(const PendingPart& p, uint64_t bytes, const Status& st);

 private:
  Result<std::shared_ptr<PeerConns>> peer_conns(const std::shared_ptr<const Peer>& peer);
  // prepare()'s cut of the extents into batches (one frame each): plain descriptors
  // parallel to the local iovecs, or strided descriptors (kFlagStrided) for a peer
  // that takes them.
  static PeerFeatures peer_features(const Peer& peer);
  bool batch_full(const TcpPrepared& p, const TcpBatch& cur) const;
  void cut_plain_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents, uint64_t batch_bytes) const;
  void cut_strided_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents, uint64_t batch_bytes) const;
  // Host batch `b` of `prep` compressed with `kind` into `out` (its pieces listed first
  // when the transfer is lazy).
  Status encode_batch(const TcpPrepared& prep, const TcpBatch& b, CodecKind kind, EncodedBatch& out);
  // The live connection in `slot`, dialling a new one if `may_connect`. The dial
  // (connect + handshake) gives up at min(connect_timeout_s, `deadline`): a transfer's
  // first contact fails with Timeout at the transfer's deadline, never later
  // (docs/faults.md); a deadline already passed fails at once.
  Result<std::shared_ptr<TcpConn>> get_conn(PeerConns& pc, uint32_t slot, bool may_connect,
                                            Clock::time_point deadline = Clock::time_point::max());
  // Asks the owners of these connections to kill them with `why`.
  void request_kills(const std::vector<std::shared_ptr<TcpConn>>& cs, const Status& why);
  // Sends batch i of `post` (data from registered memory, from `staged`, or the
  // codec frames in `encoded` as a kWriteZ).
  void send_batch(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot,
                  std::shared_ptr<cuda::PinnedBuffer> staged, std::shared_ptr<EncodedBatch> encoded = nullptr,
                  std::shared_ptr<void> ticket = nullptr);
  // How a write to this peer goes (compress.h): plain, or compressed with a codec;
  // an error when compression was demanded and the peer cannot take it. A read asks
  // for compressed responses only from a peer that answers them (else plain);
  // *sample says a plain kAuto read samples the codec once landed (settle_read).
  Result<Choice> choose_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample);
  Choice choose_read_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample);
  // prep's compression options: the agent's, with this transfer's mode.
  TcpCompression compression_of(const TcpPrepared& prep) const;
  // Whether a write from device memory of `device` may be compressed under `z`.
  bool device_may_compress(const TcpCompression& z, int device);
  // Schedules the encoding of a compressed write's next batches while fewer than
  // kEncodeAhead of them are encoded and not yet sent. Each scheduled batch holds a
  // ticket whose release (its frame sent, dropped or failed) schedules the next.
  void pump_encodes(const std::shared_ptr<TcpPost>& post);
  // Encodes batch i of a compressed write, then sends it (on an encoder thread).
  void encode_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, std::shared_ptr<void> ticket);
  // Resolves one part (`batch`) of the transfer; when that made it terminal, feeds the
  // delivered throughput of a plain write to the peer's LinkChooser.
  void settle(const std::shared_ptr<TcpPost>& post, uint32_t batch, uint64_t bytes, const Status& st);
  // A read's data part: on the last one of a plain kAuto read, measures the link
  // and, when due, samples the codec on the landed bytes on an encoder thread before
  // resolving it (the read is not complete, so its memory is still pinned). True
  // when it took over resolving the part.
  bool settle_read(const std::shared_ptr<TcpPost>& post, uint64_t bytes, const Status& st);
  // Gathers batch i of a device-memory WRITE into a pinned buffer, then sends it
  // (on the staging thread).
  void stage_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot);
  void send_separate_notify(const std::shared_ptr<TcpPost>& p);
  void cancel(const std::shared_ptr<TcpPost>& p);
  // Reads `c` in the calling thread until `x` is terminal or `deadline` (see
  // Transfer::set_driver), blocking in poll (no spin). Gives up at once if another
  // thread holds the connection.
  void drive(const std::shared_ptr<TcpConn>& c, Transfer& x, Clock::time_point deadline, uint32_t spin_us);

  TcpOptions opts_;
  AgentHooks* hooks_ = nullptr;
  util::HostPort addr_;
  util::ScopedFd listen_fd_;
  std::vector<std::unique_ptr<ProgressThread>> threads_;
  std::atomic<uint32_t> next_thread_{0};
  std::atomic<bool> shut_{false};
  std::mutex mu_;  // guards peers_
  std::map<std::string, std::shared_ptr<PeerConns>> peers_;
  DeviceStaging staging_;
  // Compressed writes sent and compressed read responses answered (threads start on
  // the first); its codec figures drive kAuto.
  std::unique_ptr<Encoder> encoder_;
  std::shared_ptr<const TlsContext> tls_;  // TcpOptions::tls: every connection's TLS sessions (tls.h)
  Decoder decoder_;  // compressed writes and read responses received (threads start on the first)
  AuthBackoff backoff_;
  Admission admission_;
  LogLimiter reject_log_{std::chrono::seconds(1)};
};

}  // namespace pdkv::tcp
