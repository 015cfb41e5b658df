// The codec frame header (48 bytes, little-endian; layout in docs/compression.md):
//   0  magic "PKVC"      4  version (1)   5  codec   6  dtype   7  flags (bit 0: checksum)
//   8  raw_len u64       16 payload_len u64
//   24 heads u32         28 head_dim u32  32 rows_per_group u32  36 reserved u32 (0)
//   40 checksum u64 (XXH3-64; 0 without the flag)
#pragma once

#include <cstdint>

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

}  // namespace pdkv::codec
