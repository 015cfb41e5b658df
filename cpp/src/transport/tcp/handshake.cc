#include "transport/tcp/handshake.h"

#include "transport/tcp/frame.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

Result<util::ScopedFd> dial(const util::HostPort& hp, const HelloParams& hello, double timeout_s,
                            std::string* peer_name) {
  const auto deadline = util::deadline_after(timeout_s);
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, util::connect_tcp(hp, timeout_s));
  const std::string body = encode_hello(
      HelloBody{kWireVersion, 0, hello.instance, hello.self_name, hello.target, std::string(hello.secret)});
  FrameHeader h = make_hdr(FrameType::kHello, 0, 0);
  h.aux_len = static_cast<uint32_t>(body.size());
  std::string frame(reinterpret_cast<const char*>(&h), kHdr);
  frame += body;
  const std::string where = hello.target.empty() ? hp.str() : "'" + hello.target + "' at " + hp.str();
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), frame.data(), frame.size(), deadline).with_context("hello to " + where));
  FrameHeader r{};
  PDKV_RETURN_IF_ERROR(
      util::recv_all(fd.get(), &r, kHdr, deadline).with_context("waiting for " + where + " to answer the hello"));
  // The target may be anyone: its answer is checked like any frame before reading on.
  Status valid = check_header(r, ConnState{ConnRole::kOutbound, ConnPhase::kHandshake}, FrameLimits{});
  if (!valid.ok()) return ProtocolError(where + " answered the hello with a bad frame: " + valid.message());
  std::string aux(r.aux_len, '\0');
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), aux.data(), aux.size(), deadline).with_context("handshake with " + where));
  if (r.type == static_cast<uint16_t>(FrameType::kError))
    return Status(status_code_from_wire(r.status), where + " refused the connection: " + aux);
  auto ack = decode_hello_ack(aux);
  if (!ack.ok()) return ProtocolError(where + " sent a malformed hello-ack: " + ack.status().message());
  if (peer_name) *peer_name = ack->name;
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

}  // namespace pdkv::tcp
