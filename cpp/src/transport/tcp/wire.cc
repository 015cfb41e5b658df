#include "transport/tcp/wire.h"

#include <cstdio>
#include <cstring>

#include "core/plan_runs.h"
#include "pdkv/spi/generations.h"
#include "pdkv/metadata.h"
#include "util/bytes.h"

namespace pdkv::tcp {
namespace {

constexpr uint8_t kIn = 1;   // may arrive on an inbound connection
constexpr uint8_t kOut = 2;  // may arrive on an outbound connection

constexpr uint8_t kHs = 1;    // ConnPhase::kHandshake
constexpr uint8_t kOpen = 2;  // ConnPhase::kOpen
constexpr uint8_t kMeta = 4;  // ConnPhase::kMetaWait
constexpr uint8_t kProofW = 8;  // ConnPhase::kProofWait

// What a receiver accepts of one frame type (docs/wire.md, "Limits per frame type").
struct FrameRule {
  const char* name;
  uint8_t roles;       // kIn | kOut
  uint8_t in_phases;   // phases in which an inbound connection accepts it
  uint8_t out_phases;  // phases in which an outbound connection accepts it
  uint32_t min_count, max_count;
  uint32_t min_aux;
  uint32_t max_aux;  // 0xFFFFFFFF: the notification limit (FrameLimits), for kNotify/kWrite
  uint64_t min_payload, max_payload;
  bool has_status;  // the status field carries a StatusCode; otherwise it must be 0
};

constexpr uint32_t kNotifAux = 0xFFFFFFFFu;

// Indexed by FrameType.
constexpr FrameRule kRules[] = {
    {"type 0", 0, 0, 0, 0, 0, 0, 0, 0, 0, false},
    {"hello", kIn, kHs, 0, 0, 0, 1, kMaxHelloBytes, 0, 0, false},
    {"hello-ack", kOut, 0, kHs, 0, 0, auth::kMacBytes, auth::kMacBytes, 0, 0, true},
    {"metadata request", kIn, kOpen, 0, 0, 0, 0, 0, 0, 0, false},
    {"metadata response", kOut, 0, kMeta, 0, 0, 0, kMaxMetadataBytes, 0, 0, false},
    {"write", kIn, kOpen, 0, 1, kMaxExtentsPerFrame, 0, kNotifAux, 1, kMaxPayloadPerFrame, false},
    {"read request", kIn, kOpen, 0, 1, kMaxExtentsPerFrame, 0, kNotifAux, 0, 0, false},
    {"read response", kOut, 0, kOpen, 0, 0, 0, 0, 1, kMaxPayloadPerFrame, false},
    {"ack", kOut, 0, kOpen, 0, 0, 0, kMaxErrorBytes, 0, 0, true},
    {"notification", kIn, kOpen, 0, 0, 0, 0, kNotifAux, 0, 0, false},
    {"error", kIn | kOut, kOpen, kHs | kOpen | kMeta, 0, 0, 0, kMaxErrorBytes, 0, 0, true},
    {"compressed write", kIn, kOpen, 0, 1, kMaxExtentsPerFrame, 0, kNotifAux, 1, kMaxCompressedPayload, false},
    {"compressed read response", kOut, 0, kOpen, 0, 0, 0, 0, 1, kMaxCompressedPayload, false},
    {"challenge", kOut, 0, kHs, 0, 0, 12, kMaxHelloBytes, 0, 0, false},
    {"proof", kIn, kProofW, 0, 0, 0, auth::kMacBytes, auth::kMacBytes, 0, 0, false},
};
constexpr uint16_t kNumTypes = sizeof(kRules) / sizeof(kRules[0]);

uint8_t phase_bit(ConnPhase p) {
  switch (p) {
    case ConnPhase::kHandshake: return kHs;
    case ConnPhase::kOpen: return kOpen;
    case ConnPhase::kMetaWait: return kMeta;
    case ConnPhase::kProofWait: return kProofW;
  }
  return 0;
}

const char* phase_name(ConnState s) {
  switch (s.phase) {
    case ConnPhase::kHandshake: return s.role == ConnRole::kInbound ? "before its hello" : "during the handshake";
    case ConnPhase::kOpen: return "on an open connection";
    case ConnPhase::kMetaWait: return "while a metadata response was expected";
    case ConnPhase::kProofWait: return "while its handshake proof was expected";
  }
  return "";
}

std::string range(uint64_t lo, uint64_t hi) { return std::to_string(lo) + ".." + std::to_string(hi); }

}  // namespace

FrameHeader decode_header(const void* bytes) {
  FrameHeader h;
  std::memcpy(&h, bytes, sizeof h);
  return h;
}

std::string frame_type_name(uint16_t type) {
  if (type > 0 && type < kNumTypes) return kRules[type].name;
  return "type " + std::to_string(type);
}

Status check_header(const FrameHeader& h, ConnState s, const FrameLimits& lim) {
  if (h.magic != kFrameMagic) {
    char m[16];
    snprintf(m, sizeof m, "0x%08x", h.magic);
    return ProtocolError("bad frame magic " + std::string(m) + " (not a pdkv peer, or the stream is out of sync)");
  }
  const bool inbound = s.role == ConnRole::kInbound;
  if (inbound && s.phase == ConnPhase::kHandshake && h.type != static_cast<uint16_t>(FrameType::kHello))
    return ProtocolError("the first frame must be a hello, got " + frame_type_name(h.type));
  if (h.type == 0 || h.type >= kNumTypes) return ProtocolError("unexpected frame type " + std::to_string(h.type));
  const FrameRule& r = kRules[h.type];
  const std::string what = std::string(r.name) + " frame";
  if (!(r.roles & (inbound ? kIn : kOut)))
    return ProtocolError("unexpected " + what + " (type " + std::to_string(h.type) + ") on an " +
                         (inbound ? "inbound" : "outbound") + " connection");
  if (!((inbound ? r.in_phases : r.out_phases) & phase_bit(s.phase)))
    return ProtocolError("unexpected " + what + " (type " + std::to_string(h.type) + ") " + phase_name(s));
  const bool is_write =
      h.type == static_cast<uint16_t>(FrameType::kWrite) || h.type == static_cast<uint16_t>(FrameType::kWriteZ);
  const bool is_read_req = h.type == static_cast<uint16_t>(FrameType::kReadReq);
  const uint16_t allowed_flags =
      is_write ? (kFlagNotif | kFlagGens | kFlagStrided | kFlagStrided2)
      : is_read_req ? (kFlagGens | kFlagStrided | kFlagStrided2 | kFlagZReply)
                    : 0;
  if (h.flags & ~allowed_flags) return ProtocolError(what + " has unknown flags " + std::to_string(h.flags));
  if ((h.flags & kFlagStrided) && (h.flags & kFlagStrided2))
    return ProtocolError(what + " sets both strided flags (8 and 32): its descriptor size is ambiguous");
  if (!r.has_status && h.status != 0)
    return ProtocolError(what + " carries a status (" + std::to_string(h.status) + ")");
  if (h.count < r.min_count || h.count > r.max_count)
    return ProtocolError(what + " declares " + std::to_string(h.count) + " extents (allowed " +
                         range(r.min_count, r.max_count) + ")");
  if (h.payload < r.min_payload || h.payload > r.max_payload)
    return ProtocolError(what + " declares a payload of " + std::to_string(h.payload) + " bytes (allowed " +
                         range(r.min_payload, r.max_payload) + ")");
  uint32_t max_aux = r.max_aux;
  if (max_aux == kNotifAux) {
    const uint32_t notif = std::min(lim.max_notif_bytes, kMaxNotifWireBytes);
    const bool carries = h.type == static_cast<uint16_t>(FrameType::kNotify) || (h.flags & kFlagNotif);
    const uint32_t gens = (h.flags & kFlagGens) ? kMaxClaimAux : 0;
    const uint32_t zspec = (is_read_req && (h.flags & kFlagZReply)) ? sizeof(ReadZSpec) : 0;
    max_aux = (carries ? notif : 0) + gens + zspec;
    if (h.aux_len > max_aux)
      return ProtocolError(what + " carries " + std::to_string(h.aux_len) + " aux bytes (limit " +
                           std::to_string(max_aux) + (gens ? ": block generations and " : ": ") + "notification)");
    if (gens && h.aux_len < 4)
      return ProtocolError(what + " announces block generations but carries " + std::to_string(h.aux_len) +
                           " aux bytes");
  }
  if (h.type == static_cast<uint16_t>(FrameType::kAck) && h.aux_len > 0 && h.status == 0)
    return ProtocolError("a successful ack carries " + std::to_string(h.aux_len) + " aux bytes");
  if (h.aux_len < r.min_aux || h.aux_len > max_aux) {
    if (h.type == static_cast<uint16_t>(FrameType::kHello))
      return ProtocolError("malformed hello (aux " + std::to_string(h.aux_len) + " bytes, allowed " +
                           range(r.min_aux, max_aux) + ")");
    return ProtocolError(what + " carries " + std::to_string(h.aux_len) + " aux bytes (allowed " +
                         range(r.min_aux, max_aux) + ")");
  }
  return Status::Ok();
}

namespace {

// What a compressed write's codec frames may decode to: its extents' bytes, and at
// most kMaxCompressedChunk of them (a sender cuts a compressed write into codec
// chunks of at most that: TcpCompression::chunk_bytes). Checked with the extents,
// before anything is received or decoded, so repeated or overlapping extents cannot
// multiply a small payload's output beyond it.
Status check_decoded_bound(const FrameHeader& h, uint64_t sum) {
  if (h.type == static_cast<uint16_t>(FrameType::kWriteZ) && sum > kMaxCompressedChunk)
    return ProtocolError("compressed write frame's extents add up to " + std::to_string(sum) +
                         " bytes, more than a compressed frame may decode to (" + std::to_string(kMaxCompressedChunk) +
                         ")");
  return Status::Ok();
}

}  // namespace

Result<uint64_t> check_extents(const WireExtent* ext, uint32_t n, const FrameHeader& h) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; ++i) {
    WireExtent e;
    std::memcpy(&e, ext + i, sizeof e);
    if (e.len == 0) return ProtocolError("extent " + std::to_string(i) + " has length 0");
    if (e.len > kMaxPayloadPerFrame - sum)
      return ProtocolError("the extents ask for more than " + std::to_string(kMaxPayloadPerFrame) +
                           " bytes in one frame");
    sum += e.len;
  }
  if (h.type == static_cast<uint16_t>(FrameType::kWrite) && sum != h.payload)
    return ProtocolError("write frame declares " + std::to_string(h.payload) +
                         " payload bytes but its extents add up to " + std::to_string(sum));
  PDKV_RETURN_IF_ERROR(check_decoded_bound(h, sum));
  return sum;
}

DescView desc_at(const void* descs, uint16_t flags, uint32_t i) {
  const char* at = static_cast<const char*>(descs);
  if (flags & kFlagStrided2) {
    WireStrided2Extent e;
    std::memcpy(&e, at + size_t(i) * sizeof e, sizeof e);
    return {e.region, e.offset, e.len, e.count, e.stride, e.count2, e.stride2};
  }
  if (flags & kFlagStrided) {
    WireStridedExtent e;
    std::memcpy(&e, at + size_t(i) * sizeof e, sizeof e);
    return {e.region, e.offset, e.len, e.count, e.stride, 1, 0};
  }
  WireExtent e;
  std::memcpy(&e, at + size_t(i) * sizeof e, sizeof e);
  return {e.region, e.offset, e.len, 1, 0, 1, 0};
}

namespace {

// The checks check_strided_extents and check_strided2_extents share (`flags`: which
// of the two); `kind` names the descriptors in the messages ("strided", "two-level").
Result<uint64_t> check_runs(const void* descs, uint16_t flags, uint32_t n, const FrameHeader& h,
                            const std::string& kind) {
  const bool two_level = flags & kFlagStrided2;
  uint64_t sum = 0, pieces = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const DescView e = desc_at(descs, flags, i);
    const std::string at = kind + " extent " + std::to_string(i);
    if (e.len == 0) return ProtocolError(at + " has length 0");
    if (e.count == 0) return ProtocolError(at + " has count 0");
    if (e.count2 == 0) return ProtocolError(at + " has count2 0");
    uint64_t n_pieces = 0;
    if (__builtin_mul_overflow(e.count, e.count2, &n_pieces) || n_pieces > kMaxStridedPieces - pieces)
      return ProtocolError(at + " has " +
                           (two_level ? std::to_string(e.count) + " x " + std::to_string(e.count2) + " pieces"
                                      : "count " + std::to_string(e.count)) +
                           ": the frame's pieces exceed " + std::to_string(kMaxStridedPieces));
    pieces += n_pieces;
    uint64_t steps = 0, steps2 = 0, span = 0;
    if (__builtin_mul_overflow(e.count - 1, e.stride, &steps) ||
        __builtin_mul_overflow(e.count2 - 1, e.stride2, &steps2) || __builtin_add_overflow(steps, steps2, &span) ||
        __builtin_add_overflow(span, e.len, &span))
      return ProtocolError(at + ": count " + std::to_string(e.count) + " x stride " + std::to_string(e.stride) +
                           (two_level ? " + count2 " + std::to_string(e.count2) + " x stride2 " +
                                            std::to_string(e.stride2)
                                      : std::string()) +
                           " overflows");
    if (!planner::nested_disjoint(e.len, e.count, e.stride, e.count2, e.stride2))
      return ProtocolError(at + " (len " + std::to_string(e.len) + ", stride " + std::to_string(e.stride) +
                           (two_level ? ", stride2 " + std::to_string(e.stride2) : std::string()) +
                           ") has pieces that overlap");
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(n_pieces, e.len, &bytes) || bytes > kMaxPayloadPerFrame - sum)
      return ProtocolError("the " + kind + " extents ask for more than " + std::to_string(kMaxPayloadPerFrame) +
                           " bytes in one frame");
    sum += bytes;
  }
  if (h.type == static_cast<uint16_t>(FrameType::kWrite) && sum != h.payload)
    return ProtocolError("write frame declares " + std::to_string(h.payload) + " payload bytes but its " + kind +
                         " extents add up to " + std::to_string(sum));
  PDKV_RETURN_IF_ERROR(check_decoded_bound(h, sum));
  return sum;
}

}  // namespace

Result<uint64_t> check_strided_extents(const WireStridedExtent* ext, uint32_t n, const FrameHeader& h) {
  return check_runs(ext, kFlagStrided, n, h, "strided");
}

Result<uint64_t> check_strided2_extents(const WireStrided2Extent* ext, uint32_t n, const FrameHeader& h) {
  return check_runs(ext, kFlagStrided2, n, h, "two-level");
}

Result<DataAux> split_data_aux(const FrameHeader& h, std::string_view aux) {
  DataAux out;
  if (h.flags & kFlagGens) {
    util::ByteReader r(aux);
    uint32_t n = 0;
    PDKV_RETURN_IF_ERROR(r.get(&n, "block generations length"));
    if (n > kMaxClaimBytes || n > r.remaining())
      return ProtocolError("block generations claim " + std::to_string(n) + " bytes, more than the " +
                           std::to_string(r.remaining()) + " aux bytes left (limit " + std::to_string(kMaxClaimBytes) +
                           ")");
    out.claim = aux.substr(4, n);
    aux.remove_prefix(4 + size_t(n));
  }
  if (h.type == static_cast<uint16_t>(FrameType::kReadReq) && (h.flags & kFlagZReply)) {
    if (aux.size() != sizeof(ReadZSpec))
      return ProtocolError("read request frame announces a compressed response but carries " +
                           std::to_string(aux.size()) + " spec bytes (expected " + std::to_string(sizeof(ReadZSpec)) +
                           ")");
    out.zspec = aux;
    return out;
  }
  if (!(h.flags & kFlagNotif) && !aux.empty())
    return ProtocolError(frame_type_name(h.type) + " frame has " + std::to_string(aux.size()) +
                         " aux bytes after its block generations and no notification flag");
  out.notif = aux;
  return out;
}

std::string encode_claim_aux(std::string_view claim) {
  util::ByteWriter w;
  w.put<uint32_t>(static_cast<uint32_t>(claim.size()));
  w.put_raw(claim.data(), claim.size());
  return w.take();
}

Result<HelloBody> decode_hello(std::string_view aux) {
  util::ByteReader r(aux);
  HelloBody b;
  uint16_t reserved = 0;
  PDKV_RETURN_IF_ERROR(r.get(&b.version, "hello version"));
  if (b.version != kWireVersion)
    return VersionMismatch("wire protocol version " + std::to_string(b.version) +
                           " is not supported (this pdkv speaks " + std::to_string(kWireVersion) + ")");
  PDKV_RETURN_IF_ERROR(r.get(&reserved, "hello reserved"));
  if (reserved != 0) return ProtocolError("hello reserved field is " + std::to_string(reserved) + ", must be 0");
  PDKV_RETURN_IF_ERROR(r.get(&b.slot, "hello slot"));
  PDKV_RETURN_IF_ERROR(r.get(&b.instance, "hello instance"));
  PDKV_RETURN_IF_ERROR(r.get_str(&b.from, "hello initiator", 128));
  PDKV_RETURN_IF_ERROR(r.get_str(&b.to, "hello target", 128));
  PDKV_RETURN_IF_ERROR(r.get(&b.nonce, "hello nonce"));
  PDKV_RETURN_IF_ERROR(r.get(&b.pub, "hello key"));
  PDKV_RETURN_IF_ERROR(r.expect_end("hello"));
  Status st = validate_name("initiator name", b.from);
  if (!st.ok()) return ProtocolError(st.message());
  return b;
}

std::string encode_hello(const HelloBody& b) {
  util::ByteWriter w;
  w.put<uint16_t>(b.version);
  w.put<uint16_t>(0);
  w.put<uint32_t>(b.slot);
  w.put<uint64_t>(b.instance);
  w.put_str(b.from);
  w.put_str(b.to);
  w.put_raw(b.nonce.data(), b.nonce.size());
  w.put_raw(b.pub.data(), b.pub.size());
  return w.take();
}

}  // namespace pdkv::tcp
