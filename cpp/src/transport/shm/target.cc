// ShmTransport as the target of a same-host peer: authenticates its hello (with
// back-off after failures), answers its region requests from the region table as
// it is now (recording which regions it confirmed), grants and ends block leases,
// delivers its notifications, and on deregistration revokes a region at every peer
// that confirmed it. The initiator's side is in shm_transport.cc, progress.cc, remote_region.cc.
#include <sys/epoll.h>
#include <unistd.h>

#include <chrono>

#include "pdkv/metadata.h"
#include "transport/shm/wire.h"
#include "util/bytes.h"
#include "transport/shm/shm_transport_impl.h"
#include "util/log.h"

namespace pdkv::shm {

void ShmTransport::on_hello(const std::shared_ptr<ShmConn>& c) {
  auto hello = parse_hello(c->frame_aux());
  if (!hello.ok()) {
    const Status& st = hello.status();
    return refuse(c, Status(st.code(), "malformed hello from " + c->desc() + ": " + st.message()));
  }
  if (!hello->to.empty() && hello->to != hooks_->agent_name())
    return refuse_auth(c, AuthFailed("this is agent '" + hooks_->agent_name() + "', not '" + hello->to + "'"));
  if (hello->expect_instance != 0 && hello->expect_instance != hooks_->instance_id())
    return refuse(c, StalePeer("agent '" + hooks_->agent_name() + "' restarted since its metadata was fetched"));
  // The initiator proves first (on_proof); we prove ourselves only after that, so a
  // process without the secret learns nothing from us.
  auto hs = auth::TargetHandshake::begin("shm", kShmVersion, hello->from, hooks_->agent_name(),
                                         hooks_->instance_id(), hello->nonce, hello->pub);
  if (!hs.ok()) return refuse(c, hs.status().with_context("handshake with " + c->desc()));
  const std::string body =
      encode_challenge(Challenge{hooks_->instance_id(), hooks_->agent_name(), hs->nonce(), hs->pub()});
  c->handshake() = std::make_unique<auth::TargetHandshake>(std::move(hs).value());
  (void)c->send_frame(Ctl::kChallenge, 0, body);
}

void ShmTransport::on_proof(const std::shared_ptr<ShmConn>& c) {
  std::unique_ptr<auth::TargetHandshake> hs = std::move(c->handshake());
  auto proof = parse_proof(c->frame_aux());
  if (!proof.ok() || !hs) return refuse(c, ProtocolError("malformed proof from " + c->desc()));
  auth::Mac mac{};
  auto matched = hs->check(*proof, hooks_->accepted_keys(), &mac);
  if (!matched.ok())
    return refuse_auth(c, Status(matched.status().code(), matched.status().message() + " (" + c->desc() + ")"));
  c->authenticate(hs->initiator());
  HelloAck ack{hooks_->instance_id(), static_cast<uint32_t>(::getpid()), hooks_->agent_name(), mac};
  (void)c->send_frame(Ctl::kHelloAck, 0, encode_hello_ack(ack));
}

void ShmTransport::refuse_auth(const std::shared_ptr<ShmConn>& c, const Status& st) {
  // Back-off: once the failure budget is spent, hold the answer (and the slot).
  const auto delay = throttle_.on_failure(Clock::now());
  log_refusal(st);
  if (delay == Clock::duration::zero()) {
    (void)c->send_frame(Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return kill(c, st);
  }
  if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd(), nullptr);
  auto s = c->lock();
  s->reject_at = Clock::now() + delay;
  s->reject = st;
}

void ShmTransport::handle_inbound(const std::shared_ptr<ShmConn>& c, const CtlHdr& h) {
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kRegionReq:
      return answer_region_req(c, h.id);
    case Ctl::kNotify: {
      // Refused by a full queue (issue 26): the sender's notification fails with it.
      Status taken = hooks_->deliver_notification(Notification{c->peer_name(), c->frame_aux()});
      if (!taken.ok()) return refuse(c, taken, h.id);
      (void)c->send_frame(Ctl::kNotifyAck, h.id, {});
      return;
    }
    case Ctl::kRevokeAck: {
      bool asked;
      {
        auto s = c->lock();
        asked = s->revoking.erase(h.id) > 0;
        if (asked) {
          s->revoke_acks.insert(h.id);
          s.notify_all();
        }
      }
      if (!asked)
        return refuse(c, ProtocolError(c->desc() + " acknowledged the revocation of region " + std::to_string(h.id) +
                                       ", which was not revoked at it"),
                      h.id);
      return;
    }
    case Ctl::kLeaseReq:
      return answer_lease_req(c, h.id);
    case Ctl::kGenReq:
      return answer_gen_req(c, h.id);
    case Ctl::kLeaseEnd: {
      Lease ended;  // unpinned outside c's lock
      {
        auto s = c->lock();
        auto it = s->leases.find(h.id);
        if (it != s->leases.end()) {
          s->leased_blocks -= it->second.blocks;
          ended = std::move(it->second);
          s->leases.erase(it);
        }
      }
      if (!ended.pin.held())
        return refuse(c, ProtocolError(c->desc() + " ended lease " + std::to_string(h.id) + ", which it does not hold"));
      return;
    }
    default:  // check_ctl_header admits nothing else
      return refuse(c, ProtocolError("unexpected frame type " + std::to_string(h.type) + " from " + c->desc()));
  }
}

// Answers from the region table as it is now. The lookup, the record that this
// peer confirmed the region and the answer happen under c's lock, so a concurrent
// deregistration either makes the lookup fail or finds the record (and its revoke
// then follows the answer on the socket).
void ShmTransport::answer_region_req(const std::shared_ptr<ShmConn>& c, uint64_t id) {
  auto s = c->lock();
  auto d = hooks_->region_table().get(id);
  Status st;
  if (!d.ok() || !d->remote_access)
    st = NotFound("agent '" + hooks_->agent_name() + "' exports no region " + std::to_string(id) +
                  " (deregistered, or never exported); fetch its metadata again");
  else if (d->kind != MemKind::kHost)
    st = NotSupported("region " + std::to_string(id) + " of agent '" + hooks_->agent_name() +
                      "' is device memory; shm reaches host memory only");
  int fd = -1;
  if (st.ok() && d->shared_len > 0) {
    auto f = hooks_->region_table().dup_shm_fd(id);
    if (f.ok()) fd = *f; else st = f.status();
  }
  if (!st.ok()) {
    (void)c->send_frame(Ctl::kRegionResp, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return;
  }
  s->confirmed.insert(id);
  RegionInfo info{d->addr, d->len, d->kind, d->shared_len > 0, d->shared_offset, d->shared_len};
  (void)c->send_frame(Ctl::kRegionResp, id, encode_region_info(info), 0, fd);
  if (fd >= 0) ::close(fd);
}

// Shares the layout's published generation table: its memfd, sealed, mapped
// read-only by the peer (docs/wire-shm.md "Shared generation tables"). Nothing is
// recorded: the table only grows stale (all 0) when the layout is removed.
void ShmTransport::answer_gen_req(const std::shared_ptr<ShmConn>& c, uint64_t id) {
  const std::string name = c->frame_aux();
  Status v = validate_name("generation table layout name", name);
  if (!v.ok()) return refuse(c, ProtocolError(c->desc() + ": " + v.message()), id);
  uint32_t n = 0;
  auto fd = hooks_->share_generations(name, &n);
  if (!fd.ok()) {
    const Status& st = fd.status();
    (void)c->send_frame(Ctl::kGenResp, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return;
  }
  util::ByteWriter w;
  w.put<uint32_t>(n);
  (void)c->send_frame(Ctl::kGenResp, id, w.take(), 0, *fd);
  ::close(*fd);
}

// Checks the claim against this agent's generations now and pins the blocks until
// the initiator ends the lease (after its copy), the hold time runs out, or the
// connection dies.
void ShmTransport::answer_lease_req(const std::shared_ptr<ShmConn>& c, uint64_t id) {
  auto req = parse_lease_req(c->frame_aux());
  if (!req.ok()) return refuse(c, ProtocolError(c->desc() + ": " + req.status().message()), id);
  // refuse() kills the connection, which takes its lock: decide, then refuse.
  if (c->lock()->leases.count(id))
    return refuse(c, ProtocolError(c->desc() + " reused lease id " + std::to_string(id)), id);
  Status st;
  Lease lease;
  lease.blocks = req->claim.blocks.size();
  {
    auto s = c->lock();
    if (s->leases.size() >= kMaxLeasesPerConn || s->leased_blocks + lease.blocks > kMaxLeasedBlocksPerConn)
      st = ResourceExhausted(c->desc() + " holds " + std::to_string(s->leases.size()) + " block leases over " +
                             std::to_string(s->leased_blocks) + " blocks already (limits " +
                             std::to_string(kMaxLeasesPerConn) + ", " + std::to_string(kMaxLeasedBlocksPerConn) + ")");
  }
  if (st.ok()) {
    auto pin = hooks_->check_generations(req->claim);
    if (pin.ok()) {
      lease.pin = std::move(pin).value();
      lease.expires = Clock::now() + std::chrono::milliseconds(req->hold_ms) +
                      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kLeaseMarginS));
      auto s = c->lock();
      s->leased_blocks += lease.blocks;
      s->leases.emplace(id, std::move(lease));
    } else {
      st = pin.status();
    }
  }
  if (!st.ok()) {
    (void)c->send_frame(Ctl::kLeaseResp, id, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
    return;
  }
  wake();  // the lease's hold time is a deadline
  (void)c->send_frame(Ctl::kLeaseResp, id, {});
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
      if (c->outbound() || !c->authed()) continue;
      auto s = c->lock();
      if (s->confirmed.erase(region.id)) {
        s->revoke_acks.erase(region.id);
        s->revoking.insert(region.id);  // before the Revoke is sent: its ack may come at once
        holders.push_back(c);
      }
    }
  }
  std::vector<std::shared_ptr<ShmConn>> told;
  for (auto& c : holders) {
    Status st = c->send_frame(Ctl::kRevoke, region.id, {});
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
      auto s = c->lock();
      acked = s.wait_until(deadline, [&] { return s->dead || s->revoke_acks.count(region.id); });
      s->revoke_acks.erase(region.id);
      s->revoking.erase(region.id);
    }
    if (!acked) {
      PDKV_LOG_WARN("shm: %s did not release region %llu within %.0f s; closing its connection", c->desc().c_str(),
                    static_cast<unsigned long long>(region.id), kRevokeTimeoutS);
      kill(c, TimeoutError(c->desc() + " did not release region " + std::to_string(region.id) + " within " +
                           std::to_string(int(kRevokeTimeoutS)) + " s"));
    }
  }
}

}  // namespace pdkv::shm
