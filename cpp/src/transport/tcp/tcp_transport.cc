#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/staging.h"
#include "pdkv/registry.h"
#include "transport/tcp/frame.h"
#include "transport/tcp/guard.h"
#include "transport/tcp/wire.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"

namespace pdkv::tcp {
namespace {

constexpr int kIovMax = 1024;
constexpr size_t kHdr = sizeof(FrameHeader);
constexpr uint64_t kAllocChunk = 1ull << 20;
constexpr double kStageWaitS = 60.0;  // a read responder waits this long for a staging buffer
// Back-pressure on an inbound connection: while more than this much bookkeeping
// (iovecs, pins, aux) or this many frames wait to be sent, its requests are not read.
constexpr size_t kMaxQueuedCost = 8u << 20;
constexpr size_t kMaxQueuedFrames = 256;
// Failed authentications: the first one from an (address, agent name) is free, then its
// hellos are refused for 0.1 s, 0.2 s, ... up to 10 s (docs/wire.md, guard.h).
constexpr double kAuthBackoffBaseS = 0.1;
constexpr double kAuthBackoffMaxS = 10.0;
constexpr size_t kAuthBackoffSources = 4096;
constexpr uint32_t kAuthFreeFailures = 1;
// The listener, out of file descriptors, stops watching for this long when it
// cannot even shed the pending connection.
constexpr auto kListenPause = std::chrono::milliseconds(100);

using util::errno_str;

struct TcpPrepared;
struct TcpPost;
class TcpConn;
class ProgressThread;
class TcpTransport;

struct TcpBatch {
  uint32_t first = 0;  // index into descs/iov
  uint32_t count = 0;
  uint64_t bytes = 0;
};

struct TcpPrepared final : PreparedOps {
  std::shared_ptr<const Peer> peer;
  OpKind op = OpKind::kWrite;
  std::vector<WireExtent> descs;  // remote side
  std::vector<iovec> iov;         // local side, parallel to descs
  std::vector<TcpBatch> batches;
  uint64_t total = 0;
  // Local extents in device memory: WRITE batches are gathered into pinned buffers
  // before sending, READ responses are scattered out of them (cuda/staging.h).
  bool staged = false;
  int device = -1;
  // Block generation claim (u32 length + claim) sent at the start of every frame's
  // aux, so the target checks it per frame before its bytes land or are sent.
  std::string claim_aux;
};

struct PeerConns : std::enable_shared_from_this<PeerConns> {
  std::shared_ptr<const Peer> peer;
  util::HostPort hp;
  std::mutex mu;
  std::vector<std::shared_ptr<TcpConn>> conns;
  std::atomic<uint32_t> rr{0};
};

// State of one posted transfer inside the transport.
struct TcpPost {
  std::shared_ptr<Transfer> xfer;
  std::shared_ptr<const TcpPrepared> prep;  // null for a notification-only post
  std::shared_ptr<PeerConns> pc;
  std::string notif;
  bool separate_notif = false;  // sent as kNotify after every data batch is acked
  std::atomic<uint32_t> data_left{0};
  std::atomic<bool> data_failed{false};  // a batch failed (or never left): send no notification
  std::mutex mu;
  std::vector<std::weak_ptr<TcpConn>> conns;  // for cancel
  Status connect_err;                          // guarded by mu: later batches fail fast
};

struct PendingPart {
  std::shared_ptr<TcpPost> post;
  uint32_t batch = 0;
  uint64_t bytes = 0;
  const iovec* dst = nullptr;  // kReadReq: where the response lands
  uint32_t ndst = 0;
};

inline uint64_t pkey(uint64_t xfer, uint32_t batch) { return (xfer << 32) ^ batch; }

struct OutMsg {
  FrameHeader hdr{};
  const void* descs = nullptr;
  size_t desc_bytes = 0;
  std::string aux;
  const iovec* data = nullptr;
  size_t ndata = 0;
  std::vector<iovec> own_iov;
  std::vector<RegionPin> pins;        // released once sent (read responses)
  GenPin gens;                        // blocks checked for this read response, released once sent
  std::shared_ptr<const void> keep;   // keeps descs/data alive
  std::shared_ptr<const void> lease;  // pinned staging buffer holding the data
  uint64_t total = 0;
  uint64_t sent = 0;
  size_t seg = 0;
  size_t seg_off = 0;

  size_t nsegs() const { return 3 + ndata; }
  iovec segment(size_t i) const {
    switch (i) {
      case 0: return {const_cast<FrameHeader*>(&hdr), kHdr};
      case 1: return {const_cast<void*>(descs), desc_bytes};
      case 2: return {const_cast<char*>(aux.data()), aux.size()};
      default: return data[i - 3];
    }
  }
  // Memory this message holds besides the registered data it points at.
  size_t cost() const { return sizeof(OutMsg) + own_iov.size() * sizeof(iovec) + pins.size() * sizeof(RegionPin) + aux.size(); }
  void finalize() {
    hdr.aux_len = static_cast<uint32_t>(aux.size());
    if (!own_iov.empty()) {
      data = own_iov.data();
      ndata = own_iov.size();
    }
    total = kHdr + desc_bytes + aux.size();
    for (size_t i = 0; i < ndata; ++i) total += data[i].iov_len;
  }
  void advance(size_t w) {
    sent += w;
    while (w > 0) {
      iovec v = segment(seg);
      size_t left = v.iov_len - seg_off;
      if (w >= left) {
        w -= left;
        ++seg;
        seg_off = 0;
      } else {
        seg_off += w;
        w = 0;
      }
    }
  }
};

// Destination of a payload that must be read and thrown away (a write whose block
// generations are stale): `bytes` (at most kMaxPayloadPerFrame) over one shared
// scratch buffer nobody reads.
std::vector<iovec> discard_iov(uint64_t bytes) {
  static constexpr size_t kScratch = 1u << 20;
  static char* const scratch = new char[kScratch];  // never freed: shared by every thread, contents unused
  std::vector<iovec> out;
  out.reserve(static_cast<size_t>((bytes + kScratch - 1) / kScratch));
  for (uint64_t left = bytes; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
    out.push_back({scratch, n});
    left -= n;
  }
  return out;
}

FrameHeader make_hdr(FrameType t, uint64_t xfer, uint32_t batch) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(t);
  h.xfer_id = xfer;
  h.batch = batch;
  return h;
}

// Sends as much of `m` as the socket takes. 1: all sent, 0: would block, -1: error (*err).
int send_some(int fd, OutMsg& m, int* err) {
  iovec iov[kIovMax];
  while (m.sent < m.total) {
    int n = 0;
    size_t off = m.seg_off;
    for (size_t s = m.seg; s < m.nsegs() && n < kIovMax; ++s) {
      iovec v = m.segment(s);
      if (v.iov_len > off) {
        iov[n].iov_base = static_cast<char*>(v.iov_base) + off;
        iov[n].iov_len = v.iov_len - off;
        ++n;
      }
      off = 0;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      *err = errno;
      return -1;
    }
    m.advance(static_cast<size_t>(w));
  }
  return 1;
}

enum class RxStage { kHeader, kControl, kPayload };

class TcpConn : public std::enable_shared_from_this<TcpConn> {
 public:
  TcpConn(int fd, bool outbound, std::string desc, std::string source = "")
      : fd(fd), outbound(outbound), desc(std::move(desc)), source(std::move(source)) {}
  ~TcpConn() {
    if (fd >= 0) ::close(fd);
  }
  int fd;
  const bool outbound;
  std::string desc;          // "peer 'x' at 1.2.3.4:5" for messages
  const std::string source;  // inbound: the peer's IP address (authentication back-off)
  std::string peer_name;     // remote agent's name once known
  ProgressThread* owner = nullptr;
  std::weak_ptr<PeerConns> pc;
  uint32_t slot = 0;

  // Guarded by both pmu and smu (set while holding both).
  bool dead = false;
  // Send side.
  std::mutex smu;
  std::deque<std::unique_ptr<OutMsg>> sq;
  size_t sq_cost = 0;   // sum of cost() over sq
  bool want_out = false;
  bool driven = false;  // a waiting caller is reading this connection (EPOLLIN off)
  Clock::time_point tx_progress{};  // last time queued output moved (while want_out)
  // Deadline bookkeeping read by the owner's scan: output is stuck in sq (tx_blocked),
  // or a frame is partly received (rx_mid) and rx_progress is when bytes last came.
  std::atomic<bool> tx_blocked{false};
  std::atomic<bool> rx_mid{false};
  std::atomic<int64_t> rx_progress{0};
  std::atomic<bool> rx_paused{false};  // back-pressure: too much output queued, EPOLLIN off
  // Pending parts (initiator side).
  std::mutex pmu;
  std::unordered_map<uint64_t, PendingPart> pending;
  Clock::time_point earliest_deadline = Clock::time_point::max();  // guarded by pmu

  // The receive state below is touched by whoever holds rx_mu: the owner thread, or a
  // caller waiting on a small transfer that reads its own ack (TcpTransport::drive).
  std::recursive_mutex rx_mu;
  bool authed = false;
  std::atomic<bool> draining{false};
  Clock::time_point hs_deadline = Clock::time_point::max();
  RxStage stage = RxStage::kHeader;
  FrameHeader hdr{};  // next header being read
  size_t hdr_got = 0;
  FrameHeader cur{};  // frame being processed
  std::string ctrl;
  size_t ctrl_got = 0;
  std::vector<iovec> dst_own;
  const iovec* dst = nullptr;
  size_t ndst = 0;
  size_t dst_idx = 0;
  size_t dst_off = 0;
  uint64_t remaining = 0;
  std::vector<RegionPin> rx_pins;
  GenPin rx_gens;           // blocks the write being received was checked against
  Status rx_reject;         // the write's block generations failed: its payload is discarded
  size_t rx_notif_off = 0;  // where the write's notification starts in ctrl
  PendingPart rx_part;
  // Payload bound for device memory: received into pinned buffers, copied out.
  std::unique_ptr<cuda::ScatterPipe> rx_pipe;
  bool rx_staged = false;
  int cur_lowat = 1;
  std::atomic<bool> kill_requested{false};
  Status kill_reason;  // guarded by smu
};

class ProgressThread {
 public:
  ProgressThread(TcpTransport* t, uint32_t index, uint32_t spin_us) : t_(t), index_(index), spin_us_(spin_us) {}
  ~ProgressThread() {
    if (epfd_ >= 0) ::close(epfd_);
    if (evfd_ >= 0) ::close(evfd_);
    if (spare_fd_ >= 0) ::close(spare_fd_);
  }
  Status start(int listen_fd);
  void stop();
  void wake() {
    uint64_t one = 1;
    ssize_t r = ::write(evfd_, &one, sizeof one);
    (void)r;
  }
  void wake_if_idle() {
    if (idle_.load(std::memory_order_acquire)) wake();
  }
  // Takes ownership of c's events. `handshake`: an inbound connection that must say
  // hello before c->hs_deadline (decided by the caller, which owns c until now).
  void add(const std::shared_ptr<TcpConn>& c, bool handshake);
  // Re-registers c's epoll interest from c.want_out and c.driven (caller holds c.smu).
  void set_interest(TcpConn& c);
  // Receives what c has, then records whether a frame is left half-read (its deadline).
  void on_readable(const std::shared_ptr<TcpConn>& c);
  void request_kill(const std::shared_ptr<TcpConn>& c);
  // Sets a deadline flag of a connection (rx_mid, tx_blocked), counting the set ones
  // so the thread keeps scanning deadlines while any is.
  void watch(std::atomic<bool>& flag, bool on) {
    if (flag.exchange(on, std::memory_order_acq_rel) != on) nwatch_.fetch_add(on ? 1 : -1, std::memory_order_acq_rel);
  }
  std::atomic<int64_t> npending{0};

 private:
  void run();
  void accept_all();
  // Out of file descriptors: accepts and closes one pending connection using the
  // spare descriptor. 1: shed one, 0: none pending, -1: no spare (or accept failed).
  int shed_one();
  void pause_listener(int err);
  // Reads until EAGAIN; returns the bytes read.
  uint64_t receive(const std::shared_ptr<TcpConn>& c);
  void flush(TcpConn& c);
  void scan_deadlines();
  // Timeout if c has a half-read frame or stuck output that did not move for
  // frame_timeout_s; OK otherwise.
  Status frame_stalled(TcpConn& c, Clock::time_point now);
  void drain(const std::shared_ptr<TcpConn>& c);
  bool handle_header(const std::shared_ptr<TcpConn>& c);
  bool handle_control(const std::shared_ptr<TcpConn>& c);
  void payload_done(const std::shared_ptr<TcpConn>& c);
  // Routes the current payload of `c` through its ScatterPipe (device destination).
  Status begin_staged_rx(TcpConn& c, int device);
  // A copy into device memory failed while receiving the current payload.
  void staged_rx_failed(const std::shared_ptr<TcpConn>& c, const Status& st);
  void set_lowat(TcpConn& c, int v);
  // Removes the pending part (xfer, batch) of `c` into *out; false if there is none.
  bool take_pending(TcpConn& c, uint64_t xfer, uint32_t batch, PendingPart* out);
  // Sends an error frame (best effort), then kills the connection.
  void fail_conn(const std::shared_ptr<TcpConn>& c, const Status& st, uint64_t xfer = 0, uint32_t batch = 0);

  TcpTransport* t_;
  uint32_t index_;
  uint32_t spin_us_;
  int epfd_ = -1;
  int evfd_ = -1;
  int listen_fd_ = -1;
  int spare_fd_ = -1;  // held in reserve for shedding connections at the fd limit
  bool listen_paused_ = false;
  Clock::time_point listen_resume_{};
  std::thread th_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> idle_{false};
  std::mutex mu_;
  std::unordered_map<TcpConn*, std::shared_ptr<TcpConn>> conns_;
  std::vector<std::shared_ptr<TcpConn>> kill_q_;
  std::vector<std::shared_ptr<TcpConn>> graveyard_;
  std::atomic<int> nslow_{0};   // handshaking or draining connections
  std::atomic<int> nwatch_{0};  // connections with a half-read frame or stuck output
  friend class TcpTransport;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const AgentConfig& cfg) : opts_(cfg.tcp) {}
  ~TcpTransport() override { shutdown(); }

  std::string_view name() const override { return "tcp"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.local_mem_kinds = mem_kinds();
    c.remote_mem_kinds = mem_kinds();
    c.generations = true;
    c.serves_metadata = true;
    return c;
  }
  // Host memory, and device memory staged through pinned buffers. The CUDA driver is
  // loaded only when a transfer touches device memory (never at start-up: cuInit in
  // a process that later forks would break CUDA in its children); without one that
  // transfer fails with NotSupported naming the reason.
  static uint32_t mem_kinds() { return mem_kind_bit(MemKind::kHost) | mem_kind_bit(MemKind::kCuda); }
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override { return {Endpoint{"tcp", addr_.str()}}; }
  bool can_reach(const AgentMetadata& peer) const override { return peer.find_endpoint("tcp") != nullptr; }
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
  Result<std::string> fetch_metadata(const std::string& address, std::string_view secret, double timeout_s) override;

  // Used by connections and threads.
  AgentHooks* hooks() const { return hooks_; }
  const TcpOptions& opts() const { return opts_; }
  void enqueue(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m);
  void kill(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit_xfer = 0);
  void resolve(const PendingPart& p, uint64_t bytes, const Status& st);
  ProgressThread* pick_thread() { return threads_[next_thread_++ % threads_.size()].get(); }
  // Reads `c` in the calling thread until `x` is terminal or `deadline` (see
  // Transfer::set_driver). Gives up at once if another thread holds the connection.
  void drive(const std::shared_ptr<TcpConn>& c, Transfer& x, Clock::time_point deadline, uint32_t spin_us);
  // The pinned staging pool, created on first use.
  Result<std::shared_ptr<cuda::Stager>> stager();
  // Answers a read request for device memory: gathers it on the staging thread.
  void respond_staged(const std::shared_ptr<TcpConn>& c, const FrameHeader& h, std::vector<iovec> src,
                      std::vector<RegionPin> pins, GenPin gens, uint64_t bytes, int device);
  bool shutting_down() const { return shut_.load(std::memory_order_acquire); }
  AuthBackoff& auth_backoff() { return backoff_; }
  FrameLimits frame_limits() const { return FrameLimits{hooks_->max_notif_bytes()}; }
  // Logs a closed or refused connection: at most one line per second, with a count
  // of the lines held back (a flood of bad clients must not flood the log).
  void log_rejected(const std::string& line);

 private:
  Result<std::shared_ptr<PeerConns>> peer_conns(const std::shared_ptr<const Peer>& peer);
  Result<std::shared_ptr<TcpConn>> get_conn(PeerConns& pc, uint32_t slot, bool may_connect);
  Result<util::ScopedFd> dial(const util::HostPort& hp, const std::string& target, uint64_t instance,
                              std::string_view secret, double timeout_s, std::string* peer_name);
  bool track(const std::shared_ptr<TcpConn>& c, PendingPart part, uint64_t xfer_id);
  // Sends batch i of `post` (data from registered memory, or from `staged`).
  void send_batch(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot,
                  std::shared_ptr<cuda::PinnedBuffer> staged);
  // Gathers batch i of a device-memory WRITE into a pinned buffer, then sends it.
  void stage_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot);
  // Runs `f` on the staging thread (in order).
  void run_staged(std::function<void()> f);
  void stage_loop();
  void send_separate_notify(const std::shared_ptr<TcpPost>& p);
  void cancel(const std::shared_ptr<TcpPost>& p);

  TcpOptions opts_;
  AgentHooks* hooks_ = nullptr;
  util::HostPort addr_;
  util::ScopedFd listen_fd_;
  std::vector<std::unique_ptr<ProgressThread>> threads_;
  std::atomic<uint32_t> next_thread_{0};
  std::atomic<bool> shut_{false};
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<PeerConns>> peers_;
  // Device-memory staging: the pool, and one thread that gathers batches in order.
  std::mutex stage_mu_;
  std::shared_ptr<cuda::Stager> stager_;
  std::condition_variable stage_cv_;
  std::deque<std::function<void()>> stage_q_;
  std::thread stage_th_;
  bool stage_stop_ = false;
  AuthBackoff backoff_{kAuthBackoffBaseS, kAuthBackoffMaxS, kAuthBackoffSources, kAuthFreeFailures};
  LogLimiter reject_log_{std::chrono::seconds(1)};
};

// ---------------------------------------------------------------- ProgressThread

Status ProgressThread::start(int listen_fd) {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || evfd_ < 0) return Internal("epoll/eventfd: " + errno_str(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the eventfd
  epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  if (listen_fd >= 0) {
    listen_fd_ = listen_fd;
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ev.data.ptr = this;  // the listener
    epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  }
  th_ = std::thread([this] { run(); });
  return Status::Ok();
}

void ProgressThread::stop() {
  stop_.store(true);
  wake();
  if (th_.joinable()) th_.join();
  std::vector<std::shared_ptr<TcpConn>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) all.push_back(c);
  }
  for (auto& c : all) t_->kill(c, ConnectionError("agent is shutting down"));
  std::lock_guard<std::mutex> lk(mu_);
  conns_.clear();
  graveyard_.clear();
}

void ProgressThread::add(const std::shared_ptr<TcpConn>& c, bool handshake) {
  c->owner = this;
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = c.get();
  epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd, &ev);
  if (handshake) wake();  // start the handshake timer
}

void ProgressThread::set_interest(TcpConn& c) {
  epoll_event ev{};
  const bool in = !c.driven && !c.rx_paused.load(std::memory_order_acquire);
  ev.events = (in ? uint32_t(EPOLLIN | EPOLLRDHUP) : 0u) | (c.want_out ? uint32_t(EPOLLOUT) : 0u);
  ev.data.ptr = &c;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, c.fd, &ev);
}

void ProgressThread::request_kill(const std::shared_ptr<TcpConn>& c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    kill_q_.push_back(c);
  }
  wake();
}

void ProgressThread::run() {
  epoll_event evs[64];
  auto last_active = Clock::now();
  auto next_scan = Clock::now();
  const auto spin = std::chrono::microseconds(spin_us_);
  // After activity the thread keeps waking every 20 ms for a while instead of sleeping
  // indefinitely, so the next post needs no eventfd wake-up (and deadlines are
  // enforced); a fully idle agent sleeps in epoll_wait and uses no CPU.
  constexpr auto kLinger = std::chrono::milliseconds(200);
  auto last_busy = Clock::now() - kLinger;
  while (!stop_.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    const bool busy = npending.load(std::memory_order_acquire) > 0 || nslow_.load() > 0 || nwatch_.load() > 0;
    if (busy) last_busy = now;
    int timeout = -1;
    if (spin_us_ > 0 && now - last_active < spin) {
      timeout = 0;
    } else if (busy || now - last_busy < kLinger) {
      timeout = 20;
    }
    if (listen_paused_) {
      if (now >= listen_resume_) {
        epoll_event lev{};
        lev.events = EPOLLIN;
        lev.data.ptr = this;
        epoll_ctl(epfd_, EPOLL_CTL_MOD, listen_fd_, &lev);
        listen_paused_ = false;
      } else if (timeout < 0 || timeout > 20) {
        timeout = 20;
      }
    }
    if (timeout < 0) idle_.store(true, std::memory_order_release);
    int n = ::epoll_wait(epfd_, evs, 64, timeout);
    idle_.store(false, std::memory_order_release);
    if (n < 0 && errno != EINTR) {
      PDKV_LOG_ERROR("epoll_wait: %s", errno_str(errno).c_str());
      break;
    }
    if (n > 0) last_active = Clock::now();
    for (int i = 0; i < n; ++i) {
      void* p = evs[i].data.ptr;
      if (p == nullptr) {
        uint64_t v;
        ssize_t r = ::read(evfd_, &v, sizeof v);
        (void)r;
        std::vector<std::shared_ptr<TcpConn>> kq;
        {
          std::lock_guard<std::mutex> lk(mu_);
          kq.swap(kill_q_);
        }
        for (auto& c : kq) {
          Status why;
          {
            std::lock_guard<std::mutex> lk(c->smu);
            why = c->kill_reason;
          }
          t_->kill(c, why.ok() ? ConnectionError("connection to " + c->desc + " failed") : why);
        }
        continue;
      }
      if (p == this) {
        accept_all();
        continue;
      }
      std::shared_ptr<TcpConn> c;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = conns_.find(static_cast<TcpConn*>(p));
        if (it == conns_.end()) continue;
        c = it->second;
      }
      // A hang-up or error while output is queued ends in flush (the send fails), also
      // when reading is paused by back-pressure.
      if (evs[i].events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) flush(*c);
      // A waiting caller may be reading this connection itself: leave it to them.
      std::unique_lock<std::recursive_mutex> rl(c->rx_mu, std::try_to_lock);
      if (!rl || c->fd < 0) continue;
      if (c->draining) {
        drain(c);
        continue;
      }
      if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) on_readable(c);
    }
    if (busy && Clock::now() >= next_scan) {
      scan_deadlines();
      next_scan = Clock::now() + std::chrono::milliseconds(10);
    }
    graveyard_.clear();
  }
}

void ProgressThread::accept_all() {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of descriptors (or kernel memory): the listen socket stays readable, so
      // returning would spin. Shed the pending connections, or stop watching a while.
      if (err == EMFILE || err == ENFILE) {
        const int shed = shed_one();
        if (shed > 0) continue;
        if (shed == 0) return;
      }
      pause_listener(err);
      return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char host[64] = "?";
    uint16_t port = 0;
    if (ss.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      port = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      port = ntohs(a->sin6_port);
    }
    auto c = std::make_shared<TcpConn>(
        fd, false, "inbound connection from " + std::string(host) + ":" + std::to_string(port), host);
    c->hs_deadline = util::deadline_after(t_->opts().handshake_timeout_s);
    ProgressThread* owner = t_->pick_thread();
    ++owner->nslow_;
    owner->add(c, true);
  }
}

int ProgressThread::shed_one() {
  if (spare_fd_ < 0) spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (spare_fd_ < 0) return -1;
  ::close(spare_fd_);
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  const int err = errno;
  if (fd >= 0) ::close(fd);  // the peer sees the connection closed and can retry later
  spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return (err == EAGAIN || err == EWOULDBLOCK) ? 0 : -1;
  t_->log_rejected("tcp: out of file descriptors: closed an incoming connection at once");
  return 1;
}

void ProgressThread::pause_listener(int err) {
  t_->log_rejected("tcp: accepting connections failed (" + errno_str(err) + "); pausing the listener for " +
                   std::to_string(kListenPause.count()) + " ms");
  epoll_event ev{};
  ev.events = 0;
  ev.data.ptr = this;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  listen_paused_ = true;
  listen_resume_ = Clock::now() + kListenPause;
}

bool ProgressThread::take_pending(TcpConn& c, uint64_t xfer, uint32_t batch, PendingPart* out) {
  {
    std::lock_guard<std::mutex> lk(c.pmu);
    auto it = c.pending.find(pkey(xfer, batch));
    if (it == c.pending.end()) return false;
    *out = std::move(it->second);
    c.pending.erase(it);
  }
  npending.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

void ProgressThread::set_lowat(TcpConn& c, int v) {
  if (v == c.cur_lowat) return;
  if (::setsockopt(c.fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) c.cur_lowat = v;
}

void ProgressThread::flush(TcpConn& c) {
  std::lock_guard<std::mutex> lk(c.smu);
  if (c.dead) return;
  c.tx_progress = Clock::now();  // writable: the peer is reading
  bool blocked = false;
  while (!c.sq.empty()) {
    int err = 0;
    int r = send_some(c.fd, *c.sq.front(), &err);
    if (r == 0) {
      blocked = true;  // EPOLLOUT stays armed
      break;
    }
    if (r < 0) {
      c.kill_reason = ConnectionError("sending to " + c.desc + " failed: " + errno_str(err));
      c.kill_requested = true;
      break;
    }
    c.sq_cost -= c.sq.front()->cost();
    c.sq.pop_front();  // sent: pins (read responses) are released here
  }
  bool changed = false;
  if (c.rx_paused.load() && c.sq_cost <= kMaxQueuedCost / 2 && c.sq.size() <= kMaxQueuedFrames / 2) {
    c.rx_paused = false;  // back-pressure over: read requests again
    changed = true;
  }
  if (!blocked && c.want_out) {
    c.want_out = false;
    watch(c.tx_blocked, false);
    changed = true;
  }
  if (changed) set_interest(c);
  if (blocked) return;
  if (c.kill_requested) {
    std::lock_guard<std::mutex> lk2(mu_);
    auto it = conns_.find(&c);
    if (it != conns_.end()) kill_q_.push_back(it->second);
    wake();
  }
}

void ProgressThread::drain(const std::shared_ptr<TcpConn>& c) {
  char buf[65536];
  for (;;) {
    ssize_t r = ::recv(c->fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) continue;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && Clock::now() < c->hs_deadline) return;
    break;  // EOF, error or drain deadline: close for good
  }
  epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
  ::close(c->fd);
  c->fd = -1;
  c->draining = false;
  --nslow_;
  std::lock_guard<std::mutex> lk(mu_);
  graveyard_.push_back(c);
  conns_.erase(c.get());
}

void ProgressThread::scan_deadlines() {
  const auto now = Clock::now();
  std::vector<std::pair<std::shared_ptr<TcpConn>, Status>> doomed;
  std::vector<uint64_t> culprits;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) {
      if (c->fd < 0) continue;
      if (c->draining) {
        if (now >= c->hs_deadline) {
          doomed.emplace_back(c, Status::Ok());
          culprits.push_back(0);
        }
        continue;
      }
      if (!c->authed && !c->outbound) {
        if (now >= c->hs_deadline) {
          doomed.emplace_back(c, TimeoutError(c->desc + " did not complete the handshake in time"));
          culprits.push_back(0);
        }
        continue;  // a half-sent hello is bounded by the handshake deadline
      }
      Status stalled = frame_stalled(*c, now);
      if (!stalled.ok()) {
        doomed.emplace_back(c, std::move(stalled));
        culprits.push_back(0);
        continue;
      }
      std::lock_guard<std::mutex> lk2(c->pmu);
      if (c->earliest_deadline > now) continue;
      // Find the transfer that expired.
      Clock::time_point earliest = Clock::time_point::max();
      uint64_t culprit = 0;
      for (auto& [k, part] : c->pending) {
        auto d = part.post->xfer->deadline();
        if (d <= now && culprit == 0) culprit = part.post->xfer->id();
        earliest = std::min(earliest, d);
      }
      c->earliest_deadline = earliest;
      if (culprit) {
        doomed.emplace_back(c, TimeoutError("transfer " + std::to_string(culprit) + " to " + c->desc +
                                            " timed out; the peer stalled or the link is too slow"));
        culprits.push_back(culprit);
      }
    }
  }
  size_t ci = 0;
  for (auto& [c, st] : doomed) {
    const uint64_t culprit = culprits[ci++];
    // A caller driving c (TcpTransport::drive) checks the same deadlines itself.
    std::unique_lock<std::recursive_mutex> rl(c->rx_mu, std::try_to_lock);
    if (!rl || c->fd < 0) continue;
    if (c->draining) {
      drain(c);
      continue;
    }
    if (!c->outbound) {
      fail_conn(c, st);  // tell the silent client why it is dropped
    } else {
      t_->kill(c, st, culprit);
    }
  }
}

Status ProgressThread::frame_stalled(TcpConn& c, Clock::time_point now) {
  const auto limit = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(t_->opts().frame_timeout_s));
  if (c.rx_mid.load(std::memory_order_acquire)) {
    const Clock::time_point last{Clock::duration(c.rx_progress.load(std::memory_order_acquire))};
    if (now - last >= limit)
      return TimeoutError(c.desc + " stopped sending in the middle of a frame (no byte for " +
                          std::to_string(t_->opts().frame_timeout_s) + " s)");
  }
  if (c.tx_blocked.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(c.smu);
    if (c.want_out && now - c.tx_progress >= limit)
      return TimeoutError(c.desc + " stopped reading: queued frames did not move for " +
                          std::to_string(t_->opts().frame_timeout_s) + " s");
  }
  return Status::Ok();
}

void ProgressThread::fail_conn(const std::shared_ptr<TcpConn>& c, const Status& st, uint64_t xfer, uint32_t batch) {
  t_->log_rejected("closing " + c->desc + ": " + st.to_string());
  {
    // Best effort: tell the peer why, unless output is already queued.
    std::lock_guard<std::mutex> lk(c->smu);
    if (!c->dead && c->sq.empty()) {
      OutMsg m;
      m.hdr = make_hdr(FrameType::kError, xfer, batch);
      m.hdr.status = static_cast<uint32_t>(st.code());
      m.aux = st.message().substr(0, kMaxErrorBytes);
      m.finalize();
      int err = 0;
      send_some(c->fd, m, &err);
    }
  }
  t_->kill(c, st);
}

void ProgressThread::on_readable(const std::shared_ptr<TcpConn>& c) {
  const uint64_t got = receive(c);
  if (c->fd < 0 || c->draining) return;  // closed
  // A half-read frame (header, control or payload) must keep moving: scan_deadlines
  // closes the connection after frame_timeout_s without a byte.
  const bool mid = c->stage != RxStage::kHeader || c->hdr_got != 0;
  if (got > 0 || !mid) c->rx_progress.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
  watch(c->rx_mid, mid);
}

// Reads until EAGAIN. Returns early if the connection was killed or paused.
uint64_t ProgressThread::receive(const std::shared_ptr<TcpConn>& c) {
  iovec iov[kIovMax];
  uint64_t got = 0;
  uint64_t budget = 64ull << 20;  // fairness between connections
  while (c->fd >= 0 && !c->draining && budget > 0 && !c->rx_paused.load(std::memory_order_acquire)) {
    ssize_t r = 0;
    switch (c->stage) {
      case RxStage::kHeader: {
        r = ::recv(c->fd, reinterpret_cast<char*>(&c->hdr) + c->hdr_got, kHdr - c->hdr_got, MSG_DONTWAIT);
        if (r > 0) {
          got += static_cast<uint64_t>(r);
          c->hdr_got += static_cast<size_t>(r);
          if (c->hdr_got == kHdr && !handle_header(c)) return got;
          continue;
        }
        break;
      }
      case RxStage::kControl: {
        r = ::recv(c->fd, c->ctrl.data() + c->ctrl_got, c->ctrl.size() - c->ctrl_got, MSG_DONTWAIT);
        if (r > 0) {
          got += static_cast<uint64_t>(r);
          c->ctrl_got += static_cast<size_t>(r);
          if (c->ctrl_got == c->ctrl.size() && !handle_control(c)) return got;
          continue;
        }
        break;
      }
      case RxStage::kPayload: {
        if (c->rx_staged) {
          const iovec sp = c->rx_pipe->space();
          r = ::recv(c->fd, sp.iov_base, sp.iov_len, MSG_DONTWAIT);
          if (r > 0) {
            got += static_cast<uint64_t>(r);
            budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(r));
            c->remaining -= static_cast<uint64_t>(r);
            Status st = c->rx_pipe->received(static_cast<uint64_t>(r));
            if (!st.ok()) {
              staged_rx_failed(c, st);
              return got;
            }
            if (c->remaining == 0) {
              payload_done(c);
              if (c->fd < 0) return got;
            }
            continue;
          }
          break;
        }
        int n = 0;
        size_t i = c->dst_idx;
        for (; i < c->ndst && n < kIovMax - 1; ++i) {
          size_t off = (i == c->dst_idx) ? c->dst_off : 0;
          iov[n].iov_base = static_cast<char*>(c->dst[i].iov_base) + off;
          iov[n].iov_len = c->dst[i].iov_len - off;
          ++n;
        }
        const bool last = (i == c->ndst);
        if (last) iov[n++] = {&c->hdr, kHdr};  // pick up the next header in the same call
        msghdr mh{};
        mh.msg_iov = iov;
        mh.msg_iovlen = static_cast<size_t>(n);
        r = ::recvmsg(c->fd, &mh, MSG_DONTWAIT);
        if (r > 0) {
          got += static_cast<uint64_t>(r);
          budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(r));
          uint64_t take = std::min<uint64_t>(static_cast<uint64_t>(r), c->remaining);
          uint64_t extra = static_cast<uint64_t>(r) - take;
          c->remaining -= take;
          while (take > 0) {
            size_t left = c->dst[c->dst_idx].iov_len - c->dst_off;
            if (take >= left) {
              take -= left;
              ++c->dst_idx;
              c->dst_off = 0;
            } else {
              c->dst_off += take;
              take = 0;
            }
          }
          if (c->remaining == 0) {
            c->hdr_got = extra;
            payload_done(c);
            if (c->fd < 0) return got;
            if (c->hdr_got == kHdr && !handle_header(c)) return got;
          }
          continue;
        }
        break;
      }
    }
    if (r == 0) {
      const bool mid = c->stage != RxStage::kHeader || c->hdr_got != 0;
      t_->kill(c, ConnectionError(mid ? c->desc + " closed the connection in the middle of a frame"
                                      : c->desc + " closed the connection"));
      return got;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (c->stage == RxStage::kPayload && t_->opts().rcvlowat_bytes > 0) {
        set_lowat(*c, static_cast<int>(std::max<uint64_t>(
                          1, std::min<uint64_t>(t_->opts().rcvlowat_bytes, c->remaining / 2))));
      }
      return got;
    }
    t_->kill(c, ConnectionError("receiving from " + c->desc + " failed: " + errno_str(errno)));
    return got;
  }
  return got;
}

// A full header is in c->hdr. Validates it and sets up the next stage.
bool ProgressThread::handle_header(const std::shared_ptr<TcpConn>& c) {
  c->cur = c->hdr;
  c->hdr_got = 0;
  const FrameHeader& h = c->cur;
  auto bad = [&](const std::string& why) {
    fail_conn(c, ProtocolError(why), h.xfer_id, h.batch);
    return false;
  };
  // One place decides what may arrive here, and how large, before anything is
  // allocated (frame.h, docs/wire.md).
  const ConnState state{c->outbound ? ConnRole::kOutbound : ConnRole::kInbound,
                        c->outbound || c->authed ? ConnPhase::kOpen : ConnPhase::kHandshake};
  Status valid = check_header(h, state, t_->frame_limits());
  if (!valid.ok()) return bad(valid.message() + " from " + c->desc);
  const auto type = static_cast<FrameType>(h.type);
  switch (type) {
    case FrameType::kAck: {
      if (h.aux_len > 0) break;  // a failure message follows (handle_control)
      PendingPart part;
      if (!take_pending(*c, h.xfer_id, h.batch, &part))
        return bad("ack for unknown transfer " + std::to_string(h.xfer_id));
      t_->resolve(part, part.bytes,
                  h.status == 0 ? Status::Ok() : Status(status_code_from_wire(h.status), "peer reported failure"));
      c->stage = RxStage::kHeader;
      return true;
    }
    case FrameType::kReadResp: {
      bool known = false;
      {
        std::lock_guard<std::mutex> lk(c->pmu);
        auto it = c->pending.find(pkey(h.xfer_id, h.batch));
        if (it != c->pending.end() && it->second.dst != nullptr) {
          c->rx_part = it->second;
          known = true;
        }
      }
      // (Not under pmu: failing the connection takes it.)
      if (!known) return bad("read response for unknown transfer " + std::to_string(h.xfer_id));
      if (h.payload != c->rx_part.bytes)
        return bad("read response carries " + std::to_string(h.payload) + " bytes, expected " +
                   std::to_string(c->rx_part.bytes));
      c->dst = c->rx_part.dst;
      c->ndst = c->rx_part.ndst;
      c->dst_idx = 0;
      c->dst_off = 0;
      c->remaining = h.payload;
      c->stage = RxStage::kPayload;
      if (c->rx_part.post->prep->staged) {
        Status st = begin_staged_rx(*c, c->rx_part.post->prep->device);
        if (!st.ok()) {
          t_->kill(c, st.with_context("receiving a read response into device memory"));
          return false;
        }
      }
      return true;
    }
    default:
      break;
  }
  const uint64_t ctrl = control_bytes(h);  // bounded by check_header
  if (ctrl == 0) return handle_control(c);
  c->ctrl.resize(ctrl);
  c->ctrl_got = 0;
  c->stage = RxStage::kControl;
  return true;
}

bool ProgressThread::handle_control(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = c->cur;
  const auto type = static_cast<FrameType>(h.type);
  AgentHooks* hooks = t_->hooks();
  c->stage = RxStage::kHeader;
  switch (type) {
    case FrameType::kHello: {
      auto body = decode_hello(c->ctrl);
      if (!body.ok()) {
        const Status& e = body.status();
        fail_conn(c, e.code() == StatusCode::kVersionMismatch
                         ? e
                         : ProtocolError("malformed hello from " + c->desc + ": " + e.message()));
        return false;
      }
      const std::string& from = body->from;
      // A (source, agent name) that recently failed to authenticate waits before its
      // next guess is even looked at; other agents on the same host do not (guard.h).
      const double wait = t_->auth_backoff().wait_s(c->source, from, Clock::now());
      if (wait > 0) {
        char left[32];
        snprintf(left, sizeof left, "%.1f", wait);
        fail_conn(c, AuthFailed("too many failed authentications from " + c->source + " (as agent '" + from +
                                "'); retry in " + left + " s"));
        return false;
      }
      if (!hooks->secret_matches(body->secret)) {
        t_->auth_backoff().failed(c->source, from, Clock::now());
        fail_conn(c, AuthFailed("agent '" + from + "' presented the wrong secret to agent '" + hooks->agent_name() + "'"));
        return false;
      }
      t_->auth_backoff().succeeded(c->source, from);
      const std::string& to = body->to;
      const uint64_t expect = body->instance;
      if (!to.empty() && to != hooks->agent_name()) {
        fail_conn(c, AuthFailed("this is agent '" + hooks->agent_name() + "', not '" + to + "'"));
        return false;
      }
      if (expect != 0 && expect != hooks->instance_id()) {
        fail_conn(c, StalePeer("agent '" + hooks->agent_name() +
                               "' restarted since its metadata was fetched; fetch it again and re-add the peer"));
        return false;
      }
      c->authed = true;
      c->peer_name = from;
      c->desc = "peer '" + from + "' (" + c->desc + ")";
      --nslow_;
      auto m = std::make_unique<OutMsg>();
      m->hdr = make_hdr(FrameType::kHelloAck, 0, 0);
      m->aux = encode_hello_ack(HelloAckBody{hooks->instance_id(), hooks->agent_name()});
      m->finalize();
      t_->enqueue(c, std::move(m));
      return true;
    }
    case FrameType::kMetaReq: {
      auto m = std::make_unique<OutMsg>();
      m->hdr = make_hdr(FrameType::kMetaResp, 0, 0);
      m->aux = hooks->metadata_blob();
      m->finalize();
      t_->enqueue(c, std::move(m));
      return true;
    }
    case FrameType::kWrite:
    case FrameType::kReadReq: {
      const auto* d = reinterpret_cast<const WireExtent*>(c->ctrl.data());
      const uint32_t n = h.count;
      std::vector<iovec> iov;
      std::vector<RegionPin> pins;
      iov.reserve(n);
      uint64_t last_region = 0;
      const RegionDesc* last = nullptr;
      int device = -1;  // set when a destination/source is device memory
      for (uint32_t i = 0; i < n; ++i) {
        WireExtent e;
        std::memcpy(&e, d + i, sizeof e);
        Status err;
        if (e.len == 0) {
          err = ProtocolError("extent " + std::to_string(i) + " has length 0");
        } else if (last && e.region == last_region) {
          if (!extent_in_region(e.offset, e.len, last->len))
            err = OutOfRange("bytes [" + std::to_string(e.offset) + ", +" + std::to_string(e.len) +
                             ") fall outside region " + std::to_string(e.region) + " (" + std::to_string(last->len) +
                             " bytes)");
        } else {
          uint64_t addr = 0;
          auto pin = hooks->region_table().pin(e.region, e.offset, e.len, true, TcpTransport::mem_kinds(), &addr);
          if (!pin.ok()) {
            err = pin.status();
          } else {
            last = pin->desc();
            last_region = e.region;
            if (last->kind == MemKind::kCuda && device < 0) device = last->device;
            pins.push_back(std::move(pin).value());
          }
        }
        if (!err.ok()) {
          fail_conn(c, Status(err.code(), std::string(type == FrameType::kWrite ? "write" : "read") +
                                              " request from " + c->desc + " rejected: " + err.message()),
                    h.xfer_id, h.batch);
          return false;
        }
        iov.push_back({reinterpret_cast<void*>(last->addr + e.offset), e.len});
      }
      // Total size (no overflow) and, for a write, the declared payload.
      auto sizes = check_extents(d, n, h);
      if (!sizes.ok()) {
        fail_conn(c, ProtocolError(sizes.status().message() + " (from " + c->desc + ")"), h.xfer_id, h.batch);
        return false;
      }
      const uint64_t sum = *sizes;
      const std::string_view aux = std::string_view(c->ctrl).substr(size_t(n) * sizeof(WireExtent));
      auto parts = split_data_aux(h, aux);
      if (!parts.ok()) {
        fail_conn(c, ProtocolError(parts.status().message() + " (from " + c->desc + ")"), h.xfer_id, h.batch);
        return false;
      }
      c->rx_notif_off = c->ctrl.size() - parts->notif.size();
      // Block generations: checked (and the blocks pinned) before a byte lands or is
      // sent. A stale claim fails this part only: the payload is discarded.
      GenPin gens;
      Status reject;
      if (h.flags & kFlagGens) {
        auto claim = decode_claim(parts->claim);
        if (!claim.ok()) {
          fail_conn(c, ProtocolError(claim.status().message() + " (from " + c->desc + ")"), h.xfer_id, h.batch);
          return false;
        }
        auto pin = hooks->check_generations(*claim);
        if (pin.ok()) gens = std::move(pin).value(); else reject = pin.status();
      }
      if (!reject.ok() && type == FrameType::kReadReq) {
        auto m = std::make_unique<OutMsg>();
        m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
        m->hdr.status = static_cast<uint32_t>(reject.code());
        m->aux = reject.message().substr(0, kMaxErrorBytes);
        m->finalize();
        t_->enqueue(c, std::move(m));
        return true;
      }
      if (!reject.ok()) {  // a write: receive its payload into scratch memory
        pins.clear();
        iov = discard_iov(sum);
        device = -1;
      }
      if (type == FrameType::kReadReq && device >= 0) {
        t_->respond_staged(c, h, std::move(iov), std::move(pins), std::move(gens), sum, device);
        return true;
      }
      if (type == FrameType::kReadReq) {
        auto m = std::make_unique<OutMsg>();
        m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
        m->hdr.payload = sum;
        m->own_iov = std::move(iov);
        m->pins = std::move(pins);
        m->gens = std::move(gens);
        m->finalize();
        t_->enqueue(c, std::move(m));
        return true;
      }
      c->rx_gens = std::move(gens);
      c->rx_reject = reject;
      c->dst_own = std::move(iov);
      c->dst = c->dst_own.data();
      c->ndst = c->dst_own.size();
      c->dst_idx = 0;
      c->dst_off = 0;
      c->remaining = sum;
      c->rx_pins = std::move(pins);
      c->stage = RxStage::kPayload;
      if (device >= 0) {
        Status st = begin_staged_rx(*c, device);
        if (!st.ok()) {
          fail_conn(c, Status(st.code(), "write request from " + c->desc + " cannot be received into device memory: " +
                                             st.message()),
                    h.xfer_id, h.batch);
          return false;
        }
      }
      return true;
    }
    case FrameType::kAck: {  // a failed part with its message (block generations)
      PendingPart part;
      if (!take_pending(*c, h.xfer_id, h.batch, &part)) {
        fail_conn(c, ProtocolError("ack for unknown transfer " + std::to_string(h.xfer_id) + " from " + c->desc),
                  h.xfer_id, h.batch);
        return false;
      }
      t_->resolve(part, 0, Status(status_code_from_wire(h.status), "peer '" + c->peer_name + "': " + c->ctrl));
      return true;
    }
    case FrameType::kNotify: {
      hooks->deliver_notification(Notification{c->peer_name, c->ctrl});
      auto m = std::make_unique<OutMsg>();
      m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
      m->finalize();
      t_->enqueue(c, std::move(m));
      return true;
    }
    case FrameType::kError: {
      Status st(status_code_from_wire(h.status), c->desc + " refused the request: " + c->ctrl);
      PendingPart part;
      const bool found = take_pending(*c, h.xfer_id, h.batch, &part);
      // Retire the connection before the caller can learn of the failure, so its next
      // transfer opens a fresh connection instead of racing onto this closing one.
      t_->kill(c, ConnectionError(c->desc + " closed the connection after an error: " + c->ctrl));
      if (found) t_->resolve(part, 0, st);
      return false;
    }
    default:
      fail_conn(c, Internal("unhandled frame type " + std::to_string(h.type)));
      return false;
  }
}

Status ProgressThread::begin_staged_rx(TcpConn& c, int device) {
  if (!c.rx_pipe) {
    PDKV_ASSIGN_OR_RETURN(auto st, t_->stager());
    c.rx_pipe = std::make_unique<cuda::ScatterPipe>(std::move(st));
  }
  PDKV_RETURN_IF_ERROR(c.rx_pipe->begin(device, c.dst, c.ndst, c.remaining));
  c.rx_staged = true;
  return Status::Ok();
}

void ProgressThread::staged_rx_failed(const std::shared_ptr<TcpConn>& c, const Status& st) {
  const FrameHeader h = c->cur;
  c->rx_staged = false;
  c->rx_pipe->abandon();
  if (static_cast<FrameType>(h.type) == FrameType::kWrite) {
    fail_conn(c, Status(st.code(), "copying the payload from " + c->desc + " into device memory failed: " + st.message()),
              h.xfer_id, h.batch);
  } else {
    // The rest of the payload is unread: the stream cannot be resynchronized.
    t_->kill(c, st.with_context("copying a read response into device memory"));
  }
}

void ProgressThread::payload_done(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = c->cur;
  c->stage = RxStage::kHeader;
  set_lowat(*c, 1);
  Status staged;
  if (c->rx_staged) {
    c->rx_staged = false;
    staged = c->rx_pipe->finish();  // every byte reached the device before the ack
    if (!staged.ok() && static_cast<FrameType>(h.type) == FrameType::kWrite) {
      fail_conn(c, Status(staged.code(), "copying the payload from " + c->desc + " into device memory failed: " +
                                             staged.message()),
                h.xfer_id, h.batch);
      return;
    }
  }
  if (static_cast<FrameType>(h.type) == FrameType::kWrite) {
    c->rx_pins.clear();
    c->rx_gens.reset();  // landed: a bump of these blocks may return now
    c->dst_own.clear();
    const Status reject = std::move(c->rx_reject);
    c->rx_reject = Status::Ok();
    auto m = std::make_unique<OutMsg>();
    m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
    if (!reject.ok()) {  // discarded: no notification
      m->hdr.status = static_cast<uint32_t>(reject.code());
      m->aux = reject.message().substr(0, kMaxErrorBytes);
    } else if (h.flags & kFlagNotif) {
      t_->hooks()->deliver_notification(Notification{c->peer_name, c->ctrl.substr(c->rx_notif_off)});
    }
    m->finalize();
    t_->enqueue(c, std::move(m));
    return;
  }
  // Read response complete.
  PendingPart part;
  const bool found = take_pending(*c, h.xfer_id, h.batch, &part);
  c->rx_part = PendingPart{};
  c->dst = nullptr;
  if (found) t_->resolve(part, staged.ok() ? part.bytes : 0, staged.with_context("copying a read response into device memory"));
}

// ---------------------------------------------------------------- TcpTransport

void TcpTransport::log_rejected(const std::string& line) {
  if (util::log_level() < util::LogLevel::kWarn) return;
  uint64_t held = 0;
  if (!reject_log_.allow(Clock::now(), &held)) return;
  if (held > 0) {
    PDKV_LOG_WARN("%s (%llu similar lines suppressed in the last second)", line.c_str(),
                  static_cast<unsigned long long>(held));
  } else {
    PDKV_LOG_WARN("%s", line.c_str());
  }
}

// The host to publish: the listen host, or for a wildcard bind (0.0.0.0 / ::) the
// first non-loopback address of an interface that is up (peers cannot dial a
// wildcard). Agent.connect() also substitutes the host it actually reached.
std::string advertised_host(const std::string& listen) {
  if (listen != "0.0.0.0" && listen != "::" && listen != "[::]") return listen;
  const bool v6 = listen != "0.0.0.0";
  ifaddrs* ifs = nullptr;
  std::string found;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i && found.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      char buf[INET6_ADDRSTRLEN] = {0};
      if (i->ifa_addr->sa_family == AF_INET && !v6) {
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
        found = buf;
      } else if (i->ifa_addr->sa_family == AF_INET6 && v6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
        if (IN6_IS_ADDR_LINKLOCAL(&a->sin6_addr)) continue;
        inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
        found = buf;
      }
    }
    ::freeifaddrs(ifs);
  }
  if (found.empty()) found = v6 ? "::1" : "127.0.0.1";
  PDKV_LOG_INFO("tcp: listening on %s, advertising %s", listen.c_str(), found.c_str());
  return found;
}

Status TcpTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  if (opts_.conns_per_peer == 0 || opts_.conns_per_peer > 64)
    return InvalidArgument("tcp conns_per_peer must be 1..64, got " + std::to_string(opts_.conns_per_peer));
  if (opts_.progress_threads == 0 || opts_.progress_threads > 64)
    return InvalidArgument("tcp progress_threads must be 1..64, got " + std::to_string(opts_.progress_threads));
  if (opts_.batch_extents == 0 || opts_.batch_extents > kIovMax - 4)
    return InvalidArgument("tcp batch_extents must be 1.." + std::to_string(kIovMax - 4));
  if (opts_.batch_bytes == 0 || opts_.batch_bytes > kMaxPayloadPerFrame)
    return InvalidArgument("tcp batch_bytes must be 1.." + std::to_string(kMaxPayloadPerFrame));
  if (opts_.stage_chunk_bytes < 4096 || opts_.stage_chunk_bytes > kMaxPayloadPerFrame)
    return InvalidArgument("tcp stage_chunk_bytes must be 4096.." + std::to_string(kMaxPayloadPerFrame));
  if (!(opts_.frame_timeout_s > 0) || opts_.frame_timeout_s > 86400)
    return InvalidArgument("tcp frame_timeout_s must be in (0, 86400], got " + std::to_string(opts_.frame_timeout_s));
  if (opts_.stage_buffers < 2 || opts_.stage_buffers > 1024)
    return InvalidArgument("tcp stage_buffers must be 2..1024, got " + std::to_string(opts_.stage_buffers));
  util::HostPort hp{opts_.listen_host, opts_.listen_port};
  uint16_t port = 0;
  PDKV_ASSIGN_OR_RETURN(listen_fd_, util::listen_tcp(hp, &port));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(listen_fd_.get(), true));
  addr_ = util::HostPort{advertised_host(opts_.listen_host), port};
  for (uint32_t i = 0; i < opts_.progress_threads; ++i) {
    threads_.push_back(std::make_unique<ProgressThread>(this, i, opts_.spin_us));
    PDKV_RETURN_IF_ERROR(threads_.back()->start(i == 0 ? listen_fd_.get() : -1));
  }
  return Status::Ok();
}

void TcpTransport::shutdown() {
  if (shut_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lk(stage_mu_);
    stage_stop_ = true;
  }
  stage_cv_.notify_all();
  if (stage_th_.joinable()) stage_th_.join();  // queued tasks fail fast once shut_ is set
  for (auto& t : threads_) t->stop();
  std::lock_guard<std::mutex> lk(mu_);
  peers_.clear();
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  if (!peer->md.find_endpoint("tcp"))
    return NotSupported("peer '" + peer->md.name + "' publishes no tcp endpoint");
  auto p = std::make_shared<TcpPrepared>();
  p->peer = std::move(peer);
  p->op = op;
  uint64_t batch_bytes = opts_.batch_bytes;
  for (const auto& e : extents)
    if (e.local_kind == MemKind::kCuda) {
      p->staged = true;
      p->device = e.local_device;
      break;
    }
  if (p->staged) {
    // Batches are staged through pinned chunks: no batch may exceed one.
    PDKV_ASSIGN_OR_RETURN(auto st, stager());
    batch_bytes = std::min(batch_bytes, st->chunk());
  }
  size_t n = 0;
  for (const auto& e : extents) n += (e.len + batch_bytes - 1) / batch_bytes;
  p->descs.reserve(n);
  p->iov.reserve(n);
  TcpBatch cur;
  auto close_batch = [&] {
    if (cur.count) p->batches.push_back(cur);
    cur = TcpBatch{static_cast<uint32_t>(p->descs.size()), 0, 0};
  };
  for (const auto& e : extents) {
    uint64_t off = 0;
    while (off < e.len) {
      uint64_t room = batch_bytes - cur.bytes;
      if (room == 0 || cur.count == opts_.batch_extents) {
        close_batch();
        room = batch_bytes;
      }
      uint64_t len = std::min(e.len - off, room);
      p->descs.push_back(WireExtent{e.remote_region, e.remote_offset + off, len});
      p->iov.push_back({reinterpret_cast<void*>(e.local_addr + off), len});
      ++cur.count;
      cur.bytes += len;
      p->total += len;
      off += len;
    }
  }
  close_batch();
  if (p->descs.size() > 0xFFFFFFFFull) return InvalidArgument("transfer has too many extents");
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                         std::vector<ResolvedExtent> extents,
                                                                         std::shared_ptr<const GenClaim> claim) {
  PDKV_ASSIGN_OR_RETURN(auto ops, prepare(std::move(peer), op, std::move(extents)));
  auto p = std::const_pointer_cast<TcpPrepared>(std::static_pointer_cast<const TcpPrepared>(ops));
  p->claim_aux = encode_claim_aux(encode_claim(*claim));
  return ops;
}

Result<util::ScopedFd> TcpTransport::dial(const util::HostPort& hp, const std::string& target, uint64_t instance,
                                          std::string_view secret, double timeout_s, std::string* peer_name) {
  const auto deadline = util::deadline_after(timeout_s);
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, util::connect_tcp(hp, timeout_s));
  const std::string body =
      encode_hello(HelloBody{kWireVersion, 0, instance, hooks_->agent_name(), target, std::string(secret)});
  FrameHeader h = make_hdr(FrameType::kHello, 0, 0);
  h.aux_len = static_cast<uint32_t>(body.size());
  std::string frame(reinterpret_cast<const char*>(&h), kHdr);
  frame += body;
  const std::string where = target.empty() ? hp.str() : "'" + target + "' at " + hp.str();
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), frame.data(), frame.size(), deadline).with_context("hello to " + where));
  FrameHeader r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), &r, kHdr, deadline).with_context("waiting for " + where + " to answer the hello"));
  // The target may be anyone: its answer is checked like any frame before reading on.
  Status valid = check_header(r, ConnState{ConnRole::kOutbound, ConnPhase::kHandshake}, FrameLimits{});
  if (!valid.ok()) return ProtocolError(where + " answered the hello with a bad frame: " + valid.message());
  std::string aux(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), aux.data(), aux.size(), deadline).with_context("handshake with " + where));
  if (r.type == static_cast<uint16_t>(FrameType::kError))
    return Status(status_code_from_wire(r.status), where + " refused the connection: " + aux);
  auto ack = decode_hello_ack(aux);
  if (!ack.ok()) return ProtocolError(where + " sent a malformed hello-ack: " + ack.status().message());
  const std::string& name = ack->name;
  if (peer_name) *peer_name = name;
  return fd;
}

Result<std::shared_ptr<PeerConns>> TcpTransport::peer_conns(const std::shared_ptr<const Peer>& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(peer->md.name);
  if (it != peers_.end() && it->second->peer->md.instance_id == peer->md.instance_id) return it->second;
  const Endpoint* ep = peer->md.find_endpoint("tcp");
  if (!ep) return NotSupported("peer '" + peer->md.name + "' publishes no tcp endpoint");
  PDKV_ASSIGN_OR_RETURN(util::HostPort hp, util::parse_host_port(ep->address));
  auto pc = std::make_shared<PeerConns>();
  pc->peer = peer;
  pc->hp = hp;
  pc->conns.resize(opts_.conns_per_peer);
  if (it != peers_.end()) {
    // The peer restarted: connections to the old instance are useless.
    auto old = it->second;
    std::vector<std::shared_ptr<TcpConn>> cs;
    {
      std::lock_guard<std::mutex> lk2(old->mu);
      cs = old->conns;
    }
    for (auto& c : cs)
      if (c && c->owner) {
        {
          std::lock_guard<std::mutex> lk3(c->smu);
          c->kill_reason = StalePeer("peer '" + peer->md.name + "' was replaced by a new instance");
        }
        c->owner->request_kill(c);
      }
  }
  peers_[peer->md.name] = pc;
  return pc;
}

Result<std::shared_ptr<TcpConn>> TcpTransport::get_conn(PeerConns& pc, uint32_t slot, bool may_connect) {
  std::lock_guard<std::mutex> lk(pc.mu);
  auto& c = pc.conns[slot];
  if (c) {
    std::lock_guard<std::mutex> lk2(c->smu);
    if (!c->dead) return c;
  }
  if (!may_connect) return ConnectionError("no open connection to peer '" + pc.peer->md.name + "'");
  if (shut_) return ConnectionError("agent is shutting down");
  std::string name;
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, dial(pc.hp, pc.peer->md.name, pc.peer->md.instance_id, pc.peer->secret,
                                                opts_.connect_timeout_s, &name));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(fd.get(), true));
  auto conn = std::make_shared<TcpConn>(fd.release(), true, "peer '" + pc.peer->md.name + "' at " + pc.hp.str());
  conn->peer_name = name;
  conn->authed = true;
  conn->slot = slot;
  conn->pc = pc.weak_from_this();
  c = conn;
  pick_thread()->add(conn, false);
  return conn;
}

void TcpTransport::enqueue(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m) {
  std::lock_guard<std::mutex> lk(c->smu);
  if (c->dead) return;  // tracked parts are resolved by kill()
  if (c->sq.empty()) {
    int err = 0;
    int r = send_some(c->fd, *m, &err);
    if (r == 1) return;
    if (r < 0) {
      c->kill_reason = ConnectionError("sending to " + c->desc + " failed: " + errno_str(err));
      c->kill_requested = true;
      c->sq_cost += m->cost();
      c->sq.push_back(std::move(m));
      c->owner->request_kill(c);
      return;
    }
  }
  c->sq_cost += m->cost();
  c->sq.push_back(std::move(m));
  bool changed = false;
  if (!c->want_out) {
    c->want_out = true;
    c->tx_progress = Clock::now();
    c->owner->watch(c->tx_blocked, true);
    changed = true;
  }
  // Back-pressure: a peer that sends requests but does not read the answers stops
  // being read; its requests wait in its own socket buffers, not in our memory.
  if (!c->outbound && !c->rx_paused.load() && (c->sq_cost > kMaxQueuedCost || c->sq.size() > kMaxQueuedFrames)) {
    c->rx_paused = true;
    changed = true;
  }
  if (changed) c->owner->set_interest(*c);
}

bool TcpTransport::track(const std::shared_ptr<TcpConn>& c, PendingPart part, uint64_t xfer_id) {
  std::lock_guard<std::mutex> lk(c->pmu);
  if (c->dead) return false;
  const auto d = part.post->xfer->deadline();
  if (d < c->earliest_deadline) c->earliest_deadline = d;
  c->pending.emplace(pkey(xfer_id, part.batch), std::move(part));
  c->owner->npending.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

void TcpTransport::kill(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit) {
  std::lock_guard<std::recursive_mutex> rl(c->rx_mu);  // the receive state is reset below
  std::unordered_map<uint64_t, PendingPart> pend;
  std::deque<std::unique_ptr<OutMsg>> sq;
  {
    std::lock_guard<std::mutex> lk1(c->pmu);
    std::lock_guard<std::mutex> lk2(c->smu);
    if (c->dead) return;
    c->dead = true;
    pend.swap(c->pending);
    sq.swap(c->sq);
    c->sq_cost = 0;
  }
  ProgressThread* owner = c->owner;
  if (owner) {
    owner->watch(c->tx_blocked, false);
    owner->watch(c->rx_mid, false);
  }
  if (owner) owner->npending.fetch_sub(static_cast<int64_t>(pend.size()), std::memory_order_acq_rel);
  if (!c->authed && !c->outbound && owner) --owner->nslow_;
  if (c->rx_pipe) c->rx_pipe->abandon();  // no copy may land after this
  c->rx_staged = false;
  c->rx_pins.clear();
  c->rx_gens.reset();
  c->rx_reject = Status::Ok();
  c->rx_part = PendingPart{};
  if (auto pc = c->pc.lock()) {
    std::lock_guard<std::mutex> lk(pc->mu);
    if (c->slot < pc->conns.size() && pc->conns[c->slot] == c) pc->conns[c->slot].reset();
  }
  if (why.code() != StatusCode::kOk && !why.message().empty() && why.code() != StatusCode::kConnectionError)
    PDKV_LOG_DEBUG("connection to %s closed: %s", c->desc.c_str(), why.to_string().c_str());
  sq.clear();  // releases pins of unsent read responses
  for (auto& [k, part] : pend) {
    Status st = why;
    if (culprit && part.post->xfer->id() != culprit && why.code() == StatusCode::kTimeout)
      st = ConnectionError("connection to " + c->desc + " was closed because transfer " + std::to_string(culprit) +
                           " on it timed out");
    resolve(part, 0, st);
  }
  if (owner && c->fd >= 0) {
    // Stop reading and writing; linger briefly so an error frame we sent is read
    // before the peer sees a reset.
    ::shutdown(c->fd, SHUT_WR);
    c->draining = true;
    c->hs_deadline = util::deadline_after(0.5);
    ++owner->nslow_;
  }
}

void TcpTransport::resolve(const PendingPart& p, uint64_t bytes, const Status& st) {
  const auto& post = p.post;
  if (post->separate_notif && p.batch != kNotifyBatch) {
    if (!st.ok()) post->data_failed = true;
    const bool last_data = post->data_left.fetch_sub(1, std::memory_order_acq_rel) == 1;
    post->xfer->resolve_part(bytes, st);
    if (last_data) {
      if (post->data_failed || post->xfer->cancel_requested()) {
        post->xfer->resolve_part(0, Cancelled("notification not sent: the data did not all land"));
      } else {
        send_separate_notify(post);
      }
    }
    return;
  }
  post->xfer->resolve_part(bytes, st);
}

void TcpTransport::send_separate_notify(const std::shared_ptr<TcpPost>& p) {
  // Never connect from here (this may run on a progress thread).
  auto conn = get_conn(*p->pc, 0, false);
  if (!conn.ok()) {
    p->xfer->resolve_part(0, conn.status().with_context("sending the notification"));
    return;
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kNotify, p->xfer->id(), kNotifyBatch);
  m->aux = p->notif;
  m->finalize();
  if (!track(*conn, PendingPart{p, kNotifyBatch, 0}, p->xfer->id())) {
    p->xfer->resolve_part(0, ConnectionError("connection to peer '" + p->pc->peer->md.name + "' closed"));
    return;
  }
  enqueue(*conn, std::move(m));
  (*conn)->owner->wake_if_idle();
}

void TcpTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const TcpPrepared>(ops);
  auto pcr = peer_conns(prep->peer);
  if (!pcr.ok()) {
    xfer->fail_now(pcr.status());
    return;
  }
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->prep = prep;
  post->pc = *pcr;
  post->notif = std::move(notif);
  const uint32_t nconn = opts_.conns_per_peer;
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  const uint32_t base = post->pc->rr.fetch_add(1, std::memory_order_relaxed);
  const bool spread = nconn > 1 && nb > 1;
  post->separate_notif = !post->notif.empty() && (prep->op == OpKind::kRead || spread);
  post->data_left = nb;
  xfer->set_parts(nb + (post->separate_notif ? 1 : 0));
  std::weak_ptr<TcpPost> wp = post;
  xfer->set_cancel_hook([this, wp] {
    if (auto p = wp.lock()) cancel(p);
  });
  for (uint32_t i = 0; i < nb; ++i) {
    const uint32_t slot = (base + i) % nconn;
    if (prep->staged && prep->op == OpKind::kWrite) {
      run_staged([this, post, i, slot] { stage_and_send(post, i, slot); });
    } else {
      send_batch(post, i, slot, nullptr);
    }
  }
}

void TcpTransport::send_batch(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot,
                              std::shared_ptr<cuda::PinnedBuffer> staged) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  PendingPart part{post, i, b.bytes, prep->op == OpKind::kRead ? &prep->iov[b.first] : nullptr, b.count};
  Status connect_err;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    connect_err = post->connect_err;
  }
  if (!connect_err.ok() || xfer->cancel_requested()) {
    resolve(part, 0, connect_err.ok() ? Cancelled("cancelled") : connect_err);
    return;
  }
  auto cr = get_conn(*post->pc, slot, true);
  if (!cr.ok()) {
    {
      std::lock_guard<std::mutex> lk(post->mu);
      post->connect_err = cr.status();
    }
    resolve(part, 0, cr.status());
    return;
  }
  auto& conn = *cr;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    post->conns.push_back(conn);
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(prep->op == OpKind::kWrite ? FrameType::kWrite : FrameType::kReadReq, xfer->id(), i);
  m->hdr.count = b.count;
  m->descs = &prep->descs[b.first];
  m->desc_bytes = size_t(b.count) * sizeof(WireExtent);
  if (prep->op == OpKind::kWrite) {
    m->hdr.payload = b.bytes;
    if (staged) {
      m->own_iov.push_back({staged->data(), b.bytes});
      m->lease = std::move(staged);
    } else {
      m->data = &prep->iov[b.first];
      m->ndata = b.count;
    }
  }
  if (!prep->claim_aux.empty()) {
    m->hdr.flags |= kFlagGens;
    m->aux = prep->claim_aux;
  }
  if (prep->op == OpKind::kWrite && !post->separate_notif && !post->notif.empty() && i == nb - 1 &&
      !post->data_failed) {
    m->hdr.flags |= kFlagNotif;
    m->aux += post->notif;
  }
  m->keep = prep;
  m->finalize();
  if (!track(conn, std::move(part), xfer->id())) {
    resolve(PendingPart{post, i, b.bytes}, 0, ConnectionError("connection to " + conn->desc + " closed"));
    return;
  }
  if (nb == 1 && !prep->staged) {
    // Small transfers: the caller's wait() reads the ack itself (one thread hop
    // fewer, the latency of a plain socket round trip). Not for device memory: the
    // caller's thread would have to bind a CUDA context.
    std::weak_ptr<TcpConn> wc = conn;
    xfer->set_driver([this, wc](Transfer& x, Clock::time_point deadline, uint32_t spin_us) {
      if (auto c = wc.lock()) drive(c, x, deadline, spin_us);
    });
  }
  enqueue(conn, std::move(m));
  conn->owner->wake_if_idle();  // so it spins for the ack and enforces the deadline
}

void TcpTransport::stage_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  auto fail = [&](const Status& st) {
    post->data_failed = true;
    resolve(PendingPart{post, i, b.bytes}, 0, st);
  };
  if (shut_) return fail(ConnectionError("agent is shutting down"));
  if (xfer->cancel_requested()) return fail(Cancelled("cancelled"));
  if (post->data_failed) return fail(Cancelled("an earlier batch of this transfer failed"));
  auto st = stager();
  if (!st.ok()) return fail(st.status());
  auto buf = (*st)->acquire(prep->device, xfer->deadline(), [&] { return xfer->cancel_requested() || shut_.load(); });
  if (!buf.ok()) return fail(buf.status());
  Status g = (*st)->gather(prep->device, &prep->iov[b.first], b.count, (*buf)->data());
  if (!g.ok()) return fail(g.with_context("copying device memory into the staging buffer"));
  send_batch(post, i, slot, std::move(buf).value());
}

void TcpTransport::run_staged(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lk(stage_mu_);
    if (!stage_stop_) {
      if (!stage_th_.joinable()) stage_th_ = std::thread([this] { stage_loop(); });
      stage_q_.push_back(std::move(f));
      stage_cv_.notify_one();
      return;
    }
  }
  f();  // shutting down: the task fails at once on this thread
}

void TcpTransport::stage_loop() {
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock<std::mutex> lk(stage_mu_);
      stage_cv_.wait(lk, [&] { return stage_stop_ || !stage_q_.empty(); });
      if (stage_q_.empty()) return;
      f = std::move(stage_q_.front());
      stage_q_.pop_front();
    }
    f();
  }
}

Result<std::shared_ptr<cuda::Stager>> TcpTransport::stager() {
  std::lock_guard<std::mutex> lk(stage_mu_);
  if (!stager_) {
    auto st = cuda::Stager::create(opts_.stage_chunk_bytes, opts_.stage_buffers);
    if (!st.ok())
      return Status(st.status().code(), "tcp cannot stage device memory: " + st.status().message());
    stager_ = std::move(st).value();
  }
  return stager_;
}

void TcpTransport::respond_staged(const std::shared_ptr<TcpConn>& c, const FrameHeader& h, std::vector<iovec> src,
                                  std::vector<RegionPin> pins, GenPin gens, uint64_t bytes, int device) {
  struct Job {
    std::vector<iovec> src;
    std::vector<RegionPin> pins;
    GenPin gens;  // held until the bytes are gathered (the job ends)
  };
  auto job = std::make_shared<Job>(Job{std::move(src), std::move(pins), std::move(gens)});
  run_staged([this, c, h, job, bytes, device] {
    auto fail = [&](const Status& st) {
      if (!c->owner) return;
      std::lock_guard<std::recursive_mutex> rl(c->rx_mu);
      if (c->fd >= 0 && !c->draining)
        c->owner->fail_conn(c, Status(st.code(), "read request from " + c->desc + " failed: " + st.message()),
                            h.xfer_id, h.batch);
    };
    auto dead = [&] {
      std::lock_guard<std::mutex> lk(c->smu);
      return c->dead || shut_.load();
    };
    if (dead()) return;
    auto st = stager();
    if (!st.ok()) return fail(st.status());
    auto buf = bytes <= (*st)->chunk()
                   ? (*st)->acquire(device, util::deadline_after(kStageWaitS), dead)
                   : (*st)->allocate(device, bytes);
    if (!buf.ok()) return fail(buf.status());
    Status g = (*st)->gather(device, job->src.data(), job->src.size(), (*buf)->data());
    if (!g.ok()) return fail(g.with_context("copying device memory into the staging buffer"));
    auto m = std::make_unique<OutMsg>();
    m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
    m->hdr.payload = bytes;
    m->own_iov.push_back({(*buf)->data(), bytes});
    m->lease = std::move(buf).value();
    m->pins = std::move(job->pins);
    m->finalize();
    enqueue(c, std::move(m));
  });
}

void TcpTransport::drive(const std::shared_ptr<TcpConn>& c, Transfer& x, Clock::time_point deadline,
                         uint32_t spin_us) {
  std::unique_lock<std::recursive_mutex> rl(c->rx_mu, std::try_to_lock);
  if (!rl || c->fd < 0 || c->draining) return;
  {
    std::lock_guard<std::mutex> lk(c->smu);
    if (c->dead) return;
    c->driven = true;  // the owner thread stops watching EPOLLIN while we read
    c->owner->set_interest(*c);
  }
  deadline = std::min(deadline, x.deadline());
  const auto spin_end = Clock::now() + std::chrono::microseconds(spin_us);
  while (!x.terminal() && c->fd >= 0 && !c->draining) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    Status stalled = c->owner->frame_stalled(*c, now);
    if (!stalled.ok()) {
      kill(c, stalled);
      break;
    }
    // Spin briefly (the ack of a small write is usually microseconds away), then
    // block in short slices so deadlines and shutdown are noticed.
    int timeout = 0;
    if (now >= spin_end) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
      timeout = static_cast<int>(std::min<int64_t>(left, 10));
    }
    pollfd pf{c->fd, POLLIN | POLLRDHUP, 0};
    const int r = ::poll(&pf, 1, timeout);
    if (r > 0) c->owner->on_readable(c);
  }
  std::lock_guard<std::mutex> lk(c->smu);
  c->driven = false;
  if (!c->dead && c->fd >= 0) c->owner->set_interest(*c);
}

void TcpTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto pcr = peer_conns(peer);
  if (!pcr.ok()) {
    xfer->fail_now(pcr.status());
    return;
  }
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->pc = *pcr;
  post->notif = std::move(notif);
  post->separate_notif = true;
  auto cr = get_conn(*post->pc, 0, true);
  if (!cr.ok()) {
    xfer->resolve_part(0, cr.status());
    return;
  }
  send_separate_notify(post);
}

void TcpTransport::cancel(const std::shared_ptr<TcpPost>& p) {
  std::vector<std::shared_ptr<TcpConn>> conns;
  {
    std::lock_guard<std::mutex> lk(p->mu);
    for (auto& w : p->conns)
      if (auto c = w.lock()) conns.push_back(c);
  }
  const uint64_t id = p->xfer->id();
  for (auto& c : conns) {
    std::vector<PendingPart> dropped;
    {
      std::lock_guard<std::mutex> lk1(c->pmu);
      std::lock_guard<std::mutex> lk2(c->smu);
      if (c->dead) continue;
      for (auto it = c->sq.begin(); it != c->sq.end();) {
        OutMsg& m = **it;
        if (m.hdr.xfer_id == id && m.sent == 0 &&
            (m.hdr.type == static_cast<uint16_t>(FrameType::kWrite) ||
             m.hdr.type == static_cast<uint16_t>(FrameType::kReadReq))) {
          auto pit = c->pending.find(pkey(id, m.hdr.batch));
          if (pit != c->pending.end()) {
            dropped.push_back(std::move(pit->second));
            c->pending.erase(pit);
          }
          c->sq_cost -= m.cost();
          it = c->sq.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (c->owner) c->owner->npending.fetch_sub(static_cast<int64_t>(dropped.size()), std::memory_order_acq_rel);
    for (auto& part : dropped) resolve(part, 0, Cancelled("cancelled before it was sent"));
  }
}

Status TcpTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  (void)timeout_s;
  PDKV_ASSIGN_OR_RETURN(auto pc, peer_conns(peer));
  for (uint32_t i = 0; i < opts_.conns_per_peer; ++i) {
    auto c = get_conn(*pc, i, true);
    if (!c.ok()) return c.status();
  }
  return Status::Ok();
}

void TcpTransport::drop_peer(const std::string& name) {
  std::shared_ptr<PeerConns> pc;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    pc = it->second;
    peers_.erase(it);
  }
  std::vector<std::shared_ptr<TcpConn>> cs;
  {
    std::lock_guard<std::mutex> lk(pc->mu);
    cs = pc->conns;
  }
  for (auto& c : cs)
    if (c && c->owner) {
      {
        std::lock_guard<std::mutex> lk(c->smu);
        c->kill_reason = ConnectionError("peer '" + name + "' was removed");
      }
      c->owner->request_kill(c);
    }
}

Result<std::string> TcpTransport::fetch_metadata(const std::string& address, std::string_view secret,
                                                 double timeout_s) {
  PDKV_ASSIGN_OR_RETURN(util::HostPort hp, util::parse_host_port(address));
  const auto deadline = util::deadline_after(timeout_s);
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, dial(hp, "", 0, secret, timeout_s, nullptr));
  FrameHeader h = make_hdr(FrameType::kMetaReq, 0, 0);
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), &h, kHdr, deadline));
  FrameHeader r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), &r, kHdr, deadline).with_context("fetching metadata from " + address));
  Status valid = check_header(r, ConnState{ConnRole::kOutbound, ConnPhase::kMetaWait}, FrameLimits{});
  if (!valid.ok()) return ProtocolError(address + " answered the metadata request with a bad frame: " + valid.message());
  std::string blob(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), blob.data(), blob.size(), deadline).with_context("fetching metadata from " + address));
  if (r.type == static_cast<uint16_t>(FrameType::kError))
    return Status(status_code_from_wire(r.status), address + " refused the metadata request: " + blob);
  return blob;
}

bool registered = register_transport(TransportFactory{
    "tcp", "TCP sockets: any host to any host (host memory)", [] { return Status::Ok(); },
    [](const AgentConfig& cfg) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(cfg));
    },
    /*priority=*/100});

}  // namespace

Result<std::unique_ptr<Transport>> create_tcp_transport(const AgentConfig& cfg) {
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(cfg));
}

}  // namespace pdkv::tcp
