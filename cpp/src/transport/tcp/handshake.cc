#include "transport/tcp/handshake.h"

#include "transport/tcp/out_msg.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {
namespace {

// One handshake frame: header + aux.
std::string frame_of(FrameType type, const std::string& aux) {
  FrameHeader h = make_hdr(type, 0, 0);
  h.aux_len = static_cast<uint32_t>(aux.size());
  std::string frame(reinterpret_cast<const char*>(&h), kHdr);
  frame += aux;
  return frame;
}

// Reads the target's next handshake frame (checked before its aux is read). A kError
// becomes its status; otherwise *type and *aux.
Status read_reply(int fd, const std::string& where, const char* waiting_for,
                  std::chrono::steady_clock::time_point deadline, FrameType* type, std::string* aux) {
  FrameHeader r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd, &r, kHdr, deadline).with_context(std::string("waiting for ") + where + " " +
                                                                              waiting_for));
  // The target may be anyone: its answer is checked like any frame before reading on.
  Status valid = check_header(r, ConnState{ConnRole::kOutbound, ConnPhase::kHandshake}, FrameLimits{});
  if (!valid.ok()) return ProtocolError(where + " answered the handshake with a bad frame: " + valid.message());
  aux->assign(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(util::recv_all(fd, aux->data(), aux->size(), deadline).with_context("handshake with " + where));
  if (r.type == static_cast<uint16_t>(FrameType::kError))
    return Status(status_code_from_wire(r.status), where + " refused the connection: " + *aux);
  *type = static_cast<FrameType>(r.type);
  return Status::Ok();
}

}  // namespace

Result<util::ScopedFd> dial(const util::HostPort& hp, const HelloParams& hello, double timeout_s,
                            std::string* peer_name, std::shared_ptr<TlsChannel>* channel) {
  const auto deadline = util::deadline_after(timeout_s);
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, util::connect_tcp(hp, timeout_s));
  PDKV_RETURN_IF_ERROR(util::set_congestion_control(fd.get(), hello.congestion_control));
  const std::string where = hello.target.empty() ? hp.str() : "'" + hello.target + "' at " + hp.str();
  auth::ChannelBinding binding{};
  std::shared_ptr<TlsChannel> tls;
  if (hello.tls) {  // the handshake below runs inside the session, bound to it
    util::ScopedFd plain;
    PDKV_ASSIGN_OR_RETURN(tls, TlsChannel::connect(hello.tls, std::move(fd), deadline, where, &plain));
    fd = std::move(plain);
    binding = tls->binding();
  }
  PDKV_ASSIGN_OR_RETURN(auth::InitiatorHandshake hs,
                        auth::InitiatorHandshake::begin("tcp", kWireVersion, hello.self_name, binding));
  HelloBody hb{kWireVersion, 0, hello.instance, hello.self_name, hello.target, hs.nonce(), hs.pub()};
  const std::string h = frame_of(FrameType::kHello, encode_hello(hb));
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), h.data(), h.size(), deadline).with_context("hello to " + where));

  FrameType type{};
  std::string aux;
  PDKV_RETURN_IF_ERROR(read_reply(fd.get(), where, "to answer the hello", deadline, &type, &aux));
  if (type != FrameType::kChallenge)
    return ProtocolError(where + " answered the hello with a " + frame_type_name(static_cast<uint16_t>(type)) +
                         " frame instead of a challenge");
  auto ch = decode_challenge(aux);
  if (!ch.ok()) return ProtocolError(where + " sent a malformed challenge: " + ch.status().message());
  // Whom we reached, before proving anything to it.
  if (!hello.target.empty() && ch->name != hello.target)
    return ProtocolError("agent '" + ch->name + "' answered at the address of '" + hello.target + "' (" + hp.str() +
                         ")");
  if (hello.instance != 0 && ch->instance != hello.instance)
    return StalePeer("agent '" + ch->name + "' restarted since its metadata was fetched; fetch it again and re-add the peer");
  auth::Mac proof{};
  PDKV_RETURN_IF_ERROR(
      hs.answer(ch->name, ch->instance, ch->nonce, ch->pub, hello.key, &proof).with_context("handshake with " + where));
  const std::string p = frame_of(FrameType::kProof, encode_mac(proof));
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), p.data(), p.size(), deadline).with_context("proof to " + where));

  PDKV_RETURN_IF_ERROR(read_reply(fd.get(), where, "to accept the proof", deadline, &type, &aux));
  if (type != FrameType::kHelloAck)
    return ProtocolError(where + " answered the proof with a " + frame_type_name(static_cast<uint16_t>(type)) +
                         " frame instead of a hello-ack");
  auto mac = decode_mac(aux, "hello-ack MAC");
  if (!mac.ok()) return ProtocolError(where + " sent a malformed hello-ack: " + mac.status().message());
  PDKV_RETURN_IF_ERROR(hs.check_accept(*mac).with_context(hp.str()));
  if (peer_name) *peer_name = ch->name;
  if (channel) *channel = std::move(tls);
  return fd;
}

Result<std::string> request_metadata(int fd, const std::string& address,
                                     std::chrono::steady_clock::time_point deadline) {
  FrameHeader h = make_hdr(FrameType::kMetaReq, 0, 0);
  PDKV_RETURN_IF_ERROR(util::send_all(fd, &h, kHdr, deadline));
  FrameHeader r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd, &r, kHdr, deadline).with_context("fetching metadata from " + address));
  Status valid = check_header(r, ConnState{ConnRole::kOutbound, ConnPhase::kMetaWait}, FrameLimits{});
  if (!valid.ok()) return ProtocolError(address + " answered the metadata request with a bad frame: " + valid.message());
  std::string blob(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(
      util::recv_all(fd, blob.data(), blob.size(), deadline).with_context("fetching metadata from " + address));
  if (r.type == static_cast<uint16_t>(FrameType::kError))
    return Status(status_code_from_wire(r.status), address + " refused the metadata request: " + blob);
  return blob;
}

Result<auth::TargetHandshake> begin_challenge(const HelloBody& hello, const std::string& self_name,
                                              uint64_t self_instance, std::string* challenge,
                                              const auth::ChannelBinding& binding) {
  PDKV_ASSIGN_OR_RETURN(auth::TargetHandshake hs,
                        auth::TargetHandshake::begin("tcp", kWireVersion, hello.from, self_name, self_instance,
                                                     hello.nonce, hello.pub, binding));
  *challenge = encode_challenge(ChallengeBody{self_instance, self_name, hs.nonce(), hs.pub()});
  return hs;
}

}  // namespace pdkv::tcp
