// The importer's side of cuda_ipc's control handshake: dial the exporter's control
// socket (conn.h dial_ctl), prove the cluster secret (pdkv/spi/auth.h
// challenge-response: kHello, kChallenge, kProof, kHelloAck; wire.h) and keep the
// authenticated connection for revocations. The exporter's side is on_ctl_frame
// (progress.cc).
//
// Thread safety: ctl_to may be called from any posting thread; it takes mu_ itself.
#include "transport/cuda_ipc/cuda_ipc_transport_impl.h"
#include "util/log.h"

namespace pdkv::cuda_ipc {

Result<std::shared_ptr<CtlConn>> CudaIpcTransport::ctl_to(const Peer& peer, const std::string& path,
                                                          Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& c : ctl_)
      if (c->outbound && c->peer == peer.md.name && c->peer_instance == peer.md.instance_id && !c->dead) return c;
  }
  auto fd = dial_ctl(path, deadline);
  if (!fd.ok())
    return Status(fd.status().code(), "cuda_ipc control connection to peer '" + peer.md.name + "': " +
                                          fd.status().message());
  auto c = std::make_shared<CtlConn>(std::move(fd).value(), true);
  c->peer = peer.md.name;
  c->peer_instance = peer.md.instance_id;
  const std::string where = "peer '" + peer.md.name + "' (cuda_ipc control " + path + ")";
  PDKV_ASSIGN_OR_RETURN(auth::InitiatorHandshake hs,
                        auth::InitiatorHandshake::begin("cuda_ipc", kCtlVersion, hooks_->agent_name()));
  PDKV_RETURN_IF_ERROR(
      send_ctl(*c, Ctl::kHello, 0,
               encode_hello(Hello{kCtlVersion, peer.md.instance_id, hooks_->agent_name(), hs.nonce(), hs.pub()}))
          .with_context("hello to " + where));
  // The exporter's next handshake frame, checked before its aux is read.
  auto next = [&](Ctl want, std::string* aux) -> Status {
    CtlHdr r{};
    PDKV_RETURN_IF_ERROR(util::recv_all(c->fd.get(), &r, sizeof r, deadline).with_context("handshake with " + where));
    PDKV_RETURN_IF_ERROR(check_ctl_header(r, CtlSide::kImporterHello).with_context("handshake with " + where));
    aux->assign(r.aux_len, '\0');  // bounded by check_ctl_header
    PDKV_RETURN_IF_ERROR(
        util::recv_all(c->fd.get(), aux->data(), aux->size(), deadline).with_context("handshake with " + where));
    if (r.type == static_cast<uint16_t>(Ctl::kError))
      return Status(status_code_from_wire(r.status), where + " refused the connection: " + *aux);
    if (r.type != static_cast<uint16_t>(want)) return ProtocolError(where + " answered the handshake out of order");
    return Status::Ok();
  };
  std::string aux;
  PDKV_RETURN_IF_ERROR(next(Ctl::kChallenge, &aux));
  PDKV_ASSIGN_OR_RETURN(Challenge ch, parse_challenge(aux));
  if (ch.instance != peer.md.instance_id || ch.name != peer.md.name)
    return StalePeer(where + " is agent '" + ch.name + "' instance " + std::to_string(ch.instance) +
                     ", not the one in its metadata (restarted?)");
  auth::Mac proof{};
  PDKV_RETURN_IF_ERROR(
      hs.answer(ch.name, ch.instance, ch.nonce, ch.pub, auth::derive_key(peer.secret), &proof).with_context(where));
  PDKV_RETURN_IF_ERROR(send_ctl(*c, Ctl::kProof, 0, encode_mac(proof)).with_context("proof to " + where));
  PDKV_RETURN_IF_ERROR(next(Ctl::kHelloAck, &aux));
  PDKV_ASSIGN_OR_RETURN(auth::Mac ack, parse_mac(aux));
  PDKV_RETURN_IF_ERROR(hs.check_accept(ack).with_context(where));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(c->fd.get(), true));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return ConnectionError("agent is shutting down");
    c->authed = true;
    // Another thread may have dialed concurrently: keep one.
    for (auto& o : ctl_)
      if (o->outbound && o->peer == c->peer && o->peer_instance == c->peer_instance && !o->dead) return o;
    ctl_.push_back(c);
  }
  wake_ctl();
  return c;
}

}  // namespace pdkv::cuda_ipc
