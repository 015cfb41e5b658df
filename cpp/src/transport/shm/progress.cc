// ShmTransport's progress thread: one epoll thread that accepts same-host peers,
// reads every control connection (frames are checked by check_ctl_header before
// anything is allocated), hands each complete frame to the target side
// (target.cc) or the initiator side (below: region and lease answers,
// notification acks, revokes), and enforces the deadlines: a hello within
// kHandshakeTimeoutS, a started frame within kFrameTimeoutS, block leases within
// their hold time, notification acks within their transfer's deadline. kill()
// retires a connection once, failing what waited on it.
//
// Thread safety: run() and everything it calls run on the progress thread, except
// on_readable (also called by a posting thread through drain_control, serialised by
// the connection's rx_mu), kill and add_conn (any thread).
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "transport/shm/peer_identity.h"
#include "transport/shm/remote_region.h"
#include "transport/shm/wire.h"
#include "transport/shm/shm_transport_impl.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::shm {
using util::errno_str;

void ShmTransport::add_conn(const std::shared_ptr<ShmConn>& c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = c.get();
  epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd(), &ev);
  wake();
}

// ---------------------------------------------------------------- progress thread

void ShmTransport::run() {
  util::name_this_thread("pdkv-shm");
  epoll_event evs[32];
  while (!stop_) {
    bool busy = false;  // something has a deadline: poll for it
    {
      std::lock_guard<std::mutex> lk(mu_);
      const auto never = Clock::time_point::max();
      for (auto& [p, c] : conns_) {
        auto s = c->lock();
        if (!c->authed() || !s->notifies.empty() || !s->leases.empty() || c->frame_deadline() != never) busy = true;
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
      if (p == &tfd_) {  // a deadline (wake_at): check_deadlines below
        uint64_t v;
        if (::read(tfd_, &v, sizeof v) < 0) {
        }
        std::lock_guard<std::mutex> lk(timer_mu_);
        armed_ = Clock::time_point::max();
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
      auto s = c->lock();
      if (s->dead) continue;
      if (s->reject_at != Clock::time_point::max()) {
        if (now >= s->reject_at) refused.emplace_back(c, s->reject);
        continue;
      }
      if (!c->authed() && now > c->hello_deadline()) {
        doomed.emplace_back(c, TimeoutError(c->desc() + " did not complete the handshake within " +
                                            std::to_string(int(kHandshakeTimeoutS)) + " s"));
        continue;
      }
      if (now > c->frame_deadline()) {
        doomed.emplace_back(c, TimeoutError(c->desc() + " started a control frame and did not finish it within " +
                                            std::to_string(int(kFrameTimeoutS)) + " s"));
        continue;
      }
      bool expired = false;
      for (auto& [id, l] : s->leases)
        if (l.expires <= now) {
          doomed.emplace_back(c, TimeoutError(c->desc() + " held block lease " + std::to_string(id) +
                                              " past its hold time; closing the connection releases it"));
          expired = true;
          break;
        }
      if (expired) continue;
      for (auto& [seq, pn] : s->notifies)
        if (pn.deadline <= now) {
          doomed.emplace_back(c, TimeoutError("transfer " + std::to_string(pn.xfer->id()) + " to " + c->desc() +
                                              " timed out waiting for the peer to take its notification"));
          break;
        }
    }
  }
  for (auto& [c, st] : refused) {
    (void)c->send_frame(Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    kill(c, st);
  }
  for (auto& [c, st] : doomed) {
    if (!c->authed()) log_refusal(st);
    kill(c, st);
  }
}

size_t ShmTransport::pending_conns() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& [p, c] : conns_) n += !c->outbound() && !c->authed();
  return n;
}

size_t ShmTransport::reap_hung_up_pending() {
  // A burst of connections whose dialers already gave up (a peer that was frozen with a
  // full backlog, then resumed) is accepted in one go, before any of their EOFs is read:
  // without this they would fill the handshake slots and refuse the live dial behind them.
  std::vector<std::shared_ptr<ShmConn>> pending;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_)
      if (!c->outbound() && !c->authed()) pending.push_back(c);
  }
  size_t reaped = 0;
  for (auto& c : pending) {
    pollfd p{c->fd(), POLLRDHUP, 0};
    if (::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
      kill(c, ConnectionError("the dialer closed the connection before its hello"));
      ++reaped;
    }
  }
  return reaped;
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
    // Who connected is the kernel's word (SO_PEERCRED), checked before anything is read.
    auto cred = peer_cred(fd);
    Status allowed = cred.ok() ? check_peer_uid(*cred, opts_.allowed_peer_uids, "a local process connecting to agent '" +
                                                                                  hooks_->agent_name() + "'")
                               : cred.status();
    if (!allowed.ok()) {
      const std::string msg = allowed.message().substr(0, kMaxErrorAux);
      CtlHdr h{kCtlMagic, static_cast<uint16_t>(Ctl::kError), 0, 0, static_cast<uint32_t>(msg.size()),
               static_cast<uint32_t>(allowed.code())};
      std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
      frame += msg;
      (void)!::send(fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);  // best effort
      ::close(fd);
      log_refusal(allowed);
      continue;
    }
    const PeerCred cr = *cred;
    if (pending_conns() >= kMaxPendingConns && (reap_hung_up_pending() == 0 || pending_conns() >= kMaxPendingConns)) {
      ::close(fd);
      log_refusal(ResourceExhausted("closed a connection from local process " + std::to_string(cr.pid) + ": " +
                                    std::to_string(kMaxPendingConns) + " connections are already handshaking"));
      continue;
    }
    add_conn(ShmConn::accepted(fd, cr.pid, util::deadline_after(kHandshakeTimeoutS)));
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
  auto rx = c->lock_rx();
  if (c->gone()) return;
  for (;;) {
    Status err;
    switch (c->read_frame(hooks_->max_notif_bytes(), &err)) {
      case ShmConn::RxStep::kEmpty: return;
      case ShmConn::RxStep::kBroken: return kill(c, err);
      case ShmConn::RxStep::kBadHeader:
        if (c->frame_header().magic != kCtlMagic) {  // not our protocol at all: just close
          if (!c->authed()) log_refusal(err);
          return kill(c, err);
        }
        return refuse(c, err, c->frame_header().id);
      case ShmConn::RxStep::kFrame: break;
    }
    handle_frame(c);
    if (c->gone()) return;
    if (c->lock()->reject_at != Clock::time_point::max()) return;  // no longer read: answer held back
  }
}

// Processes control frames that already arrived (a revoke, a close) before a post
// uses the connection: a peer resumed after being frozen acts on them first.
void ShmTransport::drain_control(const std::shared_ptr<ShmConn>& c) {
  pollfd pfd{c->fd(), POLLIN | POLLRDHUP, 0};
  if (!c->gone() && ::poll(&pfd, 1, 0) > 0) on_readable(c);
}

// Sends an error frame (best effort), logs (rate-limited) and closes.
void ShmTransport::refuse(const std::shared_ptr<ShmConn>& c, const Status& st, uint64_t id) {
  (void)c->send_frame(Ctl::kError, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
  if (!c->outbound() && !c->authed()) log_refusal(st);
  kill(c, st);
}

void ShmTransport::handle_frame(const std::shared_ptr<ShmConn>& c) {
  const CtlHdr h = c->frame_header();
  if (c->outbound()) {
    handle_outbound(c, h);
  } else if (!c->authed()) {
    // check_ctl_header let nothing else through: a hello, then a proof.
    if (static_cast<Ctl>(h.type) == Ctl::kHello) on_hello(c);
    else on_proof(c);
  } else {
    handle_inbound(c, h);
  }
}

void ShmTransport::handle_outbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h) {
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kRegionResp: {
      RegionAnswer a;
      if (h.status != 0) {
        a.st = Status(status_code_from_wire(h.status), c->frame_aux());
      } else {
        auto info = parse_region_info(c->frame_aux());
        if (!info.ok()) return kill(c, ProtocolError(c->desc() + ": " + info.status().message()));
        a.info = *info;
        if (a.info.shareable) {
          a.fd = c->take_fd();
          if (a.fd < 0) return kill(c, ProtocolError(c->desc() + " confirmed a shared region without its fd"));
        }
      }
      {
        auto s = c->lock();
        if (!s->abandoned_reqs.empty() && s->abandoned_reqs.front() == h.id) {
          s->abandoned_reqs.pop_front();  // the late answer of a request whose transfer timed out
          if (a.fd >= 0) ::close(a.fd);
          return;
        }
        if (s->pending_req == h.id && !s->answers.count(h.id)) {
          s->answers.emplace(h.id, std::move(a));
          s.notify_all();
          return;
        }
      }
      if (a.fd >= 0) ::close(a.fd);
      return kill(c, ProtocolError(c->desc() + " answered a region request it was not asked"));
    }
    case Ctl::kLeaseResp: {
      bool asked = false;
      {
        auto s = c->lock();
        auto it = s->lease_answers.find(h.id);
        if (it != s->lease_answers.end() && !it->second) {
          it->second = h.status == 0 ? Status::Ok() : Status(status_code_from_wire(h.status), c->frame_aux());
          asked = true;
          s.notify_all();
        }
      }
      if (!asked) return kill(c, ProtocolError(c->desc() + " answered a lease request it was not asked"));
      return;
    }
    case Ctl::kGenResp: {
      GenAnswer a;
      a.done = true;
      if (h.status != 0) {
        a.st = Status(status_code_from_wire(h.status), c->frame_aux());
      } else {
        if (c->frame_aux().size() != kGenRespLen)
          return kill(c, ProtocolError(c->desc() + " sent a generation table answer of " +
                                       std::to_string(c->frame_aux().size()) + " bytes"));
        std::memcpy(&a.n, c->frame_aux().data(), sizeof a.n);  // little-endian hosts only (shm is same-host)
        a.fd = c->take_fd();
        if (a.fd < 0) return kill(c, ProtocolError(c->desc() + " shared a generation table without its fd"));
      }
      {
        auto s = c->lock();
        auto it = s->gen_answers.find(h.id);
        if (it != s->gen_answers.end() && !it->second.done) {
          it->second = std::move(a);
          s.notify_all();
          return;
        }
      }
      if (a.fd >= 0) ::close(a.fd);
      return kill(c, ProtocolError(c->desc() + " answered a generation table request it was not asked"));
    }
    case Ctl::kNotifyAck: {
      std::shared_ptr<Transfer> x;
      {
        auto s = c->lock();
        auto it = s->notifies.find(h.id);
        if (it != s->notifies.end()) {
          if (!it->second.resolved) x = it->second.xfer;  // else: completed when sent
          s->notifies.erase(it);
        }
      }
      if (x) spi::TransferControl(x).resolve_part(0, Status::Ok());
      return;
    }
    case Ctl::kRevoke: {
      std::shared_ptr<RemoteRegion> r;
      {
        auto s = c->lock();
        auto it = s->regions.find(h.id);
        if (it != s->regions.end()) {
          r = it->second;
          s->regions.erase(it);
        }
        if (r || s->pending_req == h.id) s->revoked_ids.insert(h.id);
      }
      if (!r) {
        (void)c->send_frame(Ctl::kRevokeAck, h.id, {});
        return;
      }
      r->revoked = true;
      ack_revoke_when_idle(r);
      return;
    }
    case Ctl::kError:
      return kill(c, Status(status_code_from_wire(h.status), c->desc() + " refused: " + c->frame_aux()));
    default:  // check_ctl_header admits nothing else
      return kill(c, ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc()));
  }
}

void ShmTransport::kill(const std::shared_ptr<ShmConn>& c, const Status& why) {
  std::map<uint64_t, PendingNotify> pend;
  std::map<uint64_t, Lease> leases;  // a dead connection holds no blocks
  if (!c->retire(why, &pend, &leases)) return;
  if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd(), nullptr);
  ::shutdown(c->fd(), SHUT_RDWR);
  size_t lost = 0;
  for (auto& [seq, pn] : pend) {
    if (pn.resolved) ++lost;  // notify_on_send: its transfer completed when it was sent
    else spi::TransferControl(pn.xfer).resolve_part(0, why);
  }
  if (lost) lose_notifications(c, lost, why);
  std::lock_guard<std::mutex> lk(mu_);
  conns_.erase(c.get());
}

void ShmTransport::lose_notifications(const std::shared_ptr<ShmConn>& c, size_t n, const Status& why) {
  unacked_notifs_.fetch_add(n, std::memory_order_relaxed);
  log_refusal(ConnectionError(std::to_string(n) + " notification(s) sent to " + c->desc() +
                              " were never acknowledged (their transfers completed when they were sent, "
                              "ShmOptions.notify_on_send): " + why.to_string()));
}

}  // namespace pdkv::shm
