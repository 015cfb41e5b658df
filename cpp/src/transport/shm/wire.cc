#include "transport/shm/wire.h"

#include "pdkv/metadata.h"
#include "util/bytes.h"

namespace pdkv::shm {
namespace {

std::string type_name(uint16_t t) {
  static const char* names[] = {"?", "hello", "hello-ack", "region-req", "region-resp", "notify", "notify-ack",
                                "revoke", "revoke-ack", "error", "lease-req", "lease-resp", "lease-end", "gen-req", "gen-resp",
                                "challenge", "proof"};
  return t >= 1 && t <= 16 ? names[t] : "type " + std::to_string(t);
}

// The largest aux a frame of `type` may carry on `side`; -1: the type is not allowed there.
int64_t aux_limit(Ctl type, CtlSide side, uint32_t max_notif) {
  switch (side) {
    case CtlSide::kTargetPreHello:
      return type == Ctl::kHello ? int64_t{kMaxHelloAux} : -1;
    case CtlSide::kTargetProof:
      return type == Ctl::kProof ? int64_t{auth::kMacBytes} : -1;
    case CtlSide::kTarget:
      switch (type) {
        case Ctl::kRegionReq: return 0;
        case Ctl::kNotify: return int64_t{max_notif};
        case Ctl::kRevokeAck: return 0;
        case Ctl::kLeaseReq: return int64_t{kMaxLeaseReqAux};
        case Ctl::kLeaseEnd: return 0;
        case Ctl::kGenReq: return int64_t{kMaxNameLen};
        default: return -1;
      }
    case CtlSide::kInitiatorHello:
      return type == Ctl::kChallenge || type == Ctl::kHelloAck ? int64_t{kMaxHelloAux}
             : type == Ctl::kError                             ? int64_t{kMaxErrorAux}
                                                               : -1;
    case CtlSide::kInitiator:
      switch (type) {
        case Ctl::kRegionResp: return int64_t{kMaxErrorAux};
        case Ctl::kNotifyAck: return 0;
        case Ctl::kRevoke: return 0;
        case Ctl::kLeaseResp: return int64_t{kMaxErrorAux};
        case Ctl::kGenResp: return int64_t{kMaxErrorAux};
        case Ctl::kError: return int64_t{kMaxErrorAux};
        default: return -1;
      }
  }
  return -1;
}

}  // namespace

Status check_ctl_header(const CtlHdr& h, CtlSide side, uint32_t max_notif) {
  if (h.magic != kCtlMagic) return ProtocolError("bad control frame magic " + std::to_string(h.magic));
  if (h.flags != 0) return ProtocolError("control frame flags must be 0, got " + std::to_string(h.flags));
  const auto type = static_cast<Ctl>(h.type);
  const int64_t limit = aux_limit(type, side, max_notif);
  if (limit < 0) {
    if (side == CtlSide::kTargetPreHello)
      return ProtocolError("the first frame must be a hello, got " + type_name(h.type));
    return ProtocolError("unexpected control frame " + type_name(h.type));
  }
  if (h.aux_len > limit)
    return ProtocolError("control frame " + type_name(h.type) + " declares " + std::to_string(h.aux_len) +
                         " aux bytes (limit " + std::to_string(limit) + ")");
  if (h.status != 0 && type != Ctl::kRegionResp && type != Ctl::kLeaseResp && type != Ctl::kGenResp &&
      type != Ctl::kError)
    return ProtocolError("control frame " + type_name(h.type) + " carries a status");
  return Status::Ok();
}

std::string encode_hello(const Hello& h) {
  util::ByteWriter w;
  w.put<uint16_t>(h.version);
  w.put<uint64_t>(h.expect_instance);
  w.put_str(h.from);
  w.put_str(h.to);
  w.put_raw(h.nonce.data(), h.nonce.size());
  w.put_raw(h.pub.data(), h.pub.size());
  return w.take();
}

Result<Hello> parse_hello(std::string_view aux) {
  util::ByteReader r(aux);
  Hello h;
  PDKV_RETURN_IF_ERROR(r.get(&h.version, "version"));
  if (h.version != kShmVersion)
    return VersionMismatch("shm protocol version " + std::to_string(h.version) + " is not supported (this is " +
                           std::to_string(kShmVersion) + ")");
  PDKV_RETURN_IF_ERROR(r.get(&h.expect_instance, "instance"));
  PDKV_RETURN_IF_ERROR(r.get_str(&h.from, "initiator", kMaxNameLen));
  PDKV_RETURN_IF_ERROR(r.get_str(&h.to, "target", kMaxNameLen));
  PDKV_RETURN_IF_ERROR(r.get(&h.nonce, "nonce"));
  PDKV_RETURN_IF_ERROR(r.get(&h.pub, "key"));
  PDKV_RETURN_IF_ERROR(r.expect_end("hello"));
  PDKV_RETURN_IF_ERROR(validate_name("initiator name", h.from));
  return h;
}

std::string encode_hello_ack(const HelloAck& a) {
  util::ByteWriter w;
  w.put<uint64_t>(a.instance);
  w.put<uint32_t>(a.pid);
  w.put_str(a.name);
  w.put_raw(a.mac.data(), a.mac.size());
  return w.take();
}

Result<HelloAck> parse_hello_ack(std::string_view aux) {
  util::ByteReader r(aux);
  HelloAck a;
  PDKV_RETURN_IF_ERROR(r.get(&a.instance, "instance"));
  PDKV_RETURN_IF_ERROR(r.get(&a.pid, "pid"));
  PDKV_RETURN_IF_ERROR(r.get_str(&a.name, "name", kMaxNameLen));
  PDKV_RETURN_IF_ERROR(r.get(&a.mac, "mac"));
  PDKV_RETURN_IF_ERROR(r.expect_end("hello-ack"));
  if (a.pid == 0) return ProtocolError("hello-ack names pid 0");
  return a;
}

std::string encode_region_info(const RegionInfo& ri) {
  util::ByteWriter w;
  w.put<uint64_t>(ri.addr);
  w.put<uint64_t>(ri.len);
  w.put<uint32_t>(static_cast<uint32_t>(ri.kind));
  w.put<uint32_t>(ri.shareable ? 1u : 0u);
  w.put<uint64_t>(ri.shared_offset);
  w.put<uint64_t>(ri.shared_len);
  return w.take();
}

Result<RegionInfo> parse_region_info(std::string_view aux) {
  if (aux.size() != kRegionInfoLen)
    return ProtocolError("region confirmation is " + std::to_string(aux.size()) + " bytes, expected " +
                         std::to_string(kRegionInfoLen));
  util::ByteReader r(aux);
  RegionInfo ri;
  uint32_t kind = 0, flags = 0;
  PDKV_RETURN_IF_ERROR(r.get(&ri.addr, "addr"));
  PDKV_RETURN_IF_ERROR(r.get(&ri.len, "len"));
  PDKV_RETURN_IF_ERROR(r.get(&kind, "kind"));
  PDKV_RETURN_IF_ERROR(r.get(&flags, "flags"));
  PDKV_RETURN_IF_ERROR(r.get(&ri.shared_offset, "shared offset"));
  PDKV_RETURN_IF_ERROR(r.get(&ri.shared_len, "shared length"));
  if (kind > static_cast<uint32_t>(MemKind::kCuda)) return ProtocolError("region confirmation names memory kind " + std::to_string(kind));
  if (flags > 1) return ProtocolError("region confirmation has unknown flags " + std::to_string(flags));
  if (ri.len == 0) return ProtocolError("region confirmation has length 0");
  if (ri.addr + ri.len < ri.addr) return ProtocolError("region confirmation wraps the address space");
  ri.kind = static_cast<MemKind>(kind);
  ri.shareable = flags & 1;
  if (ri.shareable != (ri.shared_len != 0))
    return ProtocolError(std::string("region confirmation ") + (ri.shareable ? "attaches a memfd to an empty window"
                                                                              : "names a window without a memfd"));
  if (ri.shared_offset > ri.len || ri.shared_len > ri.len - ri.shared_offset)
    return ProtocolError("region confirmation's shared window [" + std::to_string(ri.shared_offset) + ", +" +
                         std::to_string(ri.shared_len) + ") falls outside its " + std::to_string(ri.len) + " bytes");
  return ri;
}

std::string encode_lease_req(const LeaseReq& r) {
  util::ByteWriter w;
  w.put<uint32_t>(r.hold_ms);
  std::string out = w.take();
  out += encode_claim(r.claim);
  return out;
}

Result<LeaseReq> parse_lease_req(std::string_view aux) {
  util::ByteReader r(aux);
  LeaseReq lr;
  PDKV_RETURN_IF_ERROR(r.get(&lr.hold_ms, "lease hold time"));
  if (lr.hold_ms == 0 || lr.hold_ms > kMaxLeaseHoldMs)
    return ProtocolError("lease hold time " + std::to_string(lr.hold_ms) + " ms is outside 1.." +
                         std::to_string(kMaxLeaseHoldMs));
  PDKV_ASSIGN_OR_RETURN(lr.claim, decode_claim(aux.substr(r.pos())));
  return lr;
}

Status validate_ctl_frame(const CtlHdr& h, std::string_view aux, CtlSide side, uint32_t max_notif) {
  PDKV_RETURN_IF_ERROR(check_ctl_header(h, side, max_notif));
  if (aux.size() != h.aux_len) return ProtocolError("control frame aux is incomplete");
  switch (static_cast<Ctl>(h.type)) {
    case Ctl::kHello: return parse_hello(aux).status();
    case Ctl::kHelloAck: return parse_hello_ack(aux).status();
    case Ctl::kChallenge: return parse_challenge(aux).status();
    case Ctl::kProof: return parse_proof(aux).status();
    case Ctl::kRegionResp:
      return h.status == 0 ? parse_region_info(aux).status() : Status::Ok();
    case Ctl::kLeaseReq: return parse_lease_req(aux).status();
    case Ctl::kLeaseResp:
      return h.status == 0 && !aux.empty() ? ProtocolError("a granted lease carries no aux") : Status::Ok();
    case Ctl::kGenReq: return validate_name("generation table layout name", aux);
    case Ctl::kGenResp:
      return h.status == 0 && aux.size() != kGenRespLen
                 ? ProtocolError("a generation table answer is " + std::to_string(aux.size()) + " bytes, not " +
                                 std::to_string(kGenRespLen))
                 : Status::Ok();
    default: return Status::Ok();
  }
}

}  // namespace pdkv::shm
