// The tcp transport's wire format (version 2: the challenge-response handshake). Documented in docs/wire.md.
//
// Every frame starts with a 40-byte FrameHeader, followed by `count` 24-byte
// WireExtents (40-byte WireStridedExtents when the frame has kFlagStrided, 56-byte
// WireStrided2Extents with kFlagStrided2), then `aux_len` bytes of aux data (notification, message, hello body),
// then `payload` bytes of data. All integers little endian.
#pragma once

#include <cstdint>

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

}  // namespace pdkv::tcp
