#include "transport/cuda_ipc/wire.h"

#include "pdkv/metadata.h"
#include "util/bytes.h"

namespace pdkv::cuda_ipc {
namespace {

// Largest aux for `type` on `side`; -1: not allowed there.
int64_t aux_limit(Ctl type, CtlSide side) {
  switch (side) {
    case CtlSide::kExporterPreHello: return type == Ctl::kHello ? int64_t{kMaxHelloAux} : -1;
    case CtlSide::kExporterProof: return type == Ctl::kProof ? int64_t{auth::kMacBytes} : -1;
    case CtlSide::kExporter: return type == Ctl::kRevokeAck ? 0 : -1;
    case CtlSide::kImporterHello:
      return type == Ctl::kChallenge ? int64_t{kMaxHelloAux}
             : type == Ctl::kHelloAck ? int64_t{auth::kMacBytes}
             : type == Ctl::kError    ? int64_t{kMaxErrorAux}
                                      : -1;
    case CtlSide::kImporter: return type == Ctl::kRevoke ? 0 : type == Ctl::kError ? int64_t{kMaxErrorAux} : -1;
  }
  return -1;
}

}  // namespace

Status check_ctl_header(const CtlHdr& h, CtlSide side) {
  if (h.magic != kCtlMagic) return ProtocolError("bad cuda_ipc control frame magic " + std::to_string(h.magic));
  if (h.reserved != 0) return ProtocolError("cuda_ipc control frame reserved field is not 0");
  const int64_t limit = aux_limit(static_cast<Ctl>(h.type), side);
  if (limit < 0) {
    if (side == CtlSide::kExporterPreHello) return ProtocolError("the first control frame must be a hello");
    return ProtocolError("unexpected cuda_ipc control frame type " + std::to_string(h.type));
  }
  if (h.aux_len > limit)
    return ProtocolError("cuda_ipc control frame type " + std::to_string(h.type) + " declares " +
                         std::to_string(h.aux_len) + " aux bytes (limit " + std::to_string(limit) + ")");
  if (h.status != 0 && static_cast<Ctl>(h.type) != Ctl::kError)
    return ProtocolError("cuda_ipc control frame type " + std::to_string(h.type) + " carries a status");
  return Status::Ok();
}

std::string encode_hello(const Hello& h) {
  util::ByteWriter w;
  w.put<uint16_t>(h.version);
  w.put<uint64_t>(h.expect_instance);
  w.put_str(h.from);
  w.put_raw(h.nonce.data(), h.nonce.size());
  w.put_raw(h.pub.data(), h.pub.size());
  return w.take();
}

Result<Hello> parse_hello(std::string_view aux) {
  util::ByteReader r(aux);
  Hello h;
  PDKV_RETURN_IF_ERROR(r.get(&h.version, "version"));
  if (h.version != kCtlVersion)
    return VersionMismatch("cuda_ipc control version " + std::to_string(h.version) + " is not supported");
  PDKV_RETURN_IF_ERROR(r.get(&h.expect_instance, "instance"));
  PDKV_RETURN_IF_ERROR(r.get_str(&h.from, "from", 128));
  PDKV_RETURN_IF_ERROR(r.get(&h.nonce, "nonce"));
  PDKV_RETURN_IF_ERROR(r.get(&h.pub, "key"));
  PDKV_RETURN_IF_ERROR(r.expect_end("hello"));
  PDKV_RETURN_IF_ERROR(validate_name("importer name", h.from));
  return h;
}

Status validate_ctl_frame(const CtlHdr& h, std::string_view aux, CtlSide side) {
  PDKV_RETURN_IF_ERROR(check_ctl_header(h, side));
  if (aux.size() != h.aux_len) return ProtocolError("cuda_ipc control frame aux is incomplete");
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kHello: return parse_hello(aux).status();
    case Ctl::kChallenge: return parse_challenge(aux).status();
    case Ctl::kProof:
    case Ctl::kHelloAck: return parse_mac(aux).status();
    default: return Status::Ok();
  }
}

}  // namespace pdkv::cuda_ipc
