// The tcp transport's wire format (version 2: the challenge-response handshake) and
// its rules. Documented in docs/wire.md.
//
// The layout: every frame starts with a 40-byte FrameHeader, followed by `count` 24-byte
// WireExtents (40-byte WireStridedExtents when the frame has kFlagStrided, 56-byte
// WireStrided2Extents with kFlagStrided2), then `aux_len` bytes of aux data (notification, message, hello body),
// then `payload` bytes of data. All integers little endian.
//
// The rules (wire.cc): pure validation of tcp frames before anything is allocated or read.
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

namespace pdkv::tcp {

inline constexpr uint32_t kFrameMagic = 0x464b4450;  // "PDKF"
inline constexpr uint16_t kWireVersion = 2;

enum class FrameType : uint16_t {
  kHello = 1,     // initiator -> target, first frame; aux = HelloBody (nonce, ephemeral key)
  kHelloAck = 2,  // target -> initiator, after a good proof; status OK, aux = the target's MAC
  kMetaReq = 3,   // -> target: send me your metadata
  kMetaResp = 4,  // <- aux = metadata blob
  kWrite = 5,     // descs (target region/offset/len), aux = notification if kFlagNotif, payload
  kReadReq = 6,   // descs to read from the target
  kReadResp = 7,  // payload for (xfer_id, batch) of an earlier kReadReq
  kAck = 8,       // (xfer_id, batch) landed (write) or notification delivered; status != 0: failed, aux = message
  kNotify = 9,    // aux = notification
  kError = 10,    // status = StatusCode, aux = message; the sender then closes
  // -> target: a write whose payload is a sequence of codec frames (pdkv/codec.h)
  // that decode, in order, to the bytes of its extents; only to a peer whose tcp
  // metadata extra says it accepts them (kFeatureCompressedWrite).
  kWriteZ = 11,
  // <- target: the response to a kReadReq with kFlagZReply whose payload is a
  // sequence of codec frames decoding, in order, to the bytes of the requested extents
  // (the target may answer such a request with a plain kReadResp instead).
  kReadRespZ = 12,
  // The handshake's middle (pdkv/spi/auth.h): the target's answer to a hello
  // (aux = ChallengeBody), then the initiator's proof (aux = its 32-byte MAC).
  kChallenge = 13,  // target -> initiator
  kProof = 14,      // initiator -> target
};

// The tcp transport's metadata extra (Transport::metadata_extra): u32 magic, u32
// feature bits, u32 bitmask of the codecs (1 << CodecKind) it decodes. A peer that
// publishes none is older and gets only plain frames.
inline constexpr uint32_t kExtraMagic = 0x58504354;  // "TCPX"
inline constexpr uint32_t kFeatureCompressedWrite = 1;
// It accepts kFlagStrided on kWrite, kWriteZ and kReadReq.
inline constexpr uint32_t kFeatureStridedExtents = 2;
// It accepts kFlagZReply on kReadReq (answers with kReadRespZ when it can).
inline constexpr uint32_t kFeatureCompressedRead = 4;
// It accepts kFlagStrided2 on kWrite, kWriteZ and kReadReq (two-level runs).
inline constexpr uint32_t kFeatureTwoLevelExtents = 8;

inline constexpr uint16_t kFlagNotif = 1;  // kWrite: aux is a notification, deliver after payload
// kWrite / kReadReq: aux starts with a block generation claim (u32 length + claim,
// generations.h) the target checks before receiving the payload / responding; a
// notification (kFlagNotif) follows it. A failed check is answered with a kAck whose
// status is the error and whose aux is its message (the connection stays open).
inline constexpr uint16_t kFlagGens = 4;
// kWrite / kWriteZ / kReadReq: the descriptors are WireStridedExtents (a peer's
// fragmented blocks as one descriptor per run instead of one per piece). Sent only to
// a peer whose tcp metadata extra has kFeatureStridedExtents.
inline constexpr uint16_t kFlagStrided = 8;
// kReadReq: the initiator accepts a compressed response (kReadRespZ); its aux ends
// with a ReadZSpec (after the block generation claim, if any). Sent only to a peer
// whose tcp metadata extra has kFeatureCompressedRead.
inline constexpr uint16_t kFlagZReply = 16;
// kWrite / kWriteZ / kReadReq: the descriptors are WireStrided2Extents (two-level runs:
// NHD <-> HND, a block's run repeated over every (layer, part) of a contiguous pool).
// Never together with kFlagStrided. Sent only to a peer whose tcp metadata extra has
// kFeatureTwoLevelExtents.
inline constexpr uint16_t kFlagStrided2 = 32;

// How the initiator of a compressed read wants its response encoded: the codec and
// its parameters (the initiator knows the KV it reads: its dtype and FP8 grouping).
struct ReadZSpec {
  uint8_t codec;  // pdkv::CodecKind: zstd, lz4 or fp8
  uint8_t dtype;  // pdkv::DType of the KV (byte planes; fp8: bfloat16, float16, float32)
  uint8_t checksum;  // 1: XXH3-64 in every codec frame; 0: none
  uint8_t reserved;  // 0
  int32_t level;     // zstd level
  uint32_t heads;    // fp8 grouping (1.. each; rows of heads x head_dim elements)
  uint32_t head_dim;
  uint32_t rows_per_group;
  uint32_t reserved2;  // 0
};
static_assert(sizeof(ReadZSpec) == 24, "read compression spec must be 24 bytes");

struct FrameHeader {
  uint32_t magic;
  uint16_t type;
  uint16_t flags;
  uint64_t xfer_id;
  uint32_t batch;
  uint32_t count;    // number of WireExtents
  uint64_t payload;  // payload bytes
  uint32_t aux_len;
  uint32_t status;   // kAck / kError / kHelloAck: a pdkv::StatusCode
};
static_assert(sizeof(FrameHeader) == 40, "wire header must be 40 bytes");

struct WireExtent {
  uint64_t region;
  uint64_t offset;
  uint64_t len;
};
static_assert(sizeof(WireExtent) == 24, "wire extent must be 24 bytes");

// `count` pieces of `len` bytes, piece i at [offset + i * stride, +len) of `region`
// (count >= 1; stride >= len when count > 1, so pieces never overlap). The payload
// carries the pieces in order.
struct WireStridedExtent {
  uint64_t region;
  uint64_t offset;
  uint64_t len;
  uint64_t count;
  uint64_t stride;
};
static_assert(sizeof(WireStridedExtent) == 40, "wire strided extent must be 40 bytes");

// A two-level run: the one-level run {offset, len, count, stride} repeated `count2`
// times, repetition j starting stride2 * j bytes after repetition 0 (count, count2 >= 1;
// one level nests in the other's gaps, so no two of the count x count2 pieces overlap).
// The payload carries repetition 0's pieces in order, then repetition 1's, and so on.
struct WireStrided2Extent {
  uint64_t region;
  uint64_t offset;
  uint64_t len;
  uint64_t count;
  uint64_t stride;
  uint64_t count2;
  uint64_t stride2;
};
static_assert(sizeof(WireStrided2Extent) == 56, "wire two-level extent must be 56 bytes");

// Limits a receiver enforces before allocating or reading anything.
inline constexpr uint32_t kMaxExtentsPerFrame = 65536;
// Pieces of all strided descriptors of one frame together, count x count2 for a
// two-level one (the receiver lists at most one iovec per piece: 4 MiB at most).
inline constexpr uint64_t kMaxStridedPieces = 1u << 18;
inline constexpr uint64_t kMaxPayloadPerFrame = 1ull << 30;
inline constexpr uint32_t kMaxHelloBytes = 4096;
inline constexpr uint32_t kMaxErrorBytes = 4096;
inline constexpr uint32_t kMaxMetadataBytes = 64u << 20;
// A compressed write's payload: at most this many bytes (the receiver allocates it),
// and at most one codec frame per extent, each at most this many raw bytes.
inline constexpr uint64_t kMaxCompressedPayload = 64ull << 20;
inline constexpr uint64_t kMaxCompressedChunk = 64ull << 20;
inline constexpr uint32_t kNotifyBatch = 0xFFFFFFFFu;  // batch index of a standalone notification

// ---------------------------------------------------------------- the rules (wire.cc)

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
