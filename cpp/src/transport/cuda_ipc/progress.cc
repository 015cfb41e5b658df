// CudaIpcTransport's two threads: the completion thread (waits on each copy's event,
// resolves the transfer, relays its notification), and the control thread (accepts
// importers, reads and answers control frames, enforces the handshake and frame
// deadlines), with revocation: on deregistration an exporter sends kRevoke to every
// importer and waits for the acknowledgements; an importer releases a mapping once no
// copy uses it (cuda_ipc_transport.cc has the overview).
//
// Thread safety: complete_loop and ctl_loop (and what they call) run on their own
// threads; region_removed on the deregistering thread; shared state under mu_.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/cuda_ipc/cuda_ipc_transport_impl.h"
#include "util/log.h"
#include "util/thread_name.h"

namespace pdkv::cuda_ipc {

void CudaIpcTransport::complete_loop() {
  util::name_this_thread("pdkv-ipc-done");
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    // Copies on one stream complete in order, so waiting FIFO is exact.
    Status st = drv_->check(drv_->cuEventSynchronize(p.event), "cuEventSynchronize");
    drv_->cuEventDestroy(p.event);
    if (st.ok()) st = p.err;
    for (const auto& o : p.mapped->opened)
      if (o->inflight.fetch_sub(1) == 1) maybe_release(o);
    spi::TransferControl(p.xfer).resolve_part(st.ok() ? p.mapped->total : 0, st);
    if (p.notif.empty()) continue;
    if (!st.ok()) {
      spi::TransferControl(p.xfer).resolve_part(0, Cancelled("notification not sent: the copy failed"));
      continue;
    }
    hooks_->relay_notification(p.peer, p.xfer, std::move(p.notif), this);
  }
}

// ---------------------------------------------------------------- control channel

void CudaIpcTransport::region_removed(const RegionDesc& region) {
  if (region.kind != MemKind::kCuda || !region.remote_access) return;
  std::vector<std::shared_ptr<CtlConn>> importers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    exported_cache_.erase(region.id);
    for (auto& c : ctl_)
      if (!c->outbound && c->authed && !c->dead) {
        c->acks.erase(region.id);
        importers.push_back(c);
      }
  }
  std::vector<std::shared_ptr<CtlConn>> told;
  for (auto& c : importers)
    if (send_ctl(*c, Ctl::kRevoke, region.id).ok()) told.push_back(c);
  const auto deadline = util::deadline_after(kRevokeTimeoutS);
  std::unique_lock<std::mutex> lk(mu_);
  for (auto& c : told) {
    if (!ctl_cv_.wait_until(lk, deadline, [&] { return stop_ || c->dead || c->acks.count(region.id); })) {
      PDKV_LOG_WARN("cuda_ipc: peer '%s' did not release region %llu within %.0f s; deregistering anyway",
                    c->peer.c_str(), static_cast<unsigned long long>(region.id), kRevokeTimeoutS);
    }
    c->acks.erase(region.id);
  }
}

void CudaIpcTransport::maybe_release(const std::shared_ptr<Opened>& o) {
  if (!o->revoked.load() || o->inflight.load() != 0 || o->released.exchange(true)) return;
  o->close();
  if (auto c = o->ctl.lock()) {
    Status st = send_ctl(*c, Ctl::kRevokeAck, o->region);
    if (!st.ok()) PDKV_LOG_DEBUG("cuda_ipc: revoke ack to '%s' failed: %s", o->peer.c_str(), st.to_string().c_str());
  }
}

void CudaIpcTransport::on_revoke(const std::shared_ptr<CtlConn>& c, uint64_t region) {
  std::shared_ptr<Opened> o;
  {
    std::lock_guard<std::mutex> lk(mu_);
    revoked_.insert({c->peer_instance, region});
    auto it = opened_.find({c->peer, {c->peer_instance, region}});
    if (it != opened_.end()) {
      o = it->second;
      opened_.erase(it);
    }
  }
  if (!o) {
    (void)send_ctl(*c, Ctl::kRevokeAck, region);  // never mapped here
    return;
  }
  o->revoked.store(true);
  maybe_release(o);  // at once, or when the last copy in flight completes
}
void CudaIpcTransport::ctl_loop() {
  util::name_this_thread("pdkv-ipc-ctl");
  std::vector<pollfd> pfds;
  std::vector<std::shared_ptr<CtlConn>> conns;
  for (;;) {
    pfds.clear();
    conns.clear();
    bool handshaking = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      for (auto& c : ctl_) {
        conns.push_back(c);
        handshaking |= !c->authed || c->frame_deadline != Clock::time_point::max();
      }
    }
    pfds.push_back({evfd_, POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (auto& c : conns) {
      std::lock_guard<std::mutex> lk(mu_);
      // A held-back refusal is not read any more; its fd stays in the set, unpolled.
      pfds.push_back({c->fd.get(), static_cast<short>(c->reject_at == Clock::time_point::max() ? POLLIN | POLLRDHUP : 0), 0});
    }
    const int n = ::poll(pfds.data(), pfds.size(), handshaking ? 200 : -1);
    if (n < 0 && errno != EINTR) {
      PDKV_LOG_ERROR("cuda_ipc: poll: %s", util::errno_str(errno).c_str());
      return;
    }
    if (pfds[0].revents) {
      uint64_t v;
      if (::read(evfd_, &v, sizeof v) < 0) {
      }
    }
    if (pfds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          break;
        }
        auto c = std::make_shared<CtlConn>(util::ScopedFd(fd), false);
        c->hs_deadline = util::deadline_after(kCtlTimeoutS);
        std::lock_guard<std::mutex> lk(mu_);
        size_t pending = 0;
        for (auto& o : ctl_) pending += !o->outbound && !o->authed;
        if (pending >= kMaxPendingConns) {
          log_refusal(ResourceExhausted(std::to_string(kMaxPendingConns) + " control connections are already handshaking"));
          continue;  // c closes its fd
        }
        ctl_.push_back(c);
      }
    }
    for (size_t i = 0; i < conns.size(); ++i)
      if (pfds[i + 2].revents) on_ctl_readable(conns[i]);
    check_ctl_deadlines(conns);
  }
}

// Handshakes, frames started and not finished, refusals held back.
void CudaIpcTransport::check_ctl_deadlines(const std::vector<std::shared_ptr<CtlConn>>& conns) {
  const auto now = Clock::now();
  for (auto& c : conns) {
    Status why;
    bool answer = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (c->dead) continue;
      if (c->reject_at != Clock::time_point::max()) {
        if (now < c->reject_at) continue;
        why = c->reject;
        answer = true;
      } else if (!c->authed && now >= c->hs_deadline) {
        why = TimeoutError("a control connection did not complete its hello in time");
      } else if (now >= c->frame_deadline) {
        why = TimeoutError("a control frame from '" + c->peer + "' stalled mid-frame");
      } else {
        continue;
      }
    }
    if (answer) (void)send_ctl(*c, Ctl::kError, 0, why.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(why.code()));
    log_refusal(why);
    ctl_closed(c);
  }
}

void CudaIpcTransport::on_ctl_readable(const std::shared_ptr<CtlConn>& c) {
  for (;;) {
    ssize_t r;
    if (c->hdr_got < sizeof c->hdr) {
      r = ::recv(c->fd.get(), reinterpret_cast<char*>(&c->hdr) + c->hdr_got, sizeof c->hdr - c->hdr_got,
                 MSG_DONTWAIT);
      if (r > 0) {
        if (c->hdr_got == 0) {
          std::lock_guard<std::mutex> lk(mu_);
          c->frame_deadline = util::deadline_after(kCtlTimeoutS);
        }
        c->hdr_got += static_cast<size_t>(r);
        if (c->hdr_got < sizeof c->hdr) continue;
        bool authed;
        {
          std::lock_guard<std::mutex> lk(mu_);
          authed = c->authed;
        }
        const CtlSide side = c->outbound ? CtlSide::kImporter
                             : authed    ? CtlSide::kExporter
                             : c->hs     ? CtlSide::kExporterProof
                                         : CtlSide::kExporterPreHello;
        Status st = check_ctl_header(c->hdr, side);
        if (!st.ok()) {
          // Garbage (bad magic) and oversized frames are dropped without an answer, as before.
          if (!c->outbound && c->hdr.magic == kCtlMagic && c->hdr.aux_len <= kMaxHelloAux)
            (void)send_ctl(*c, Ctl::kError, 0, st.message(), static_cast<uint32_t>(StatusCode::kProtocolError));
          log_refusal(st.with_context(c->peer.empty() ? "an unauthenticated client" : "'" + c->peer + "'"));
          return ctl_closed(c);
        }
        c->aux.assign(c->hdr.aux_len, '\0');  // bounded by check_ctl_header
        c->aux_got = 0;
        if (c->hdr.aux_len > 0) continue;
      }
    } else {
      r = ::recv(c->fd.get(), c->aux.data() + c->aux_got, c->aux.size() - c->aux_got, MSG_DONTWAIT);
      if (r > 0) c->aux_got += static_cast<size_t>(r);
    }
    if (c->hdr_got == sizeof c->hdr && c->aux_got == c->aux.size()) {
      c->hdr_got = 0;
      {
        std::lock_guard<std::mutex> lk(mu_);
        c->frame_deadline = Clock::time_point::max();
      }
      if (!on_ctl_frame(c)) return ctl_closed(c);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (c->reject_at != Clock::time_point::max()) return;  // answer held back; not read any more
      }
      continue;
    }
    if (r == 0) return ctl_closed(c);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return ctl_closed(c);
  }
}

bool CudaIpcTransport::on_ctl_frame(const std::shared_ptr<CtlConn>& c) {
  const CtlHdr h = c->hdr;
  const auto type = static_cast<Ctl>(h.type);
  bool authed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    authed = c->authed;
  }
  if (!c->outbound && !authed) {
    auto refuse = [&](const Status& st) {
      log_refusal(st);
      (void)send_ctl(*c, Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
      return false;
    };
    auto refuse_auth = [&](const Status& st) {
      const auto delay = throttle_.on_failure(Clock::now());
      if (delay == Clock::duration::zero()) return refuse(st);
      log_refusal(st);
      std::lock_guard<std::mutex> lk(mu_);
      c->reject_at = Clock::now() + delay;  // answered (and closed) by check_ctl_deadlines
      c->reject = st;
      return true;
    };
    if (type == Ctl::kProof) {  // check_ctl_header admitted only a proof after our challenge
      std::unique_ptr<auth::TargetHandshake> hs = std::move(c->hs);
      auto proof = parse_mac(c->aux);
      if (!proof.ok()) return refuse(ProtocolError("malformed proof: " + proof.status().message()));
      auth::Mac ack{};
      auto matched = hs->check(*proof, hooks_->accepted_keys(), &ack);
      if (!matched.ok()) return refuse_auth(matched.status());
      {
        std::lock_guard<std::mutex> lk(mu_);
        c->peer = hs->initiator();
        c->authed = true;
      }
      return send_ctl(*c, Ctl::kHelloAck, 0, encode_mac(ack)).ok();
    }
    auto hello = parse_hello(c->aux);  // check_ctl_header admitted only a hello
    if (!hello.ok())
      return refuse(Status(hello.status().code(), "malformed hello: " + hello.status().message()));
    if (hello->expect_instance != hooks_->instance_id())
      return refuse(StalePeer("agent '" + hooks_->agent_name() + "' restarted since its metadata was fetched"));
    // The importer proves first; we prove ourselves only after its proof checked.
    auto hs = auth::TargetHandshake::begin("cuda_ipc", kCtlVersion, hello->from, hooks_->agent_name(),
                                           hooks_->instance_id(), hello->nonce, hello->pub);
    if (!hs.ok()) return refuse(hs.status());
    const std::string body =
        encode_challenge(Challenge{hooks_->instance_id(), hooks_->agent_name(), hs->nonce(), hs->pub()});
    c->hs = std::make_unique<auth::TargetHandshake>(std::move(hs).value());
    return send_ctl(*c, Ctl::kChallenge, 0, body).ok();
  }
  switch (type) {
    case Ctl::kRevoke:
      if (!c->outbound) return false;
      on_revoke(c, h.id);
      return true;
    case Ctl::kRevokeAck: {
      if (c->outbound) return false;
      std::lock_guard<std::mutex> lk(mu_);
      c->acks.insert(h.id);
      ctl_cv_.notify_all();
      return true;
    }
    default:
      PDKV_LOG_WARN("cuda_ipc: unexpected control frame type %u from '%s'; closing", h.type, c->peer.c_str());
      return false;
  }
}

void CudaIpcTransport::ctl_closed(const std::shared_ptr<CtlConn>& c) {
  std::vector<std::shared_ptr<Opened>> orphaned;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (c->dead) return;
    c->dead = true;
    ctl_.erase(std::remove(ctl_.begin(), ctl_.end(), c), ctl_.end());
    ctl_cv_.notify_all();
    if (c->outbound) {
      // The exporter is gone (or dropped): its mappings must not be written any more.
      for (auto it = opened_.begin(); it != opened_.end();) {
        if (it->first.first == c->peer && it->first.second.first == c->peer_instance) {
          orphaned.push_back(it->second);
          it = opened_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  for (auto& o : orphaned) o->gone.store(true);
  ::shutdown(c->fd.get(), SHUT_RDWR);
}

}  // namespace pdkv::cuda_ipc
