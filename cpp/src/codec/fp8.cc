#include "codec/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "codec/float_bits.h"
#include "codec/kernels.h"

namespace pdkv::codec {

uint8_t float_to_e4m3(float y) {
  const uint32_t x = float_bits(y);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7Fu;                    // NaN
  const float a = bits_float(ax);
  if (a >= kFp8Max) return sign | 0x7Eu;                        // saturate (Inf too)
  if (ax < 0x3C800000u) {                                       // below 2^-6: subnormal e4m3
    // Scaling by 2^9 is exact; the rounded integer is the subnormal mantissa, and 8
    // is the smallest normal's code, so the two ranges join without a special case.
    return sign | uint8_t(std::lrint(a * 512.0f));
  }
  // Normal: keep 3 of fp32's 23 mantissa bits, round to nearest even, rebias 127 -> 7.
  const uint32_t r = ax + 0x7FFFFu + ((ax >> 20) & 1u);
  uint32_t code = (r >> 20) - (120u << 3);
  if (code > 0x7Eu) code = 0x7Eu;                               // (only 448 < a: excluded above)
  return sign | uint8_t(code);
}

namespace {

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 0xF, m = c & 7;
    float v;
    if (e == 15 && m == 7) v = std::nanf("");
    else if (e == 0) v = std::ldexp(float(m), -9);
    else v = std::ldexp(1.0f + float(m) / 8.0f, e - 7);
    t[size_t(c)] = (c & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = make_e4m3_table();
  return table;
}

template <DType D>
inline float load(const uint8_t* p, uint64_t i) {
  if constexpr (D == DType::kF32) {
    float f;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    if constexpr (D == DType::kBF16) return bf16_to_float(h);
    else return fp16_to_float(h);
  }
}

template <DType D>
inline void store(uint8_t* p, uint64_t i, float v) {
  if constexpr (D == DType::kF32) {
    std::memcpy(p + i * 4, &v, 4);
  } else {
    const uint16_t h = (D == DType::kBF16) ? float_to_bf16(v) : float_to_fp16(v);
    std::memcpy(p + i * 2, &h, 2);
  }
}

// The scalar reference (CodecKernels::kScalar); fp8_kernels.h has the vectorised
// loops, bit-identical to these.

// Calls f(first_element, count, scale_index) for every (row group, head) run of
// head_dim contiguous elements, in element order within a group.
template <typename F>
void for_each_group(uint64_t elems, const Fp8Grouping& g, F&& f) {
  const uint64_t row = uint64_t(g.heads) * g.head_dim;
  const uint64_t rows = elems / row;
  for (uint64_t r0 = 0, rg = 0; r0 < rows; r0 += g.rows_per_group, ++rg) {
    const uint64_t r1 = std::min<uint64_t>(rows, r0 + g.rows_per_group);
    for (uint32_t h = 0; h < g.heads; ++h) f(r0, r1, h, rg * g.heads + h);
  }
}

template <DType D>
void quantize(const uint8_t* src, uint64_t elems, const Fp8Grouping& g, uint8_t* scales, uint8_t* codes) {
  const uint64_t row = uint64_t(g.heads) * g.head_dim;
  for_each_group(elems, g, [&](uint64_t r0, uint64_t r1, uint32_t h, uint64_t si) {
    float amax = 0.0f;
    for (uint64_t r = r0; r < r1; ++r) {
      const uint64_t base = r * row + uint64_t(h) * g.head_dim;
      for (uint32_t d = 0; d < g.head_dim; ++d) {
        const float a = std::fabs(load<D>(src, base + d));
        if (a > amax && a <= 3.4028235e38f) amax = a;  // finite only (NaN compares false)
      }
    }
    float scale = amax / kFp8Max;
    float inv = kFp8Max / amax;
    // An all-zero group (or one so tiny its scale underflows) uses scale 1: its
    // elements quantize to zero (non-finite ones as described in float_to_e4m3).
    if (!(scale > 0.0f) || !std::isfinite(inv)) scale = inv = 1.0f;
    std::memcpy(scales + si * 4, &scale, 4);
    for (uint64_t r = r0; r < r1; ++r) {
      const uint64_t base = r * row + uint64_t(h) * g.head_dim;
      for (uint32_t d = 0; d < g.head_dim; ++d) codes[base + d] = float_to_e4m3(load<D>(src, base + d) * inv);
    }
  });
}

template <DType D>
void dequantize(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g, uint8_t* dst) {
  const auto& table = e4m3_table();
  const uint64_t row = uint64_t(g.heads) * g.head_dim;
  for_each_group(elems, g, [&](uint64_t r0, uint64_t r1, uint32_t h, uint64_t si) {
    float scale;
    std::memcpy(&scale, scales + si * 4, 4);
    for (uint64_t r = r0; r < r1; ++r) {
      const uint64_t base = r * row + uint64_t(h) * g.head_dim;
      for (uint32_t d = 0; d < g.head_dim; ++d) store<D>(dst, base + d, table[codes[base + d]] * scale);
    }
  });
}

}  // namespace

float e4m3_to_float(uint8_t code) { return e4m3_table()[code]; }

uint64_t fp8_group_count(uint64_t elems, const Fp8Grouping& g) {
  if (g.heads == 0 || g.head_dim == 0 || g.rows_per_group == 0) return 0;
  const uint64_t row = uint64_t(g.heads) * g.head_dim;
  if (elems % row != 0) return 0;
  const uint64_t rows = elems / row;
  return (rows + g.rows_per_group - 1) / g.rows_per_group * g.heads;
}

void fp8_quantize(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                  uint8_t* codes) {
  if (codec_kernels() != CodecKernels::kScalar) return fp8_quantize_fast(src, elems, dtype, g, scales, codes);
  switch (dtype) {
    case DType::kBF16: return quantize<DType::kBF16>(src, elems, g, scales, codes);
    case DType::kF16: return quantize<DType::kF16>(src, elems, g, scales, codes);
    default: return quantize<DType::kF32>(src, elems, g, scales, codes);
  }
}

void fp8_dequantize(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                    DType dst_dtype, uint8_t* dst) {
  if (codec_kernels() != CodecKernels::kScalar) return fp8_dequantize_fast(scales, codes, elems, g, dst_dtype, dst);
  switch (dst_dtype) {
    case DType::kBF16: return dequantize<DType::kBF16>(scales, codes, elems, g, dst);
    case DType::kF16: return dequantize<DType::kF16>(scales, codes, elems, g, dst);
    default: return dequantize<DType::kF32>(scales, codes, elems, g, dst);
  }
}

}  // namespace pdkv::codec
