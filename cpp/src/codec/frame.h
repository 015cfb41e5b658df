// The codec frame header (48 bytes, little-endian; layout in docs/compression.md):
//   0  magic "PKVC"      4  version (1)   5  codec   6  dtype   7  flags (bit 0: checksum)
//   8  raw_len u64       16 payload_len u64
//   24 heads u32         28 head_dim u32  32 rows_per_group u32  36 reserved u32 (0)
//   40 checksum u64 (XXH3-64; 0 without the flag)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "pdkv/codec.h"

namespace pdkv::codec {

constexpr char kFrameMagic[4] = {'P', 'K', 'V', 'C'};
constexpr uint8_t kFrameVersion = 1;
constexpr uint8_t kFlagChecksum = 1;

// Writes the header of `info` (+ checksum) into out[0, kCodecHeaderBytes).
void write_frame_header(const FrameInfo& info, uint64_t checksum, uint8_t* out);
// Validates the header at frame[0, n) (n >= kCodecHeaderBytes needed) and returns it
// with the checksum; every inconsistency is a ProtocolError naming the field.
Result<FrameInfo> read_frame_header(const uint8_t* frame, size_t n, uint64_t* checksum);

// One codec frame of a compressed payload (a tcp kWriteZ / kReadRespZ batch), as
// walk_payload_frames hands it over: its index, where it starts in the payload, its
// checked header and the bytes it decodes to.
struct PayloadFrame {
  uint32_t index = 0;
  uint64_t offset = 0;
  FrameInfo info;
  uint64_t out_len = 0;
  // "<what>, codec frame <index> (payload offset <offset>): ", the prefix of every
  // error about this frame.
  std::string where;
};

// The checks every receiver of a compressed payload makes, host or device decoder
// alike: each frame header is valid (peek_frame), lies inside payload[0, len), has a
// raw_len > 0, uses a codec whose bit (1 << CodecKind) is in `allowed`, and decodes to
// no more than is left of `capacity` (the bytes of the extents it lands in); the frames
// together decode to exactly `capacity`. Each frame is handed to `fn` in order after
// its own checks, before the next is read; the first error (a ProtocolError naming
// `what`, the frame and the field, or `fn`'s) stops the walk.
Status walk_payload_frames(const uint8_t* payload, uint64_t len, uint64_t capacity, std::string_view what,
                           uint32_t allowed, const std::function<Status(const PayloadFrame&)>& fn);

}  // namespace pdkv::codec
