// ShmTransport: the shm Transport (see shm_transport.cc for how it works) and
// the files it is split into. The roles every transport folder shares
// (docs/architecture.md, "One shape per transport folder") first:
//   shm_transport.cc  start-up and shutdown, binding and posting (the initiator)
//   conn.h            one control connection, its state and its lock order
//   handshake.h       the initiator's blocking handshake
//   progress.cc       the progress thread: accepting, reading control frames,
//                     deadlines, the initiator's answers, kill()
//   wire.h            control frames, their limits and decoders (pure, fuzzed)
//   options.cc        ShmOptions::validate (pdkv/options/shm.h)
// then shm's own:
//   target.cc         what this agent does as a peer's target: authenticate its
//                     hello, answer region and lease requests, take notifications,
//                     revoke regions on deregistration
//   peer_identity.h   who the peer is, as the kernel says (SO_PEERCRED, uid policy, pidfd)
//   remote_region.h   confirming a peer's region before first use, acking revokes
//   copy_ops.h        a bound transfer's copy ops, built from its runs (bounds checked)
//   copy_engine.h     the copies themselves and the copy threads
//
// Thread safety: the Transport methods as pdkv/transport.h says.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pdkv/options/shm.h"
#include "pdkv/spi/transport.h"
#include "transport/shm/copy_engine.h"
#include "transport/shm/ctl_guard.h"
#include "transport/shm/conn.h"
#include "util/socket.h"

namespace pdkv::shm {

struct ShmPrepared final : PreparedOps {
  std::shared_ptr<const Peer> peer;  // the metadata the extents were checked against
  std::shared_ptr<ShmPeerState> ps;
  OpKind op = OpKind::kWrite;
  std::vector<ResolvedExtent> extents;
  std::shared_ptr<const GenClaim> claim;  // checked by the target (a lease) at every post
  std::string claim_wire;                 // encode_claim(*claim)
  // Bound on first post; re-bound when its connection died.
  mutable std::mutex mu;
  mutable std::shared_ptr<const Binding> bound;
};

// False under the benchmark switch BenchSwitch::kShmOneLevel=1 (read once per process;
// docs/benchmarks.md): shm takes one-level runs only, as before two-level runs, to
// compare the two in one build.
bool two_level_runs_allowed();

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const ShmOptions& opts) : opts_(opts), connect_timeout_(opts.connect_timeout_s) {}
  ~ShmTransport() override { shutdown(); }

  std::string_view name() const override { return "shm"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.cross_host = false;
    c.local_mem_kinds = mem_kind_bit(MemKind::kHost);
    c.remote_mem_kinds = mem_kind_bit(MemKind::kHost);
    c.generations = true;
    c.direct_small_extents = true;  // memcpy / process_vm_writev per extent: staging = one more copy
    c.strided_extents = true;       // a strided run is one copy op (a memcpy loop)
    c.two_level_extents = two_level_runs_allowed();  // so is a two-level one (NHD <-> HND: O(heads) runs)
    return c;
  }
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override { return {Endpoint{"shm", path_}}; }
  bool can_reach(const AgentMetadata& peer) const override {
    const Endpoint* e = peer.find_endpoint("shm");
    if (!e || peer.host_id != hooks_->host_id()) return false;
    struct stat st {};
    return ::stat(e->address.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
  }
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  Result<std::shared_ptr<const PreparedOps>> prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                             std::vector<ResolvedExtent> extents,
                                                             std::shared_ptr<const GenClaim> claim) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override;
  Status connect(std::shared_ptr<const Peer> peer, double timeout_s) override;
  void drop_peer(const std::string& name) override;
  uint64_t notifications_unacknowledged() const override { return unacked_notifs_.load(std::memory_order_relaxed); }
  uint64_t share_pages_min_bytes() const override { return opts_.share_pages_min_bytes; }
  void region_removed(const RegionDesc& region) override;

 private:
  // Progress thread: accepting, reading frames, deadlines.
  void run();
  void check_deadlines();
  void accept_all();
  size_t pending_conns();
  // Kills pending (not yet authenticated) inbound connections whose dialer hung up;
  // returns how many.
  size_t reap_hung_up_pending();
  void on_readable(const std::shared_ptr<ShmConn>& c);
  void drain_control(const std::shared_ptr<ShmConn>& c);
  void handle_frame(const std::shared_ptr<ShmConn>& c);
  void handle_inbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h);
  void handle_outbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h);
  void on_hello(const std::shared_ptr<ShmConn>& c);
  void on_proof(const std::shared_ptr<ShmConn>& c);
  // A failed authentication: answered at once, or held back once the failure budget
  // is spent (ctl_guard.h).
  void refuse_auth(const std::shared_ptr<ShmConn>& c, const Status& st);
  void answer_region_req(const std::shared_ptr<ShmConn>& c, uint64_t id);
  void answer_lease_req(const std::shared_ptr<ShmConn>& c, uint64_t id);
  void answer_gen_req(const std::shared_ptr<ShmConn>& c, uint64_t id);
  void refuse(const std::shared_ptr<ShmConn>& c, const Status& st, uint64_t id = 0);
  void log_refusal(const Status& st);
  // notify_on_send: notifications that completed their transfer and were then never
  // acknowledged (`why`: the connection closed); counted and logged.
  void lose_notifications(const std::shared_ptr<ShmConn>& c, size_t n, const Status& why);
  void kill(const std::shared_ptr<ShmConn>& c, const Status& why);
  void add_conn(const std::shared_ptr<ShmConn>& c);
  // Initiator side: connections, region confirmation, copies.
  std::shared_ptr<ShmPeerState> peer_state(const std::shared_ptr<const Peer>& peer);
  // The live connection to ps's peer, dialled by `deadline` (capped at the connect
  // timeout) if there is none.
  Result<std::shared_ptr<ShmConn>> get_conn(ShmPeerState& ps, Clock::time_point deadline = Clock::time_point::max());
  // Round trips inside a transfer (region confirmation, block lease) wait until its
  // deadline, or the connect timeout for a transfer without one.
  Clock::time_point answer_by(Clock::time_point deadline) const {
    return deadline == Clock::time_point::max() ? util::deadline_after(connect_timeout_) : deadline;
  }
  Result<std::shared_ptr<const Binding>> bind(const ShmPrepared& p, Clock::time_point deadline);
  Result<uint64_t> send_lease_req(const std::shared_ptr<ShmConn>& c, const std::string& claim_wire,
                                  Clock::time_point deadline);
  Result<uint64_t> take_lease(const std::shared_ptr<ShmConn>& c, const std::string& claim_wire,
                              Clock::time_point deadline);
  static void end_lease(Job& job);
  // Shared generation tables: reads validate their claims without a round trip.
  Result<std::shared_ptr<RemoteGens>> gen_table(const std::shared_ptr<ShmConn>& c, const std::string& layout,
                                                Clock::time_point deadline);
  static Status check_gens(const RemoteGens& t, const GenClaim& claim, bool during, bool* retired);
  Result<std::shared_ptr<RemoteGens>> check_read_claim(const std::shared_ptr<ShmConn>& c, const GenClaim& claim,
                                                       Clock::time_point deadline);
  bool read_checked(const Transfer* x) {
    std::lock_guard<std::mutex> lk(checks_mu_);
    return read_checks_.count(x) > 0;
  }
  // Runs a queued job on a copy thread (or fails it if it was cancelled meanwhile).
  void run_job(Job& job);
  // After the copy: checks a read's generations again (finish_job), then resolves the
  // transfer, ends the lease, unpins and sends the notification (complete_job).
  void finish_job(Job& job, Status st);
  void complete_job(Job& job, Status st);
  void send_notify(const std::shared_ptr<ShmConn>& c, const std::shared_ptr<Transfer>& xfer,
                   const std::string& notif);
  static void unpin(const Binding& b);
  void wake() {
    uint64_t one = 1;
    if (evfd_ >= 0 && ::write(evfd_, &one, sizeof one) < 0) {
    }
  }
  // Makes the progress thread look at deadlines by `t` at the latest without waking
  // it now (a timerfd armed at the earliest such time; one syscall, no thread
  // switch): a Notify's acknowledgement deadline. Wakes it at once without a timerfd.
  void wake_at(Clock::time_point t);

  ShmOptions opts_;
  double connect_timeout_;
  AgentHooks* hooks_ = nullptr;
  std::string path_;
  util::ScopedFd listen_fd_;
  int epfd_ = -1;
  int evfd_ = -1;
  int tfd_ = -1;                      // deadline timer (wake_at), in epfd_
  std::mutex timer_mu_;               // armed_
  Clock::time_point armed_ = Clock::time_point::max();  // when tfd_ fires next (max: disarmed)
  std::thread th_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> shut_{false};
  std::atomic<uint64_t> unacked_notifs_{0};  // notify_on_send: sent, never acknowledged
  std::mutex mu_;  // conns_, peers_
  std::unordered_map<ShmConn*, std::shared_ptr<ShmConn>> conns_;
  std::map<std::string, std::shared_ptr<ShmPeerState>> peers_;
  // Reads checked against a shared generation table before their copy, to check
  // again after it (finish_job), by transfer.
  struct ReadCheck {
    std::shared_ptr<RemoteGens> table;
    std::shared_ptr<const GenClaim> claim;
  };
  std::mutex checks_mu_;
  std::unordered_map<const Transfer*, ReadCheck> read_checks_;
  CopyEngine copies_{[this](Job& job) { run_job(job); }};
  util::HandshakeThrottle throttle_;
  util::LogLimiter refusal_log_;
};

}  // namespace pdkv::shm
