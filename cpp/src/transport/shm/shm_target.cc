// ShmTransport as the target of a same-host peer: authenticates its hello (with
// back-off after failures), answers its region requests from the region table as
// it is now (recording which regions it confirmed), grants and ends block leases,
// delivers its notifications, and on deregistration revokes a region at every peer
// that confirmed it. The initiator's side is in shm_transport.cc, remote_region.cc.
#include <sys/epoll.h>
#include <unistd.h>

#include <chrono>

#include "transport/shm/shm_ctl.h"
#include "transport/shm/shm_transport_impl.h"
#include "util/log.h"

namespace pdkv::shm {

void ShmTransport::on_hello(const std::shared_ptr<ShmConn>& c) {
  auto hello = parse_hello(c->aux);
  if (!hello.ok()) {
    const Status& st = hello.status();
    return refuse(c, Status(st.code(), "malformed hello from " + c->desc + ": " + st.message()));
  }
  Status st;
  if (!hooks_->secret_matches(hello->secret)) {
    st = AuthFailed("agent '" + hello->from + "' (" + c->desc + ") presented the wrong secret to agent '" +
                    hooks_->agent_name() + "'");
  } else if (!hello->to.empty() && hello->to != hooks_->agent_name()) {
    st = AuthFailed("this is agent '" + hooks_->agent_name() + "', not '" + hello->to + "'");
  }
  if (!st.ok()) {
    // Back-off: once the failure budget is spent, hold the answer (and the slot).
    const auto delay = throttle_.on_failure(Clock::now());
    log_refusal(st);
    if (delay == Clock::duration::zero()) {
      (void)send_frame(*c, Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
      return kill(c, st);
    }
    if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd, nullptr);
    std::lock_guard<std::mutex> lk(c->mu);
    c->reject_at = Clock::now() + delay;
    c->reject = st;
    return;
  }
  if (hello->expect_instance != 0 && hello->expect_instance != hooks_->instance_id())
    return refuse(c, StalePeer("agent '" + hooks_->agent_name() + "' restarted since its metadata was fetched"));
  {
    std::lock_guard<std::mutex> lk(c->mu);
    c->peer_name = hello->from;
    c->desc = "peer '" + hello->from + "' (" + c->desc + ")";
    c->authed = true;
  }
  HelloAck ack{hooks_->instance_id(), static_cast<uint32_t>(::getpid()), hooks_->agent_name()};
  (void)send_frame(*c, Ctl::kHelloAck, 0, encode_hello_ack(ack));
}

void ShmTransport::handle_inbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h) {
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kRegionReq:
      return answer_region_req(c, h.id);
    case Ctl::kNotify:
      hooks_->deliver_notification(Notification{c->peer_name, c->aux});
      (void)send_frame(*c, Ctl::kNotifyAck, h.id, {});
      return;
    case Ctl::kRevokeAck: {
      std::lock_guard<std::mutex> lk(c->mu);
      c->revoke_acks.insert(h.id);
      c->cv.notify_all();
      return;
    }
    case Ctl::kLeaseReq:
      return answer_lease_req(c, h.id);
    case Ctl::kLeaseEnd: {
      Lease ended;  // unpinned outside c->mu
      {
        std::lock_guard<std::mutex> lk(c->mu);
        auto it = c->leases.find(h.id);
        if (it != c->leases.end()) {
          c->leased_blocks -= it->second.blocks;
          ended = std::move(it->second);
          c->leases.erase(it);
        }
      }
      if (!ended.pin.held())
        return refuse(c, ProtocolError(c->desc + " ended lease " + std::to_string(h.id) + ", which it does not hold"));
      return;
    }
    default:  // check_ctl_header admits nothing else
      return refuse(c, ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc));
  }
}

// Answers from the region table as it is now. The lookup, the record that this
// peer confirmed the region and the answer happen under c->mu, so a concurrent
// deregistration either makes the lookup fail or finds the record (and its revoke
// then follows the answer on the socket).
void ShmTransport::answer_region_req(const std::shared_ptr<ShmConn>& c, uint64_t id) {
  std::lock_guard<std::mutex> lk(c->mu);
  auto d = hooks_->region_table().get(id);
  Status st;
  if (!d.ok() || !d->remote_access)
    st = NotFound("agent '" + hooks_->agent_name() + "' exports no region " + std::to_string(id) +
                  " (deregistered, or never exported); fetch its metadata again");
  else if (d->kind != MemKind::kHost)
    st = NotSupported("region " + std::to_string(id) + " of agent '" + hooks_->agent_name() +
                      "' is device memory; shm reaches host memory only");
  int fd = -1;
  if (st.ok() && d->shareable) {
    auto f = hooks_->region_table().dup_shm_fd(id);
    if (f.ok()) fd = *f; else st = f.status();
  }
  if (!st.ok()) {
    (void)send_frame(*c, Ctl::kRegionResp, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return;
  }
  c->confirmed.insert(id);
  RegionInfo info{d->addr, d->len, d->kind, d->shareable};
  (void)send_frame(*c, Ctl::kRegionResp, id, encode_region_info(info), 0, fd);
  if (fd >= 0) ::close(fd);
}

// Checks the claim against this agent's generations now and pins the blocks until
// the initiator ends the lease (after its copy), the hold time runs out, or the
// connection dies.
void ShmTransport::answer_lease_req(const std::shared_ptr<ShmConn>& c, uint64_t id) {
  auto req = parse_lease_req(c->aux);
  if (!req.ok()) return refuse(c, ProtocolError(c->desc + ": " + req.status().message()), id);
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->leases.count(id))
      return refuse(c, ProtocolError(c->desc + " reused lease id " + std::to_string(id)), id);
  }
  Status st;
  Lease lease;
  lease.blocks = req->claim.blocks.size();
  {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->leases.size() >= kMaxLeasesPerConn || c->leased_blocks + lease.blocks > kMaxLeasedBlocksPerConn)
      st = ResourceExhausted(c->desc + " holds " + std::to_string(c->leases.size()) + " block leases over " +
                             std::to_string(c->leased_blocks) + " blocks already (limits " +
                             std::to_string(kMaxLeasesPerConn) + ", " + std::to_string(kMaxLeasedBlocksPerConn) + ")");
  }
  if (st.ok()) {
    auto pin = hooks_->check_generations(req->claim);
    if (pin.ok()) {
      lease.pin = std::move(pin).value();
      lease.expires = Clock::now() + std::chrono::milliseconds(req->hold_ms) +
                      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kLeaseMarginS));
      std::lock_guard<std::mutex> lk(c->mu);
      c->leased_blocks += lease.blocks;
      c->leases.emplace(id, std::move(lease));
    } else {
      st = pin.status();
    }
  }
  if (!st.ok()) {
    (void)send_frame(*c, Ctl::kLeaseResp, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return;
  }
  wake();  // the lease's hold time is a deadline
  (void)send_frame(*c, Ctl::kLeaseResp, id, {});
}

// Revokes `region` at every peer that confirmed it and waits for their
// acknowledgements (they finish copies in flight first). A peer that does not
// answer within kRevokeTimeoutS (frozen, or stuck) loses its connection: it must
// dial again and re-confirm, which now fails with NotFound.
void ShmTransport::region_removed(const RegionDesc& region) {
  std::vector<std::shared_ptr<ShmConn>> holders;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) {
      if (c->outbound || !c->authed) continue;
      std::lock_guard<std::mutex> lk2(c->mu);
      if (c->confirmed.erase(region.id)) {
        c->revoke_acks.erase(region.id);
        holders.push_back(c);
      }
    }
  }
  std::vector<std::shared_ptr<ShmConn>> told;
  for (auto& c : holders) {
    Status st = send_frame(*c, Ctl::kRevoke, region.id, {});
    if (st.ok()) {
      told.push_back(c);
    } else {
      kill(c, st.with_context("revoking region " + std::to_string(region.id)));
    }
  }
  const auto deadline = util::deadline_after(kRevokeTimeoutS);
  for (auto& c : told) {
    bool acked;
    {
      std::unique_lock<std::mutex> lk(c->mu);
      acked = c->cv.wait_until(lk, deadline, [&] { return c->dead || c->revoke_acks.count(region.id); });
      c->revoke_acks.erase(region.id);
    }
    if (!acked) {
      PDKV_LOG_WARN("shm: %s did not release region %llu within %.0f s; closing its connection", c->desc.c_str(),
                    static_cast<unsigned long long>(region.id), kRevokeTimeoutS);
      kill(c, TimeoutError(c->desc + " did not release region " + std::to_string(region.id) + " within " +
                           std::to_string(int(kRevokeTimeoutS)) + " s"));
    }
  }
}

}  // namespace pdkv::shm
