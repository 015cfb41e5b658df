// The shm transport: same host, one copy, done by the initiator.
//
// Regions an agent allocates as memfd-backed shared memory (Agent.alloc in Python)
// are mapped once by a same-host peer (the fd travels over a Unix socket after the
// peer authenticated with the secret); a transfer is then one memcpy per extent,
// straight between the two processes' KV pools. Host memory pdkv did not allocate
// is reached with cross-memory attach (process_vm_writev/readv), where the kernel
// permits it. Small transfers copy inline in the posting thread (lowest latency);
// larger ones on pdkv's copy thread. Notifications go over the Unix socket after
// every byte was copied and complete the transfer when the peer acknowledges them.
//
// Direct access means the target cannot check each write: the initiator's pdkv
// enforces the bounds of the regions the target exported, and only authenticated
// peers get the fds. When the target deregisters an exported region it tells
// every connected peer to stop (kRevoke) and waits for their acknowledgements.
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pdkv/registry.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"

namespace pdkv::shm {
namespace {

using util::errno_str;

constexpr uint32_t kCtlMagic = 0x534b4450;  // "PDKS"
constexpr uint16_t kShmVersion = 1;
constexpr uint32_t kMaxAux = 2u << 20;

enum class Ctl : uint16_t {
  kHello = 1,      // aux: u16 version, u64 expected instance, str from, str to, str secret
  kHelloAck = 2,   // aux: u64 instance, u32 pid, str name
  kMapReq = 3,     // id: region
  kMapResp = 4,    // id: region, status; aux: u64 len (OK, fd attached) or message
  kNotify = 5,     // id: sequence, aux: notification
  kNotifyAck = 6,  // id: sequence
  kRevoke = 7,     // target -> initiator: stop using region id
  kRevokeAck = 8,  // initiator -> target: region id no longer used
  kError = 9,      // status + message; the sender closes
};

struct CtlHdr {
  uint32_t magic;
  uint16_t type;
  uint16_t flags;
  uint64_t id;
  uint32_t aux_len;
  uint32_t status;
};
static_assert(sizeof(CtlHdr) == 24);

class ShmTransport;

// A peer's region this process accesses directly.
struct RemoteRegion {
  uint64_t id = 0;
  uint64_t len = 0;
  char* base = nullptr;      // mapped (shareable) or nullptr (cross-memory attach)
  uint64_t remote_addr = 0;  // the peer's address, for cross-memory attach
  std::atomic<int64_t> inflight{0};
  std::atomic<bool> revoked{false};
  std::atomic<bool> ack_sent{false};
  std::weak_ptr<struct ShmConn> conn;
  ~RemoteRegion() {
    if (base) ::munmap(base, len);
  }
};

struct PendingNotify {
  std::shared_ptr<Transfer> xfer;
  Clock::time_point deadline;
};

struct ShmConn {
  ShmConn(int fd, bool outbound, std::string desc) : fd(fd), outbound(outbound), desc(std::move(desc)) {}
  ~ShmConn() {
    if (fd >= 0) ::close(fd);
    for (int f : fds) ::close(f);
  }
  int fd;
  const bool outbound;
  std::string desc;
  std::string peer_name;
  pid_t peer_pid = 0;
  Clock::time_point hs_deadline = Clock::time_point::max();
  bool authed = false;
  std::atomic<bool> gone{false};  // set with `dead`, readable without the lock
  std::mutex send_mu;
  std::mutex map_mu;  // one map request in flight per connection
  // Receive state (progress thread).
  CtlHdr hdr{};
  size_t hdr_got = 0;
  std::string aux;
  size_t aux_got = 0;
  bool in_aux = false;
  std::deque<int> fds;  // fds received with SCM_RIGHTS, in order
  // Shared state.
  std::mutex mu;
  std::condition_variable cv;
  bool dead = false;
  Status dead_reason;
  std::map<uint64_t, std::pair<Status, std::pair<int, uint64_t>>> map_results;  // region -> (status, (fd, len))
  std::map<uint64_t, PendingNotify> notifies;
  std::set<uint64_t> revoke_acks;  // inbound: regions the peer acknowledged
  std::unordered_map<uint64_t, std::shared_ptr<RemoteRegion>> regions;  // outbound: by region id
  uint64_t next_seq = 1;
};

struct ShmPeerState {
  std::shared_ptr<const Peer> peer;
  std::mutex mu;
  std::shared_ptr<ShmConn> conn;
};

struct CopyOp {
  char* local;
  uint64_t remote;  // mapped pointer or the peer's address
  uint64_t len;
  uint32_t region;  // index into ShmPrepared::regions
};

struct ShmPrepared final : PreparedOps {
  std::shared_ptr<ShmPeerState> ps;
  std::shared_ptr<ShmConn> conn;  // connection the mappings came from
  OpKind op = OpKind::kWrite;
  std::vector<CopyOp> ops;
  std::vector<std::shared_ptr<RemoteRegion>> regions;
  bool cma = false;
  pid_t pid = 0;
  uint64_t total = 0;
};

struct Job {
  std::shared_ptr<const ShmPrepared> prep;
  std::shared_ptr<Transfer> xfer;
  std::string notif;
};

Status send_frame(ShmConn& c, Ctl type, uint64_t id, std::string_view aux, uint32_t status = 0, int pass_fd = -1) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, id, static_cast<uint32_t>(aux.size()), status};
  std::lock_guard<std::mutex> lk(c.send_mu);
  iovec iov[2] = {{&h, sizeof h}, {const_cast<char*>(aux.data()), aux.size()}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = aux.empty() ? 1 : 2;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
  if (pass_fd >= 0) {
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
  }
  size_t want = sizeof h + aux.size(), done = 0;
  const auto deadline = util::deadline_after(5.0);
  while (done < want) {
    ssize_t w = ::sendmsg(c.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (Clock::now() > deadline) return TimeoutError("sending to " + c.desc + " timed out");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      return ConnectionError("sending to " + c.desc + " failed: " + errno_str(errno));
    }
    done += static_cast<size_t>(w);
    mh.msg_control = nullptr;  // the fd went with the first byte
    mh.msg_controllen = 0;
    util::advance_iov(mh, static_cast<size_t>(w));
  }
  return Status::Ok();
}

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const AgentConfig& cfg) : opts_(cfg.shm), connect_timeout_(cfg.tcp.connect_timeout_s) {}
  ~ShmTransport() override { shutdown(); }

  std::string_view name() const override { return "shm"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.cross_host = false;
    c.local_mem_kinds = mem_kind_bit(MemKind::kHost);
    c.remote_mem_kinds = mem_kind_bit(MemKind::kHost);
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
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override;
  Status connect(std::shared_ptr<const Peer> peer, double timeout_s) override;
  void drop_peer(const std::string& name) override;
  void region_removed(const RegionDesc& region) override;

 private:
  void run();
  void copy_loop();
  void accept_all();
  void on_readable(const std::shared_ptr<ShmConn>& c);
  void handle_frame(const std::shared_ptr<ShmConn>& c);
  void kill(const std::shared_ptr<ShmConn>& c, const Status& why);
  void add_conn(const std::shared_ptr<ShmConn>& c);
  Result<std::shared_ptr<ShmPeerState>> peer_state(const std::shared_ptr<const Peer>& peer);
  Result<std::shared_ptr<ShmConn>> get_conn(ShmPeerState& ps);
  Result<std::shared_ptr<ShmConn>> dial(const Peer& peer);
  Result<std::shared_ptr<RemoteRegion>> remote_region(const std::shared_ptr<ShmConn>& c, const Peer& peer,
                                                      uint64_t id);
  Status run_copies(const ShmPrepared& p);
  void finish_job(Job& job, Status st);
  void send_notify(const std::shared_ptr<ShmConn>& c, const std::shared_ptr<Transfer>& xfer,
                   const std::string& notif);
  static void unpin(const ShmPrepared& p);
  void maybe_ack_revoke(const std::shared_ptr<RemoteRegion>& r);

  ShmOptions opts_;
  double connect_timeout_;
  AgentHooks* hooks_ = nullptr;
  std::string path_;
  util::ScopedFd listen_fd_;
  int epfd_ = -1;
  int evfd_ = -1;
  std::thread th_;
  std::vector<std::thread> copiers_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> shut_{false};
  std::mutex mu_;  // conns_, peers_
  std::unordered_map<ShmConn*, std::shared_ptr<ShmConn>> conns_;
  std::map<std::string, std::shared_ptr<ShmPeerState>> peers_;
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<Job> queue_;
};

Status ShmTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  if (opts_.copy_threads == 0 || opts_.copy_threads > 64) return InvalidArgument("shm copy_threads must be 1..64");
  PDKV_ASSIGN_OR_RETURN(listen_fd_, util::listen_unix(hooks->agent_name(), hooks->instance_id(), ".sock", &path_));
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  ev.data.ptr = this;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_.get(), &ev);
  th_ = std::thread([this] { run(); });
  for (uint32_t i = 0; i < opts_.copy_threads; ++i) copiers_.emplace_back([this] { copy_loop(); });
  return Status::Ok();
}

void ShmTransport::shutdown() {
  if (shut_.exchange(true)) return;
  stop_ = true;
  uint64_t one = 1;
  if (evfd_ >= 0 && ::write(evfd_, &one, sizeof one) < 0) {
  }
  {
    std::lock_guard<std::mutex> lk(qmu_);
    qcv_.notify_all();
  }
  if (th_.joinable()) th_.join();
  for (auto& t : copiers_) t.join();
  std::deque<Job> left;
  {
    std::lock_guard<std::mutex> lk(qmu_);
    left.swap(queue_);
  }
  for (auto& j : left) {
    unpin(*j.prep);
    j.xfer->resolve_part(0, ConnectionError("agent is shutting down"));
  }
  std::vector<std::shared_ptr<ShmConn>> cs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) cs.push_back(c);
  }
  for (auto& c : cs) kill(c, ConnectionError("agent is shutting down"));
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_.clear();
    peers_.clear();
  }
  if (!path_.empty()) ::unlink(path_.c_str());
  if (epfd_ >= 0) ::close(epfd_);
  if (evfd_ >= 0) ::close(evfd_);
  epfd_ = evfd_ = -1;
}

void ShmTransport::add_conn(const std::shared_ptr<ShmConn>& c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = c.get();
  epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd, &ev);
  uint64_t one = 1;
  if (::write(evfd_, &one, sizeof one) < 0) {
  }
}

void ShmTransport::run() {
  epoll_event evs[32];
  while (!stop_) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [p, c] : conns_) {
        std::lock_guard<std::mutex> lk2(c->mu);
        if (!c->authed || !c->notifies.empty()) busy = true;
      }
    }
    int n = ::epoll_wait(epfd_, evs, 32, busy ? 20 : -1);
    for (int i = 0; i < n; ++i) {
      void* p = evs[i].data.ptr;
      if (p == nullptr) {
        uint64_t v;
        if (::read(evfd_, &v, sizeof v) < 0) {
        }
        continue;
      }
      if (p == this) {
        accept_all();
        continue;
      }
      std::shared_ptr<ShmConn> c;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = conns_.find(static_cast<ShmConn*>(p));
        if (it != conns_.end()) c = it->second;
      }
      if (c) on_readable(c);
    }
    // Deadlines: handshakes and notification acknowledgements.
    const auto now = Clock::now();
    std::vector<std::pair<std::shared_ptr<ShmConn>, Status>> doomed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [p, c] : conns_) {
        std::lock_guard<std::mutex> lk2(c->mu);
        if (!c->authed && now > c->hs_deadline) {
          doomed.emplace_back(c, TimeoutError(c->desc + " did not complete the handshake in time"));
          continue;
        }
        for (auto& [seq, pn] : c->notifies)
          if (pn.deadline <= now) {
            doomed.emplace_back(c, TimeoutError("transfer " + std::to_string(pn.xfer->id()) + " to " + c->desc +
                                                " timed out waiting for the peer to take its notification"));
            break;
          }
      }
    }
    for (auto& [c, st] : doomed) kill(c, st);
  }
}

void ShmTransport::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    ucred cr{};
    socklen_t len = sizeof cr;
    ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len);
    auto c = std::make_shared<ShmConn>(fd, false, "local process " + std::to_string(cr.pid));
    c->peer_pid = cr.pid;
    c->hs_deadline = util::deadline_after(5.0);
    add_conn(c);
  }
}

void ShmTransport::on_readable(const std::shared_ptr<ShmConn>& c) {
  for (;;) {
    char* dst;
    size_t want;
    if (!c->in_aux) {
      dst = reinterpret_cast<char*>(&c->hdr) + c->hdr_got;
      want = sizeof(CtlHdr) - c->hdr_got;
    } else {
      dst = c->aux.data() + c->aux_got;
      want = c->aux.size() - c->aux_got;
    }
    iovec iov{dst, want};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (c->outbound) {
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
    }
    ssize_t r = ::recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;
      kill(c, ConnectionError("receiving from " + c->desc + " failed: " + errno_str(errno)));
      return;
    }
    if (r == 0) {
      kill(c, ConnectionError(c->desc + " closed the connection"));
      return;
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); c->outbound && cm; cm = CMSG_NXTHDR(&mh, cm)) {
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof f);
          c->fds.push_back(f);
        }
      }
    }
    if (!c->in_aux) {
      c->hdr_got += static_cast<size_t>(r);
      if (c->hdr_got < sizeof(CtlHdr)) continue;
      if (c->hdr.magic != kCtlMagic || c->hdr.aux_len > kMaxAux) {
        kill(c, ProtocolError("malformed frame from " + c->desc));
        return;
      }
      c->aux.assign(c->hdr.aux_len, '\0');
      c->aux_got = 0;
      c->in_aux = c->hdr.aux_len > 0;
      if (c->in_aux) continue;
    } else {
      c->aux_got += static_cast<size_t>(r);
      if (c->aux_got < c->aux.size()) continue;
    }
    c->in_aux = false;
    c->hdr_got = 0;
    handle_frame(c);
    {
      std::lock_guard<std::mutex> lk(c->mu);
      if (c->dead) return;
    }
  }
}

void ShmTransport::handle_frame(const std::shared_ptr<ShmConn>& c) {
  const CtlHdr h = c->hdr;
  const auto type = static_cast<Ctl>(h.type);
  auto fail = [&](Status st) {
    send_frame(*c, Ctl::kError, h.id, st.message().substr(0, 4096), static_cast<uint32_t>(st.code()));
    kill(c, st);
  };
  if (!c->outbound) {
    if (!c->authed && type != Ctl::kHello) return fail(ProtocolError("the first frame must be a hello"));
    switch (type) {
      case Ctl::kHello: {
        util::ByteReader r(c->aux);
        uint16_t ver = 0;
        uint64_t expect = 0;
        std::string from, to, secret;
        Status st = r.get(&ver, "version");
        if (st.ok() && ver != kShmVersion)
          return fail(VersionMismatch("shm protocol version " + std::to_string(ver) + " is not supported"));
        if (st.ok()) st = r.get(&expect, "instance");
        if (st.ok()) st = r.get_str(&from, "initiator", 128);
        if (st.ok()) st = r.get_str(&to, "target", 128);
        if (st.ok()) st = r.get_str(&secret, "secret", 1024);
        if (st.ok()) st = validate_name("initiator name", from);
        if (!st.ok()) return fail(ProtocolError("malformed hello: " + st.message()));
        if (!hooks_->secret_matches(secret))
          return fail(AuthFailed("agent '" + from + "' presented the wrong secret to agent '" + hooks_->agent_name() + "'"));
        if (!to.empty() && to != hooks_->agent_name())
          return fail(AuthFailed("this is agent '" + hooks_->agent_name() + "', not '" + to + "'"));
        if (expect != 0 && expect != hooks_->instance_id())
          return fail(StalePeer("agent '" + hooks_->agent_name() + "' restarted since its metadata was fetched"));
        {
          std::lock_guard<std::mutex> lk(c->mu);
          c->authed = true;
          c->peer_name = from;
          c->desc = "peer '" + from + "' (" + c->desc + ")";
        }
        util::ByteWriter w;
        w.put<uint64_t>(hooks_->instance_id());
        w.put<uint32_t>(static_cast<uint32_t>(::getpid()));
        w.put_str(hooks_->agent_name());
        send_frame(*c, Ctl::kHelloAck, 0, w.str());
        return;
      }
      case Ctl::kMapReq: {
        auto fd = hooks_->region_table().dup_shm_fd(h.id);
        if (!fd.ok()) {
          send_frame(*c, Ctl::kMapResp, h.id, fd.status().message(), static_cast<uint32_t>(fd.status().code()));
          return;
        }
        auto d = hooks_->region_table().get(h.id);
        util::ByteWriter w;
        w.put<uint64_t>(d.ok() ? d->len : 0);
        send_frame(*c, Ctl::kMapResp, h.id, w.str(), 0, *fd);
        ::close(*fd);
        return;
      }
      case Ctl::kNotify:
        hooks_->deliver_notification(Notification{c->peer_name, c->aux});
        send_frame(*c, Ctl::kNotifyAck, h.id, {});
        return;
      case Ctl::kRevokeAck: {
        std::lock_guard<std::mutex> lk(c->mu);
        c->revoke_acks.insert(h.id);
        c->cv.notify_all();
        return;
      }
      default:
        return fail(ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc));
    }
  }
  // Outbound (we are the initiator).
  switch (type) {
    case Ctl::kMapResp: {
      std::lock_guard<std::mutex> lk(c->mu);
      if (h.status == 0) {
        uint64_t len = 0;
        util::ByteReader r(c->aux);
        if (!r.get(&len, "len").ok() || c->fds.empty()) {
          c->map_results[h.id] = {ProtocolError("malformed map response"), {-1, 0}};
        } else {
          int fd = c->fds.front();
          c->fds.pop_front();
          c->map_results[h.id] = {Status::Ok(), {fd, len}};
        }
      } else {
        const StatusCode code = status_code_from_wire(h.status);
        c->map_results[h.id] = {Status(code, c->aux), {-1, 0}};
      }
      c->cv.notify_all();
      return;
    }
    case Ctl::kNotifyAck: {
      std::shared_ptr<Transfer> x;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        auto it = c->notifies.find(h.id);
        if (it != c->notifies.end()) {
          x = it->second.xfer;
          c->notifies.erase(it);
        }
      }
      if (x) x->resolve_part(0, Status::Ok());
      return;
    }
    case Ctl::kRevoke: {
      std::shared_ptr<RemoteRegion> r;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        auto it = c->regions.find(h.id);
        if (it != c->regions.end()) {
          r = it->second;
          c->regions.erase(it);
        }
      }
      if (!r) {
        send_frame(*c, Ctl::kRevokeAck, h.id, {});
        return;
      }
      r->revoked = true;
      maybe_ack_revoke(r);
      return;
    }
    case Ctl::kError: {
      const StatusCode code = status_code_from_wire(h.status);
      kill(c, Status(code, c->desc + " refused: " + c->aux));
      return;
    }
    default:
      kill(c, ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc));
  }
}

void ShmTransport::maybe_ack_revoke(const std::shared_ptr<RemoteRegion>& r) {
  if (r->revoked && r->inflight.load() == 0 && !r->ack_sent.exchange(true)) {
    if (auto c = r->conn.lock()) send_frame(*c, Ctl::kRevokeAck, r->id, {});
  }
}

void ShmTransport::kill(const std::shared_ptr<ShmConn>& c, const Status& why) {
  std::map<uint64_t, PendingNotify> pend;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->dead) return;
    c->dead = true;
    c->gone = true;
    c->dead_reason = why;
    pend.swap(c->notifies);
    c->cv.notify_all();
  }
  if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
  ::shutdown(c->fd, SHUT_RDWR);
  for (auto& [seq, pn] : pend) pn.xfer->resolve_part(0, why);
  std::lock_guard<std::mutex> lk(mu_);
  conns_.erase(c.get());
}

Result<std::shared_ptr<ShmConn>> ShmTransport::dial(const Peer& peer) {
  const Endpoint* e = peer.md.find_endpoint("shm");
  if (!e) return NotSupported("peer '" + peer.md.name + "' publishes no shm endpoint");
  auto fdr = util::connect_unix(e->address);
  if (!fdr.ok()) return Status(fdr.status().code(), "peer '" + peer.md.name + "': " + fdr.status().message());
  util::ScopedFd fd = std::move(fdr).value();
  util::ByteWriter body;
  body.put<uint16_t>(kShmVersion);
  body.put<uint64_t>(peer.md.instance_id);
  body.put_str(hooks_->agent_name());
  body.put_str(peer.md.name);
  body.put_str(peer.secret);
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(Ctl::kHello), 0, 0, static_cast<uint32_t>(body.str().size()), 0};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame += body.str();
  const auto deadline = util::deadline_after(connect_timeout_);
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), frame.data(), frame.size(), deadline));
  CtlHdr r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), &r, sizeof r, deadline).with_context("handshake with '" + peer.md.name + "'"));
  if (r.magic != kCtlMagic || r.aux_len > 4096) return ProtocolError("peer '" + peer.md.name + "' sent a malformed reply");
  std::string aux(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), aux.data(), aux.size(), deadline));
  if (r.type == static_cast<uint16_t>(Ctl::kError)) {
    const StatusCode code = status_code_from_wire(r.status);
    return Status(code, "peer '" + peer.md.name + "' refused the connection: " + aux);
  }
  if (r.type != static_cast<uint16_t>(Ctl::kHelloAck)) return ProtocolError("unexpected handshake reply");
  util::ByteReader rd(aux);
  uint64_t inst = 0;
  uint32_t pid = 0;
  PDKV_RETURN_IF_ERROR(rd.get(&inst, "instance"));
  PDKV_RETURN_IF_ERROR(rd.get(&pid, "pid"));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(fd.get(), true));
  auto c = std::make_shared<ShmConn>(fd.release(), true, "peer '" + peer.md.name + "' (shm " + e->address + ")");
  c->authed = true;
  c->peer_name = peer.md.name;
  c->peer_pid = static_cast<pid_t>(pid);
  add_conn(c);
  return c;
}

Result<std::shared_ptr<ShmPeerState>> ShmTransport::peer_state(const std::shared_ptr<const Peer>& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& ps = peers_[peer->md.name];
  if (!ps || ps->peer->md.instance_id != peer->md.instance_id) {
    ps = std::make_shared<ShmPeerState>();
    ps->peer = peer;
  }
  return ps;
}

Result<std::shared_ptr<ShmConn>> ShmTransport::get_conn(ShmPeerState& ps) {
  std::lock_guard<std::mutex> lk(ps.mu);
  if (ps.conn) {
    std::lock_guard<std::mutex> lk2(ps.conn->mu);
    if (!ps.conn->dead) return ps.conn;
  }
  if (shut_) return ConnectionError("agent is shutting down");
  PDKV_ASSIGN_OR_RETURN(ps.conn, dial(*ps.peer));
  return ps.conn;
}

Result<std::shared_ptr<RemoteRegion>> ShmTransport::remote_region(const std::shared_ptr<ShmConn>& c, const Peer& peer,
                                                                  uint64_t id) {
  std::lock_guard<std::mutex> map_lk(c->map_mu);
  {
    std::lock_guard<std::mutex> lk(c->mu);
    auto it = c->regions.find(id);
    if (it != c->regions.end()) return it->second;
  }
  const RegionDesc* d = peer.md.find_region(id);
  if (!d) return NotFound("peer '" + peer.md.name + "' exports no region " + std::to_string(id));
  auto r = std::make_shared<RemoteRegion>();
  r->id = id;
  r->len = d->len;
  r->remote_addr = d->addr;
  r->conn = c;
  if (d->shareable) {
    PDKV_RETURN_IF_ERROR(send_frame(*c, Ctl::kMapReq, id, {}));
    std::unique_lock<std::mutex> lk(c->mu);
    const bool got = c->cv.wait_for(lk, std::chrono::duration<double>(connect_timeout_),
                                    [&] { return c->dead || c->map_results.count(id); });
    if (c->dead) return c->dead_reason;
    if (!got) return TimeoutError("peer '" + peer.md.name + "' did not answer the map request");
    auto res = c->map_results[id];
    c->map_results.erase(id);
    lk.unlock();
    if (!res.first.ok()) return res.first.with_context("mapping region " + std::to_string(id) + " of '" + peer.md.name + "'");
    const int fd = res.second.first;
    if (res.second.second < d->len) {
      ::close(fd);
      return ProtocolError("peer's region " + std::to_string(id) + " is smaller than its metadata says");
    }
    void* p = ::mmap(nullptr, d->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return Internal("mmap of the peer's region failed: " + errno_str(errno));
    r->base = static_cast<char*>(p);
  } else {
    // Cross-memory attach: check once that the kernel lets us reach the peer.
    char probe;
    iovec l{&probe, 1}, rm{reinterpret_cast<void*>(d->addr), 1};
    if (::process_vm_readv(c->peer_pid, &l, 1, &rm, 1, 0) != 1) {
      const int err = errno;
      return NotSupported("region " + std::to_string(id) + " of peer '" + peer.md.name +
                          "' is not shared memory and cross-memory attach to pid " + std::to_string(c->peer_pid) +
                          " is not permitted (" + errno_str(err) +
                          "); let pdkv allocate the pool (Agent.alloc), allow ptrace (kernel.yama.ptrace_scope=0 or "
                          "CAP_SYS_PTRACE), or use the tcp transport");
    }
  }
  std::lock_guard<std::mutex> lk(c->mu);
  auto [it, inserted] = c->regions.emplace(id, r);
  return it->second;
}

Result<std::shared_ptr<const PreparedOps>> ShmTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  PDKV_ASSIGN_OR_RETURN(auto ps, peer_state(peer));
  PDKV_ASSIGN_OR_RETURN(auto conn, get_conn(*ps));
  auto p = std::make_shared<ShmPrepared>();
  p->ps = ps;
  p->conn = conn;
  p->op = op;
  p->pid = conn->peer_pid;
  p->ops.reserve(extents.size());
  std::unordered_map<uint64_t, uint32_t> index;
  uint64_t last_id = ~0ull;
  uint32_t last_idx = 0;
  for (const auto& e : extents) {
    if (e.remote_region != last_id) {
      auto it = index.find(e.remote_region);
      if (it == index.end()) {
        PDKV_ASSIGN_OR_RETURN(auto r, remote_region(conn, *peer, e.remote_region));
        if (!r->base) p->cma = true;
        it = index.emplace(e.remote_region, static_cast<uint32_t>(p->regions.size())).first;
        p->regions.push_back(std::move(r));
      }
      last_id = e.remote_region;
      last_idx = it->second;
    }
    const RemoteRegion& r = *p->regions[last_idx];
    const uint64_t remote = r.base ? reinterpret_cast<uint64_t>(r.base) + e.remote_offset : r.remote_addr + e.remote_offset;
    // Coalesce neighbours (already coalesced by the planner for block transfers).
    if (!p->ops.empty()) {
      CopyOp& b = p->ops.back();
      if (b.region == last_idx && b.local + b.len == reinterpret_cast<char*>(e.local_addr) && b.remote + b.len == remote) {
        b.len += e.len;
        p->total += e.len;
        continue;
      }
    }
    p->ops.push_back(CopyOp{reinterpret_cast<char*>(e.local_addr), remote, e.len, last_idx});
    p->total += e.len;
  }
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

void ShmTransport::unpin(const ShmPrepared& p) {
  for (auto& r : p.regions)
    if (r->inflight.fetch_sub(1) == 1 && r->revoked) {
      // The progress thread may be waiting to acknowledge a revoke.
      if (!r->ack_sent.exchange(true))
        if (auto c = r->conn.lock()) send_frame(*c, Ctl::kRevokeAck, r->id, {});
    }
}

Status ShmTransport::run_copies(const ShmPrepared& p) {
  if (!p.cma) {
    if (p.op == OpKind::kWrite) {
      for (const auto& o : p.ops) std::memcpy(reinterpret_cast<void*>(o.remote), o.local, o.len);
    } else {
      for (const auto& o : p.ops) std::memcpy(o.local, reinterpret_cast<const void*>(o.remote), o.len);
    }
    return Status::Ok();
  }
  // Mixed: mapped extents by memcpy, the rest by process_vm_{write,read}v in batches.
  std::vector<iovec> liov, riov;
  liov.reserve(1024);
  riov.reserve(1024);
  auto flush = [&]() -> Status {
    size_t i = 0;
    while (i < liov.size()) {
      size_t n = std::min<size_t>(liov.size() - i, 1024);
      ssize_t got = p.op == OpKind::kWrite ? ::process_vm_writev(p.pid, &liov[i], n, &riov[i], n, 0)
                                           : ::process_vm_readv(p.pid, &liov[i], n, &riov[i], n, 0);
      if (got < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        if (err == ESRCH) return ConnectionError("peer process " + std::to_string(p.pid) + " is gone");
        return ConnectionError("cross-memory " + std::string(p.op == OpKind::kWrite ? "write" : "read") +
                               " to pid " + std::to_string(p.pid) + " failed: " + errno_str(err));
      }
      // Advance over fully copied entries; a partial one is retried from its tail.
      size_t left = static_cast<size_t>(got);
      while (left > 0 && i < liov.size()) {
        if (left >= liov[i].iov_len) {
          left -= liov[i].iov_len;
          ++i;
        } else {
          liov[i].iov_base = static_cast<char*>(liov[i].iov_base) + left;
          riov[i].iov_base = static_cast<char*>(riov[i].iov_base) + left;
          liov[i].iov_len -= left;
          riov[i].iov_len -= left;
          left = 0;
        }
      }
      if (got == 0) return ConnectionError("cross-memory copy made no progress");
    }
    liov.clear();
    riov.clear();
    return Status::Ok();
  };
  for (const auto& o : p.ops) {
    if (p.regions[o.region]->base) {
      if (p.op == OpKind::kWrite)
        std::memcpy(reinterpret_cast<void*>(o.remote), o.local, o.len);
      else
        std::memcpy(o.local, reinterpret_cast<const void*>(o.remote), o.len);
      continue;
    }
    liov.push_back({o.local, o.len});
    riov.push_back({reinterpret_cast<void*>(o.remote), o.len});
    if (liov.size() == 1024) PDKV_RETURN_IF_ERROR(flush());
  }
  return flush();
}

void ShmTransport::send_notify(const std::shared_ptr<ShmConn>& c, const std::shared_ptr<Transfer>& xfer,
                               const std::string& notif) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->dead) {
      Status why = c->dead_reason;
      xfer->resolve_part(0, why.ok() ? ConnectionError("connection closed") : why);
      return;
    }
    seq = c->next_seq++;
    c->notifies[seq] = PendingNotify{xfer, xfer->deadline()};
  }
  Status st = send_frame(*c, Ctl::kNotify, seq, notif);
  if (!st.ok()) {
    bool mine = false;
    {
      std::lock_guard<std::mutex> lk(c->mu);
      mine = c->notifies.erase(seq) > 0;
    }
    if (mine) xfer->resolve_part(0, st);
    return;
  }
  uint64_t one = 1;
  if (::write(evfd_, &one, sizeof one) < 0) {  // start the deadline clock
  }
}

void ShmTransport::finish_job(Job& job, Status st) {
  unpin(*job.prep);
  // The bytes are in memory the peer shares with us; fail the transfer if the peer
  // died meanwhile (the progress thread sees its socket close at once).
  if (st.ok() && job.prep->conn->gone.load(std::memory_order_acquire))
    st = ConnectionError(job.prep->conn->desc + " went away during the transfer");
  if (!st.ok() || job.notif.empty()) {
    job.xfer->resolve_part(st.ok() ? job.prep->total : 0, st);
    if (!job.notif.empty()) job.xfer->resolve_part(0, Cancelled("notification not sent: the copy failed"));
    return;
  }
  // Data landed: one part for the bytes, one for the acknowledged notification.
  job.xfer->resolve_part(job.prep->total, Status::Ok());
  send_notify(job.prep->conn, job.xfer, job.notif);
}

void ShmTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const ShmPrepared>(ops);
  xfer->set_parts(notif.empty() ? 1 : 2);
  {
    std::lock_guard<std::mutex> lk(prep->conn->mu);
    if (prep->conn->dead) {
      Status why = prep->conn->dead_reason;
      xfer->resolve_part(0, why);
      if (!notif.empty()) xfer->resolve_part(0, Cancelled("notification not sent"));
      return;
    }
  }
  for (size_t i = 0; i < prep->regions.size(); ++i) {
    auto& r = prep->regions[i];
    r->inflight.fetch_add(1);
    if (r->revoked) {
      for (size_t j = 0; j <= i; ++j)
        if (prep->regions[j]->inflight.fetch_sub(1) == 1) maybe_ack_revoke(prep->regions[j]);
      xfer->resolve_part(0, NotFound("peer deregistered region " + std::to_string(r->id) + "; prepare again"));
      if (!notif.empty()) xfer->resolve_part(0, Cancelled("notification not sent"));
      return;
    }
  }
  Job job{prep, xfer, std::move(notif)};
  if (prep->total <= opts_.inline_bytes) {
    Status st = run_copies(*prep);
    finish_job(job, st);
    return;
  }
  std::lock_guard<std::mutex> lk(qmu_);
  queue_.push_back(std::move(job));
  qcv_.notify_one();
}

void ShmTransport::copy_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(qmu_);
      qcv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    if (job.xfer->cancel_requested()) {
      unpin(*job.prep);
      job.xfer->resolve_part(0, Cancelled("cancelled before the copy started"));
      if (!job.notif.empty()) job.xfer->resolve_part(0, Cancelled("notification not sent"));
      continue;
    }
    finish_job(job, run_copies(*job.prep));
  }
}

void ShmTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto ps = peer_state(peer);
  if (!ps.ok()) {
    xfer->resolve_part(0, ps.status());
    return;
  }
  auto c = get_conn(**ps);
  if (!c.ok()) {
    xfer->resolve_part(0, c.status());
    return;
  }
  send_notify(*c, xfer, notif);
}

Status ShmTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  (void)timeout_s;
  PDKV_ASSIGN_OR_RETURN(auto ps, peer_state(peer));
  PDKV_ASSIGN_OR_RETURN(auto c, get_conn(*ps));
  (void)c;
  return Status::Ok();
}

void ShmTransport::drop_peer(const std::string& name) {
  std::shared_ptr<ShmPeerState> ps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    ps = it->second;
    peers_.erase(it);
  }
  std::shared_ptr<ShmConn> c;
  {
    std::lock_guard<std::mutex> lk(ps->mu);
    c = ps->conn;
  }
  if (c) kill(c, ConnectionError("peer '" + name + "' was removed"));
}

void ShmTransport::region_removed(const RegionDesc& region) {
  std::vector<std::shared_ptr<ShmConn>> inbound;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_)
      if (!c->outbound && c->authed) inbound.push_back(c);
  }
  for (auto& c : inbound) {
    {
      std::lock_guard<std::mutex> lk(c->mu);
      c->revoke_acks.erase(region.id);
    }
    if (!send_frame(*c, Ctl::kRevoke, region.id, {}).ok()) continue;
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& c : inbound) {
    std::unique_lock<std::mutex> lk(c->mu);
    if (!c->cv.wait_until(lk, deadline, [&] { return c->dead || c->revoke_acks.count(region.id); }))
      PDKV_LOG_WARN("%s did not confirm it stopped using region %llu within 10 s", c->desc.c_str(),
                    static_cast<unsigned long long>(region.id));
    c->revoke_acks.erase(region.id);
  }
}

Status shm_viable() {
  int fd = ::memfd_create("pdkv-probe", MFD_CLOEXEC);
  if (fd < 0) return NotSupported("memfd_create failed: " + errno_str(errno));
  ::close(fd);
  return Status::Ok();
}

bool registered = register_transport(TransportFactory{
    "shm", "same-host shared memory (memfd pools; cross-memory attach otherwise)", shm_viable,
    [](const AgentConfig& cfg) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(std::make_unique<ShmTransport>(cfg));
    }});

}  // namespace
}  // namespace pdkv::shm
