// FP8 e4m3 ("fn": no infinities, one NaN pattern per sign) with one fp32 scale per
// group of elements: quantize a chunk of bf16/fp16/fp32 and dequantize it into any of
// them. The exact rounding rules are in docs/compression.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pdkv/codec.h"

namespace pdkv::codec {

constexpr float kFp8Max = 448.0f;

// One fp32 value -> its e4m3 code: round to nearest even, saturating to +-448
// (infinities included), NaN -> 0x7F with the sign bit kept.
uint8_t float_to_e4m3(float y);
// The value of an e4m3 code (0x7F/0xFF: NaN).
float e4m3_to_float(uint8_t code);

// Number of scales a chunk of `elems` elements has under `g`; 0 if `elems` is not a
// whole number of rows or `g` has a zero field.
uint64_t fp8_group_count(uint64_t elems, const Fp8Grouping& g);

// Quantizes `elems` elements of `dtype` (bf16, fp16 or fp32) at `src` into
// scales[fp8_group_count] (fp32, little-endian) followed by codes[elems].
void fp8_quantize(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                  uint8_t* codes);

// Dequantizes scales + codes into `elems` elements of `dst_dtype` at dst.
void fp8_dequantize(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                    DType dst_dtype, uint8_t* dst);

}  // namespace pdkv::codec
