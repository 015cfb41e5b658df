// Pure validation of tcp frames (wire.h) before anything is allocated or read.
//
// The progress thread, the blocking handshake (dial) and the metadata fetch all
// run every received header through check_header(): one rule per frame type says
// in which direction and connection phase the frame may arrive and how large its
// extent count, aux bytes and payload may be (the table in docs/wire.md). The
// decoders below never read past their input and do no I/O, so they are unit
// tested (cpp/tests/test_tcp_frame.cc) and fuzzed (fuzz/targets/tcp_*_fuzz.cc).
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pdkv/spi/auth.h"
#include "pdkv/spi/generations.h"
#include "pdkv/status.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

// Which end of the connection receives the frame.
enum class ConnRole : uint8_t {
  kInbound,   // accepted by this agent: the peer is an initiator
  kOutbound,  // dialled by this agent: the peer is a target
};

// Where the connection is in its life.
enum class ConnPhase : uint8_t {
  kHandshake,  // inbound: before a valid hello; outbound: hello sent, ack not yet read
  kProofWait,  // inbound: hello answered with a challenge, the proof not yet read
  kOpen,       // authenticated: data frames flow
  kMetaWait,   // outbound, metadata request sent: only the response (or an error) may come
};

struct ConnState {
  ConnRole role = ConnRole::kInbound;
  ConnPhase phase = ConnPhase::kHandshake;
};

struct FrameLimits {
  uint32_t max_notif_bytes = 1u << 20;  // notification aux (kWrite with kFlagNotif, kNotify)
};

// Largest notification a frame may carry whatever the agent's configuration says:
// bounds the control buffer of one frame to kMaxExtentsPerFrame * 24 + this.
inline constexpr uint32_t kMaxNotifWireBytes = 64u << 20;
// Largest block generation section of a kWrite / kReadReq aux (u32 length + claim).
inline constexpr uint32_t kMaxClaimAux = 4 + kMaxClaimBytes;

// Copies 40 bytes into a header (no validation).
FrameHeader decode_header(const void* bytes);

// Validates magic, type, direction/phase, flags, status, count, aux_len and
// payload of `h` for a connection in state `s`. ProtocolError naming the field and
// the limit on failure (the caller adds who sent it). When OK, control_bytes(h)
// is at most kMaxExtentsPerFrame * 56 + max(kMaxMetadataBytes, kMaxNotifWireBytes + kMaxClaimAux).
Status check_header(const FrameHeader& h, ConnState s, const FrameLimits& lim);

// Bytes of one extent descriptor of `h` (plain or strided).
inline uint64_t desc_bytes(const FrameHeader& h) {
  return (h.flags & kFlagStrided2)  ? sizeof(WireStrided2Extent)
         : (h.flags & kFlagStrided) ? sizeof(WireStridedExtent)
                                    : sizeof(WireExtent);
}
// Bytes of extents plus aux that follow the header.
inline uint64_t control_bytes(const FrameHeader& h) { return uint64_t(h.count) * desc_bytes(h) + h.aux_len; }

// The aux of a kWrite / kReadReq that passed check_header, split into its block
// generation claim (kFlagGens; empty otherwise, not yet decoded: decode_claim) and
// its notification (kFlagNotif), or for a kReadReq with kFlagZReply its ReadZSpec
// (exactly sizeof(ReadZSpec) bytes, not yet validated: decode_zspec).
struct DataAux {
  std::string_view claim;
  std::string_view notif;
  std::string_view zspec;
};
Result<DataAux> split_data_aux(const FrameHeader& h, std::string_view aux);
// The aux prefix a sender puts before the notification: u32 length + claim.
std::string encode_claim_aux(std::string_view claim);

// Human-readable name of a frame type ("write", "error", "type 99").
std::string frame_type_name(uint16_t type);

// Checks the extent list of a kWrite / kReadReq that passed check_header: no empty
// extent, the sum fits in kMaxPayloadPerFrame (no u64 overflow), and for a write it
// equals the declared payload; for a kWriteZ, the sum (what its codec frames decode
// to) is at most kMaxCompressedChunk. Returns the sum. Region bounds are checked by
// extent_in_region().
Result<uint64_t> check_extents(const WireExtent* ext, uint32_t n, const FrameHeader& h);

// check_extents() for a kFlagStrided frame, run before anything is allocated for
// it: every descriptor has count >= 1, len >= 1, stride >= len when count > 1, and a
// span (count - 1) * stride + len without u64 overflow; all pieces together are at
// most kMaxStridedPieces and kMaxPayloadPerFrame bytes (kMaxCompressedChunk for a
// kWriteZ), and for a write the declared payload. ProtocolError naming the
// descriptor and field. Returns the byte sum.
Result<uint64_t> check_strided_extents(const WireStridedExtent* ext, uint32_t n, const FrameHeader& h);

// Bytes from a strided descriptor's first byte to its last piece's end (the
// descriptor passed check_strided_extents: no overflow).
inline uint64_t strided_span(const WireStridedExtent& e) { return (e.count - 1) * e.stride + e.len; }

// check_strided_extents() for a kFlagStrided2 frame (two-level descriptors): every
// descriptor has len >= 1, count >= 1, count2 >= 1; its levels nest (no two of its
// count x count2 pieces overlap: planner::nested_disjoint); its span
// (count - 1) * stride + (count2 - 1) * stride2 + len and count x count2 x len do not
// wrap u64; all pieces together are at most kMaxStridedPieces and kMaxPayloadPerFrame
// bytes, and for a write the declared payload. ProtocolError naming the descriptor
// and the field. Returns the byte sum.
Result<uint64_t> check_strided2_extents(const WireStrided2Extent* ext, uint32_t n, const FrameHeader& h);

// One extent descriptor of any form: `count` pieces of `len` bytes `stride` apart,
// repeated `count2` times `stride2` apart (a plain WireExtent is one piece, a
// one-level strided one one repetition).
struct DescView {
  uint64_t region, offset, len, count, stride, count2, stride2;
  // First byte to the end of the last piece (no overflow once the frame's check passed).
  uint64_t span() const { return (count - 1) * stride + (count2 - 1) * stride2 + len; }
};

// Descriptor `i` of a frame with `flags` whose descriptors start at `descs` (any
// alignment: read with memcpy).
DescView desc_at(const void* descs, uint16_t flags, uint32_t i);

// The span of a two-level descriptor that passed check_strided2_extents (no overflow).
inline uint64_t strided2_span(const WireStrided2Extent& e) {
  return (e.count - 1) * e.stride + (e.count2 - 1) * e.stride2 + e.len;
}

// True when [offset, offset + len) lies inside a region of `region_len` bytes
// (no u64 overflow).
inline bool extent_in_region(uint64_t offset, uint64_t len, uint64_t region_len) {
  return offset <= region_len && len <= region_len - offset;
}

// The body of a kHello (aux). It carries no secret: the initiator proves it knows
// one later (kProof, pdkv/spi/auth.h).
struct HelloBody {
  uint16_t version = 0;
  uint32_t slot = 0;
  uint64_t instance = 0;  // the target instance the initiator expects (0: any)
  std::string from;       // initiator agent name (validated)
  std::string to;         // target agent name ("": any)
  auth::Nonce nonce{};    // the initiator's
  auth::Pub pub{};        // the initiator's ephemeral X25519 key
};

// Decodes and validates a hello body: VersionMismatch for another wire version,
// ProtocolError for anything malformed (including trailing bytes).
Result<HelloBody> decode_hello(std::string_view aux);
std::string encode_hello(const HelloBody& b);

// The body of a kChallenge (aux), and of a kProof or kHelloAck (exactly one MAC): the
// handshake's wire bodies, the same on every transport (pdkv/spi/auth.h).
using ChallengeBody = auth::Challenge;
using auth::decode_challenge;
using auth::decode_mac;
using auth::encode_challenge;
using auth::encode_mac;

}  // namespace pdkv::tcp
