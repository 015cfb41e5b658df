// The argument layout shared by the FP8 kernels (fp8_codec.cu), the host code that
// launches them (fp8_device.cc) and the fake driver that emulates them
// (tests/fakecuda/fakecuda.cc keeps its own copy of these structs: it is built alone;
// the static_asserts below and there pin the sizes).
//
// A batch is a list of pieces (device extents, each whole rows of heads x head_dim
// elements) and a list of frames (docs/compression.md "Frame format": the codec
// frames of one compressed tcp batch). Rows are numbered across the whole batch:
// piece p holds rows [first_row, first_row + rows); frame f covers rows
// [first_row, first_row + rows) and owns scale groups [first_group, + groups).
// Within a frame, scale group k is (row group k / heads, head k % heads), exactly as
// the host codec (codec/fp8.cc) numbers them. `buf` is laid out like the batch's
// kWriteZ payload: each frame's scales (fp32) at scales_off, codes at codes_off (the
// 48-byte headers in between are written by the host).
#pragma once

#include <cstdint>

namespace pdkv::cuda {

struct Fp8Piece {
  uint64_t addr;       // device address of the extent
  uint64_t first_row;  // batch row of its first byte
  uint64_t rows;
};

struct Fp8FrameDesc {
  uint64_t first_group;  // batch-wide index of the frame's first scale group
  uint64_t first_row;
  uint64_t rows;
  uint64_t scales_off;  // byte offsets into buf
  uint64_t codes_off;
};

// Passed by value as the kernels' only parameter.
struct Fp8Launch {
  uint64_t pieces;        // device address of Fp8Piece[npieces], ordered by first_row
  uint64_t frames;        // device address of Fp8FrameDesc[nframes], ordered by first_group
  uint64_t buf;           // device address of the scales + codes
  uint64_t total_groups;  // scale groups of all frames
  uint32_t npieces;
  uint32_t nframes;
  uint32_t heads;
  uint32_t head_dim;
  uint32_t rows_per_group;
  uint32_t dtype;  // pdkv DType number of the extents: 0 float32, 1 float16, 2 bfloat16
};

static_assert(sizeof(Fp8Piece) == 24, "Fp8Piece layout is shared with the fake driver");
static_assert(sizeof(Fp8FrameDesc) == 40, "Fp8FrameDesc layout is shared with the fake driver");
static_assert(sizeof(Fp8Launch) == 56, "Fp8Launch layout is shared with the fake driver");

inline constexpr const char* kFp8QuantizeKernel = "pdkv_fp8_quantize";
inline constexpr const char* kFp8DequantizeKernel = "pdkv_fp8_dequantize";

}  // namespace pdkv::cuda
