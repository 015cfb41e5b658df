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
// Direct access means the target cannot check each write, so the initiator never
// trusts the metadata blob for bounds: before first use it asks the target, over
// the authenticated socket, what region `id` is now (RegionReq), and uses only the
// answer (a mismatch with the blob is an error). The target remembers which peer
// confirmed which region; when it deregisters one it tells each of them to stop
// (Revoke) and waits for their acknowledgements, at most kRevokeTimeoutS, after
// which it closes that peer's connection (a peer must re-confirm on a new one).
//
// Peer faults never fail prepare(): connecting and confirming happen when a
// transfer is first posted, and their errors fail that transfer.
//
// Protocol: shm_ctl.h and docs/wire.md.
//
// Files: shm_transport_impl.h lists them.
#include <fcntl.h>
#include <poll.h>
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
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pdkv/spi/registry.h"
#include "transport/shm/remote_region.h"
#include "transport/shm/shm_ctl.h"
#include "transport/shm/shm_dial.h"
#include "transport/shm/shm_transport_impl.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"

namespace pdkv::shm {
namespace {

using util::errno_str;

constexpr size_t kMaxQueuedFds = 4;  // fds received ahead of their RegionResp

}  // namespace

Status ShmTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  PDKV_RETURN_IF_ERROR(opts_.validate());  // also checked by AgentConfig::validate()
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
  copies_.start(opts_.copy_threads);
  return Status::Ok();
}

void ShmTransport::shutdown() {
  if (shut_.exchange(true)) return;
  stop_ = true;
  wake();
  if (th_.joinable()) th_.join();
  for (auto& j : copies_.stop()) {
    end_lease(j);
    unpin(*j.b);
    spi::TransferControl(j.xfer).resolve_part(0, ConnectionError("agent is shutting down"));
    if (!j.notif.empty()) spi::TransferControl(j.xfer).resolve_part(0, Cancelled("notification not sent"));
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
  wake();
}

// ---------------------------------------------------------------- progress thread

void ShmTransport::run() {
  epoll_event evs[32];
  while (!stop_) {
    bool busy = false;  // something has a deadline: poll for it
    {
      std::lock_guard<std::mutex> lk(mu_);
      const auto never = Clock::time_point::max().time_since_epoch().count();
      for (auto& [p, c] : conns_) {
        std::lock_guard<std::mutex> lk2(c->mu);
        if (!c->authed || !c->notifies.empty() || !c->leases.empty() || c->frame_deadline.load() != never)
          busy = true;
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
    check_deadlines();
  }
}

// Handshakes, frames in progress, held-back refusals, notification acknowledgements.
void ShmTransport::check_deadlines() {
  const auto now = Clock::now();
  std::vector<std::pair<std::shared_ptr<ShmConn>, Status>> doomed, refused;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) {
      std::lock_guard<std::mutex> lk2(c->mu);
      if (c->dead) continue;
      if (c->reject_at != Clock::time_point::max()) {
        if (now >= c->reject_at) refused.emplace_back(c, c->reject);
        continue;
      }
      if (!c->authed && now > c->hs_deadline) {
        doomed.emplace_back(c, TimeoutError(c->desc + " did not complete the handshake within " +
                                            std::to_string(int(kHandshakeTimeoutS)) + " s"));
        continue;
      }
      if (now.time_since_epoch().count() > c->frame_deadline.load()) {
        doomed.emplace_back(c, TimeoutError(c->desc + " started a control frame and did not finish it within " +
                                            std::to_string(int(kFrameTimeoutS)) + " s"));
        continue;
      }
      bool expired = false;
      for (auto& [id, l] : c->leases)
        if (l.expires <= now) {
          doomed.emplace_back(c, TimeoutError(c->desc + " held block lease " + std::to_string(id) +
                                              " past its hold time; closing the connection releases it"));
          expired = true;
          break;
        }
      if (expired) continue;
      for (auto& [seq, pn] : c->notifies)
        if (pn.deadline <= now) {
          doomed.emplace_back(c, TimeoutError("transfer " + std::to_string(pn.xfer->id()) + " to " + c->desc +
                                              " timed out waiting for the peer to take its notification"));
          break;
        }
    }
  }
  for (auto& [c, st] : refused) {
    (void)send_frame(*c, Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    kill(c, st);
  }
  for (auto& [c, st] : doomed) {
    if (!c->authed) log_refusal(st);
    kill(c, st);
  }
}

size_t ShmTransport::pending_conns() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& [p, c] : conns_) n += !c->outbound && !c->authed;
  return n;
}

void ShmTransport::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of fds (EMFILE/ENFILE) leaves the listen socket readable: stop polling
      // it for a moment instead of spinning.
      if (errno == EMFILE || errno == ENFILE) {
        log_refusal(ResourceExhausted("cannot accept shm connections: " + errno_str(errno)));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return;
    }
    ucred cr{};
    socklen_t len = sizeof cr;
    ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len);
    if (pending_conns() >= kMaxPendingConns) {
      ::close(fd);
      log_refusal(ResourceExhausted("closed a connection from local process " + std::to_string(cr.pid) + ": " +
                                    std::to_string(kMaxPendingConns) + " connections are already handshaking"));
      continue;
    }
    auto c = std::make_shared<ShmConn>(fd, false, "local process " + std::to_string(cr.pid));
    c->peer_pid = cr.pid;
    c->hs_deadline = util::deadline_after(kHandshakeTimeoutS);
    add_conn(c);
  }
}

void ShmTransport::log_refusal(const Status& st) {
  uint64_t suppressed = 0;
  if (!refusal_log_.allow(Clock::now(), &suppressed)) return;
  if (suppressed)
    PDKV_LOG_WARN("shm: %s (and %llu similar in the last second)", st.to_string().c_str(),
                  static_cast<unsigned long long>(suppressed));
  else
    PDKV_LOG_WARN("shm: %s", st.to_string().c_str());
}

void ShmTransport::on_readable(const std::shared_ptr<ShmConn>& c) {
  std::lock_guard<std::mutex> rx(c->rx_mu);
  if (c->gone) return;
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
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxQueuedFds)];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (c->outbound) {  // only a target sends fds (with RegionResp)
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
    if (c->fds.size() > kMaxQueuedFds) {
      kill(c, ProtocolError(c->desc + " sent more file descriptors than region responses"));
      return;
    }
    if (!c->in_aux) {
      if (c->hdr_got == 0) {  // a frame starts: it must be complete in time
        c->frame_deadline = util::deadline_after(kFrameTimeoutS).time_since_epoch().count();
      }
      c->hdr_got += static_cast<size_t>(r);
      if (c->hdr_got < sizeof(CtlHdr)) continue;
      const CtlSide side =
          c->outbound ? CtlSide::kInitiator : (c->authed ? CtlSide::kTarget : CtlSide::kTargetPreHello);
      Status st = check_ctl_header(c->hdr, side, hooks_->max_notif_bytes());
      if (!st.ok()) {
        st = ProtocolError(c->desc + ": " + st.message());
        if (c->hdr.magic != kCtlMagic) {  // not our protocol at all: just close
          if (!c->authed) log_refusal(st);
          return kill(c, st);
        }
        return refuse(c, st, c->hdr.id);
      }
      c->aux.assign(c->hdr.aux_len, '\0');  // bounded by check_ctl_header
      c->aux_got = 0;
      c->in_aux = c->hdr.aux_len > 0;
      if (c->in_aux) continue;
    } else {
      c->aux_got += static_cast<size_t>(r);
      if (c->aux_got < c->aux.size()) continue;
    }
    c->in_aux = false;
    c->hdr_got = 0;
    c->frame_deadline = Clock::time_point::max().time_since_epoch().count();
    handle_frame(c);
    if (c->gone) return;
    {
      std::lock_guard<std::mutex> lk(c->mu);
      if (c->reject_at != Clock::time_point::max()) return;  // no longer read: answer held back
    }
  }
}

// Processes control frames that already arrived (a revoke, a close) before a post
// uses the connection: a peer resumed after being frozen acts on them first.
void ShmTransport::drain_control(const std::shared_ptr<ShmConn>& c) {
  pollfd pfd{c->fd, POLLIN | POLLRDHUP, 0};
  if (!c->gone && ::poll(&pfd, 1, 0) > 0) on_readable(c);
}

// Sends an error frame (best effort), logs (rate-limited) and closes.
void ShmTransport::refuse(const std::shared_ptr<ShmConn>& c, const Status& st, uint64_t id) {
  (void)send_frame(*c, Ctl::kError, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
  if (!c->outbound && !c->authed) log_refusal(st);
  kill(c, st);
}

void ShmTransport::handle_frame(const std::shared_ptr<ShmConn>& c) {
  const CtlHdr h = c->hdr;
  if (c->outbound) {
    handle_outbound(c, h);
  } else if (!c->authed) {
    on_hello(c);  // check_ctl_header let nothing else through
  } else {
    handle_inbound(c, h);
  }
}

void ShmTransport::handle_outbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h) {
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kRegionResp: {
      RegionAnswer a;
      if (h.status != 0) {
        a.st = Status(status_code_from_wire(h.status), c->aux);
      } else {
        auto info = parse_region_info(c->aux);
        if (!info.ok()) return kill(c, ProtocolError(c->desc + ": " + info.status().message()));
        a.info = *info;
        if (a.info.shareable) {
          if (c->fds.empty()) return kill(c, ProtocolError(c->desc + " confirmed a shared region without its fd"));
          a.fd = c->fds.front();
          c->fds.pop_front();
        }
      }
      {
        std::lock_guard<std::mutex> lk(c->mu);
        if (c->pending_req == h.id && !c->answers.count(h.id)) {
          c->answers.emplace(h.id, std::move(a));
          c->cv.notify_all();
          return;
        }
      }
      if (a.fd >= 0) ::close(a.fd);
      return kill(c, ProtocolError(c->desc + " answered a region request it was not asked"));
    }
    case Ctl::kLeaseResp: {
      bool asked = false;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        auto it = c->lease_answers.find(h.id);
        if (it != c->lease_answers.end() && !it->second) {
          it->second = h.status == 0 ? Status::Ok() : Status(status_code_from_wire(h.status), c->aux);
          asked = true;
          c->cv.notify_all();
        }
      }
      if (!asked) return kill(c, ProtocolError(c->desc + " answered a lease request it was not asked"));
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
      if (x) spi::TransferControl(x).resolve_part(0, Status::Ok());
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
        if (r || c->pending_req == h.id) c->revoked_ids.insert(h.id);
      }
      if (!r) {
        (void)send_frame(*c, Ctl::kRevokeAck, h.id, {});
        return;
      }
      r->revoked = true;
      ack_revoke_when_idle(r);
      return;
    }
    case Ctl::kError:
      return kill(c, Status(status_code_from_wire(h.status), c->desc + " refused: " + c->aux));
    default:  // check_ctl_header admits nothing else
      return kill(c, ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc));
  }
}

void ShmTransport::kill(const std::shared_ptr<ShmConn>& c, const Status& why) {
  std::map<uint64_t, PendingNotify> pend;
  std::map<uint64_t, Lease> leases;  // a dead connection holds no blocks
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->dead) return;
    c->dead = true;
    c->gone = true;
    c->dead_reason = why;
    pend.swap(c->notifies);
    leases.swap(c->leases);
    c->leased_blocks = 0;
    c->cv.notify_all();
  }
  if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
  ::shutdown(c->fd, SHUT_RDWR);
  for (auto& [seq, pn] : pend) spi::TransferControl(pn.xfer).resolve_part(0, why);
  std::lock_guard<std::mutex> lk(mu_);
  conns_.erase(c.get());
}

// ---------------------------------------------------------------- initiator side

// One state (and connection) per peer instance; newer metadata of the same
// instance replaces the old for the next dial.
std::shared_ptr<ShmPeerState> ShmTransport::peer_state(const std::shared_ptr<const Peer>& peer) {
  std::shared_ptr<ShmPeerState> ps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = peers_[peer->md.name];
    if (!slot || slot->instance != peer->md.instance_id) {
      slot = std::make_shared<ShmPeerState>();
      slot->instance = peer->md.instance_id;
      slot->peer = peer;
      return slot;
    }
    ps = slot;
  }
  std::lock_guard<std::mutex> lk(ps->mu);
  ps->peer = peer;
  return ps;
}

Result<std::shared_ptr<ShmConn>> ShmTransport::get_conn(ShmPeerState& ps) {
  std::lock_guard<std::mutex> lk(ps.mu);
  if (ps.conn) {
    std::lock_guard<std::mutex> lk2(ps.conn->mu);
    if (!ps.conn->dead) return ps.conn;
  }
  if (shut_) return ConnectionError("agent is shutting down");
  PDKV_ASSIGN_OR_RETURN(ps.conn, dial(*ps.peer, hooks_->agent_name(), connect_timeout_));
  add_conn(ps.conn);
  return ps.conn;
}

Result<std::shared_ptr<const PreparedOps>> ShmTransport::prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                         std::vector<ResolvedExtent> extents,
                                                                         std::shared_ptr<const GenClaim> claim) {
  PDKV_ASSIGN_OR_RETURN(auto ops, prepare(std::move(peer), op, std::move(extents)));
  auto p = std::const_pointer_cast<ShmPrepared>(std::static_pointer_cast<const ShmPrepared>(ops));
  p->claim_wire = encode_claim(*claim);
  p->claim = std::move(claim);
  return ops;
}

// Asks the target to check and pin the claimed block generations before a copy (one
// round trip); returns the lease id to end after the copy. A target that does not
// answer in time loses the connection, which releases whatever it granted.
Result<uint64_t> ShmTransport::take_lease(const std::shared_ptr<ShmConn>& c, const std::string& claim_wire,
                                          Clock::time_point deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return TimeoutError("the transfer's deadline passed before its blocks were leased");
  const double hold_s = deadline == Clock::time_point::max()
                            ? kMaxLeaseHoldMs / 1000.0
                            : std::chrono::duration<double>(deadline - now).count();
  const auto hold_ms = static_cast<uint32_t>(std::clamp(hold_s * 1000.0 + 1.0, 1.0, double(kMaxLeaseHoldMs)));
  util::ByteWriter w;
  w.put<uint32_t>(hold_ms);
  std::string aux = w.take() + claim_wire;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->dead) return c->dead_reason;
    id = c->next_lease++;
    c->lease_answers.emplace(id, std::nullopt);
  }
  Status sent = send_frame(*c, Ctl::kLeaseReq, id, aux);
  std::optional<Status> ans;
  bool got = false;
  {
    std::unique_lock<std::mutex> lk(c->mu);
    const auto until = std::min(deadline, util::deadline_after(connect_timeout_));
    got = sent.ok() && c->cv.wait_until(lk, until, [&] { return c->dead || c->lease_answers[id].has_value(); });
    ans = c->lease_answers[id];
    c->lease_answers.erase(id);
    if (c->dead) return c->dead_reason;  // the target released the lease with the connection
  }
  if (!sent.ok()) return sent;
  if (!got) {
    Status st = TimeoutError(c->desc + " did not answer a block lease request in time");
    kill(c, st);
    return st;
  }
  if (!ans->ok()) return *ans;
  return id;
}

void ShmTransport::end_lease(Job& job) {
  if (job.lease == 0) return;
  (void)send_frame(*job.b->conn, Ctl::kLeaseEnd, job.lease, {});  // a dead connection released it already
  job.lease = 0;
}

Result<std::shared_ptr<const PreparedOps>> ShmTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  // No peer I/O here: connecting and confirming regions happen at the first post,
  // so a peer fault fails the transfer rather than the call.
  auto p = std::make_shared<ShmPrepared>();
  p->ps = peer_state(peer);
  p->peer = std::move(peer);
  p->op = op;
  p->extents = std::move(extents);
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

// Binds a prepared transfer to a live connection and the regions confirmed on it;
// every extent is checked against the confirmed lengths.
Result<std::shared_ptr<const Binding>> ShmTransport::bind(const ShmPrepared& p) {
  std::lock_guard<std::mutex> lk(p.mu);
  const Peer& peer = *p.peer;
  if (p.bound) {
    for (auto& r : p.bound->regions)
      if (r->revoked) return NotFound(deregistered(peer.md.name, r->id));
    if (!p.bound->conn->gone) return p.bound;
  }
  PDKV_ASSIGN_OR_RETURN(auto conn, get_conn(*p.ps));
  auto b = std::make_shared<Binding>();
  b->conn = conn;
  b->op = p.op;
  b->pid = conn->peer_pid;
  b->ops.reserve(p.extents.size());
  std::unordered_map<uint64_t, uint32_t> index;
  uint64_t last_id = ~0ull;
  uint32_t last_idx = 0;
  for (const auto& e : p.extents) {
    if (e.remote_region != last_id) {
      auto it = index.find(e.remote_region);
      if (it == index.end()) {
        PDKV_ASSIGN_OR_RETURN(auto r, confirm_region(conn, peer, e.remote_region, connect_timeout_));
        if (!r->base) b->cma = true;
        it = index.emplace(e.remote_region, static_cast<uint32_t>(b->regions.size())).first;
        b->regions.push_back(std::move(r));
      }
      last_id = e.remote_region;
      last_idx = it->second;
    }
    const RemoteRegion& r = *b->regions[last_idx];
    if (e.remote_offset > r.len || e.len > r.len - e.remote_offset)
      return OutOfRange("remote bytes [" + std::to_string(e.remote_offset) + ", +" + std::to_string(e.len) +
                        ") fall outside region " + std::to_string(r.id) + " of peer '" + peer.md.name + "' (" +
                        std::to_string(r.len) + " bytes as the peer confirms it)");
    const uint64_t remote = r.base ? reinterpret_cast<uint64_t>(r.base) + e.remote_offset : r.remote_addr + e.remote_offset;
    // Coalesce neighbours (already coalesced by the planner for block transfers).
    if (!b->ops.empty()) {
      CopyOp& o = b->ops.back();
      if (o.region == last_idx && o.local + o.len == reinterpret_cast<char*>(e.local_addr) && o.remote + o.len == remote) {
        o.len += e.len;
        b->total += e.len;
        continue;
      }
    }
    b->ops.push_back(CopyOp{reinterpret_cast<char*>(e.local_addr), remote, e.len, last_idx});
    b->total += e.len;
  }
  p.bound = b;
  return std::shared_ptr<const Binding>(b);
}

void ShmTransport::unpin(const Binding& b) {
  for (auto& r : b.regions)
    if (r->inflight.fetch_sub(1) == 1 && r->revoked) ack_revoke_when_idle(r);
}

void ShmTransport::send_notify(const std::shared_ptr<ShmConn>& c, const std::shared_ptr<Transfer>& xfer,
                               const std::string& notif) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->dead) {
      Status why = c->dead_reason;
      spi::TransferControl(xfer).resolve_part(0, why.ok() ? ConnectionError("connection closed") : why);
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
    if (mine) spi::TransferControl(xfer).resolve_part(0, st);
    return;
  }
  wake();  // start the deadline clock
}

void ShmTransport::finish_job(Job& job, Status st) {
  // The bytes are in memory the peer shares with us; fail the transfer if the peer
  // died meanwhile (the progress thread sees its socket close at once).
  if (st.ok() && job.b->conn->gone.load(std::memory_order_acquire))
    st = ConnectionError(job.b->conn->desc + " went away during the transfer");
  // The copy is over: the target may unpin the blocks (before the notification, which
  // follows on the same socket).
  end_lease(job);
  // Resolve the data part before unpinning: unpinning may acknowledge a revoke, and the
  // peer's deregistration returns on that ack; by then this transfer must be terminal.
  spi::TransferControl(job.xfer).resolve_part(st.ok() ? job.b->total : 0, st);
  unpin(*job.b);
  if (job.notif.empty()) return;
  if (!st.ok()) {
    spi::TransferControl(job.xfer).resolve_part(0, Cancelled("notification not sent: the copy failed"));
    return;
  }
  // Data landed: the second part is the acknowledged notification.
  send_notify(job.b->conn, job.xfer, job.notif);
}

void ShmTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const ShmPrepared>(ops);
  spi::TransferControl(xfer).set_parts(notif.empty() ? 1 : 2);
  auto fail = [&](const Status& st) {
    spi::TransferControl(xfer).resolve_part(0, st);
    if (!notif.empty()) spi::TransferControl(xfer).resolve_part(0, Cancelled("notification not sent"));
  };
  auto bound = bind(*prep);
  if (!bound.ok()) return fail(bound.status());
  auto b = std::move(bound).value();
  drain_control(b->conn);
  if (b->conn->gone.load(std::memory_order_acquire)) {
    // The peer closed the connection before this transfer touched it: dial again, so
    // the dial itself says what happened (StalePeer for a restarted peer,
    // PeerConnectionError for a dead one, NotFound for a revoked region).
    bound = bind(*prep);
    if (!bound.ok()) return fail(bound.status());
    b = std::move(bound).value();
    drain_control(b->conn);
  }
  {
    std::lock_guard<std::mutex> lk(b->conn->mu);
    if (b->conn->dead) return fail(b->conn->dead_reason);
  }
  for (size_t i = 0; i < b->regions.size(); ++i) {
    auto& r = b->regions[i];
    r->inflight.fetch_add(1);
    if (r->revoked) {
      for (size_t j = 0; j <= i; ++j)
        if (b->regions[j]->inflight.fetch_sub(1) == 1) ack_revoke_when_idle(b->regions[j]);
      return fail(NotFound(deregistered(prep->peer->md.name, r->id)));
    }
  }
  uint64_t lease = 0;
  if (prep->claim) {
    auto l = take_lease(b->conn, prep->claim_wire, xfer->deadline());
    if (!l.ok()) {
      unpin(*b);
      return fail(l.status());
    }
    lease = *l;
  }
  Job job{b, xfer, std::move(notif), lease};
  if (b->total <= opts_.inline_bytes) {
    Status st = run_copies(*b);
    finish_job(job, st);
    return;
  }
  copies_.submit(std::move(job));
}

void ShmTransport::run_job(Job& job) {
  if (spi::TransferControl(job.xfer).cancel_requested()) {
    end_lease(job);
    unpin(*job.b);
    spi::TransferControl(job.xfer).resolve_part(0, Cancelled("cancelled before the copy started"));
    if (!job.notif.empty()) spi::TransferControl(job.xfer).resolve_part(0, Cancelled("notification not sent"));
    return;
  }
  finish_job(job, run_copies(*job.b));
}

void ShmTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto c = get_conn(*peer_state(peer));
  if (!c.ok()) {
    spi::TransferControl(xfer).resolve_part(0, c.status());
    return;
  }
  send_notify(*c, xfer, notif);
}

Status ShmTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  (void)timeout_s;
  PDKV_ASSIGN_OR_RETURN(auto c, get_conn(*peer_state(peer)));
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

namespace {

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
    },
    /*priority=*/200});

}  // namespace

}  // namespace pdkv::shm
