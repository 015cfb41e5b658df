// The FP8 (e4m3) quantize / dequantize loops written branch-free, so the compiler
// vectorises them: every rounding rule of fp8.cc and float_bits.h is reproduced with
// integer arithmetic and selects (bit-identical results; tests/library/test_codec_kernels.py
// compares them with the scalar reference on every dtype).
//
// This header is compiled more than once with different target flags (fp8_vec.cc:
// the build's baseline; fp8_avx2.cc: AVX2). Each includer first defines
// PDKV_FP8_KERNEL_NS, so every copy lives in its own namespace and the linker can
// never merge an AVX2 instantiation into the baseline path. For the same reason the
// code here calls no out-of-line library function (std::min, std::fabs, ...).
#pragma once

#ifndef PDKV_FP8_KERNEL_NS
#error "define PDKV_FP8_KERNEL_NS before including fp8_kernels.h"
#endif

#include <cstdint>
#include <cstring>

#include "pdkv/codec.h"

namespace pdkv::codec::PDKV_FP8_KERNEL_NS {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even of v in [0, 2^22) as an integer: adding 2^23 leaves a float
// whose unit in the last place is 1, so the addition itself rounds (as lrint does in
// the default rounding mode).
inline uint32_t round_small(float v) { return bits_of(v + 8388608.0f) - 0x4B000000u; }

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = uint32_t(h & 0x7FFFu);
  const uint32_t exp = em >> 10;
  const uint32_t normal = (em << 13) + (112u << 23);                               // rebias 15 -> 127
  const uint32_t infnan = (em << 13) | 0x7F800000u;
  const uint32_t subnormal = bits_of(float(int32_t(em)) * 5.9604644775390625e-8f);  // man * 2^-24, exact
  return float_of(sign | (exp == 0 ? subnormal : exp == 31 ? infnan : normal));
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t quiet_nan = (x >> 16) | 0x0040u;
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return uint16_t((x & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

inline uint16_t f32_to_fp16(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  const uint32_t subnormal = round_small(float_of(ax) * 16777216.0f);  // only used below 2^-14
  const uint32_t normal = ((ax + 0xFFFu + ((ax >> 13) & 1u)) >> 13) - (112u << 10);
  const uint32_t mag = ax > 0x7F800000u ? 0x7E00u : ax >= 0x477FF000u ? 0x7C00u : ax < 0x38800000u ? subnormal : normal;
  return uint16_t(sign | mag);
}

inline uint8_t f32_to_e4m3(float y) {
  const uint32_t x = bits_of(y);
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  const uint32_t subnormal = round_small(float_of(ax) * 512.0f);  // only used below 2^-6
  uint32_t normal = ((ax + 0x7FFFFu + ((ax >> 20) & 1u)) >> 20) - (120u << 3);
  normal = normal > 0x7Eu ? 0x7Eu : normal;
  const uint32_t code = ax > 0x7F800000u   ? 0x7Fu   // NaN
                        : ax >= 0x43E00000u ? 0x7Eu   // >= 448 (infinity too): saturate
                        : ax < 0x3C800000u  ? subnormal
                                            : normal;
  return uint8_t(sign | code);
}

inline float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 7u;
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t subnormal = bits_of(float(int32_t(m)) * 0.001953125f);  // m * 2^-9
  return float_of(sign | ((c & 0x7Fu) == 0x7Fu ? 0x7FC00000u : e == 0 ? subnormal : normal));
}

// Element i of a row of dtype D: its float value, and the bits of its magnitude
// (ordered as the magnitudes are, finite ones below kInfBits).
template <DType D>
struct Elem;

template <>
struct Elem<DType::kBF16> {
  static constexpr size_t kSize = 2;
  static constexpr uint32_t kInfBits = 0x7F80u;
  static uint16_t raw(const uint8_t* p, size_t i) {
    uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    return h;
  }
  static uint32_t abs_bits(const uint8_t* p, size_t i) { return raw(p, i) & 0x7FFFu; }
  static float value(const uint8_t* p, size_t i) { return float_of(uint32_t(raw(p, i)) << 16); }
  static float from_abs_bits(uint32_t b) { return float_of(b << 16); }
  static void store(uint8_t* p, size_t i, float v) {
    const uint16_t h = f32_to_bf16(v);
    std::memcpy(p + i * 2, &h, 2);
  }
};

template <>
struct Elem<DType::kF16> {
  static constexpr size_t kSize = 2;
  static constexpr uint32_t kInfBits = 0x7C00u;
  static uint16_t raw(const uint8_t* p, size_t i) {
    uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    return h;
  }
  static uint32_t abs_bits(const uint8_t* p, size_t i) { return raw(p, i) & 0x7FFFu; }
  static float value(const uint8_t* p, size_t i) { return fp16_to_f32(raw(p, i)); }
  static float from_abs_bits(uint32_t b) { return fp16_to_f32(uint16_t(b)); }
  static void store(uint8_t* p, size_t i, float v) {
    const uint16_t h = f32_to_fp16(v);
    std::memcpy(p + i * 2, &h, 2);
  }
};

template <>
struct Elem<DType::kF32> {
  static constexpr size_t kSize = 4;
  static constexpr uint32_t kInfBits = 0x7F800000u;
  static uint32_t abs_bits(const uint8_t* p, size_t i) {
    uint32_t u;
    std::memcpy(&u, p + i * 4, 4);
    return u & 0x7FFFFFFFu;
  }
  static float value(const uint8_t* p, size_t i) {
    float f;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  }
  static float from_abs_bits(uint32_t b) { return float_of(b); }
  static void store(uint8_t* p, size_t i, float v) { std::memcpy(p + i * 4, &v, 4); }
};

// The scale of one group from its largest finite magnitude (fp8.cc's rule: an
// all-zero or underflowing group uses 1).
inline void group_scale(float amax, float* scale, float* inv) {
  *scale = amax / 448.0f;
  *inv = 448.0f / amax;
  const uint32_t inv_bits = bits_of(*inv) & 0x7FFFFFFFu;
  if (!(*scale > 0.0f) || inv_bits >= 0x7F800000u) *scale = *inv = 1.0f;
}

// The largest finite magnitude of in[0, n), as bits (0 when there is none). A plain
// max vectorises where a max of selected elements does not (GCC 12), so the rare row
// holding an infinity or NaN takes a second, scalar pass.
template <typename E>
inline uint32_t row_amax_bits(const uint8_t* in, size_t n) {
  uint32_t amax = 0;
  for (size_t d = 0; d < n; ++d) {
    const uint32_t a = E::abs_bits(in, d);
    amax = a > amax ? a : amax;
  }
  if (amax < E::kInfBits) return amax;
  amax = 0;
  for (size_t d = 0; d < n; ++d) {
    const uint32_t a = E::abs_bits(in, d);
    if (a < E::kInfBits && a > amax) amax = a;
  }
  return amax;
}

template <DType D>
void quantize(const uint8_t* src, uint64_t elems, const Fp8Grouping& g, uint8_t* scales, uint8_t* codes) {
  using E = Elem<D>;
  const size_t dim = g.head_dim;
  const uint64_t row = uint64_t(g.heads) * dim;
  const uint64_t rows = elems / row;
  for (uint64_t r0 = 0, rg = 0; r0 < rows; r0 += g.rows_per_group, ++rg) {
    const uint64_t r1 = rows - r0 < g.rows_per_group ? rows : r0 + g.rows_per_group;
    for (uint32_t h = 0; h < g.heads; ++h) {
      uint32_t amax_bits = 0;
      for (uint64_t r = r0; r < r1; ++r) {
        const uint32_t m = row_amax_bits<E>(src + (r * row + uint64_t(h) * dim) * E::kSize, dim);
        amax_bits = m > amax_bits ? m : amax_bits;
      }
      float scale, inv;
      group_scale(E::from_abs_bits(amax_bits), &scale, &inv);
      std::memcpy(scales + (rg * g.heads + h) * 4, &scale, 4);
      for (uint64_t r = r0; r < r1; ++r) {
        const uint64_t base = r * row + uint64_t(h) * dim;
        const uint8_t* in = src + base * E::kSize;
        uint8_t* out = codes + base;
        for (size_t d = 0; d < dim; ++d) out[d] = f32_to_e4m3(E::value(in, d) * inv);
      }
    }
  }
}

template <DType D>
void dequantize(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g, uint8_t* dst) {
  using E = Elem<D>;
  const size_t dim = g.head_dim;
  const uint64_t row = uint64_t(g.heads) * dim;
  const uint64_t rows = elems / row;
  for (uint64_t r0 = 0, rg = 0; r0 < rows; r0 += g.rows_per_group, ++rg) {
    const uint64_t r1 = rows - r0 < g.rows_per_group ? rows : r0 + g.rows_per_group;
    for (uint32_t h = 0; h < g.heads; ++h) {
      float scale;
      std::memcpy(&scale, scales + (rg * g.heads + h) * 4, 4);
      for (uint64_t r = r0; r < r1; ++r) {
        const uint64_t base = r * row + uint64_t(h) * dim;
        const uint8_t* in = codes + base;
        uint8_t* out = dst + base * E::kSize;
        for (size_t d = 0; d < dim; ++d) E::store(out, d, e4m3_to_f32(in[d]) * scale);
      }
    }
  }
}

// The entry points each includer exports (fp8.h declares them per namespace).
inline void quantize_any(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                         uint8_t* codes) {
  switch (dtype) {
    case DType::kBF16: return quantize<DType::kBF16>(src, elems, g, scales, codes);
    case DType::kF16: return quantize<DType::kF16>(src, elems, g, scales, codes);
    default: return quantize<DType::kF32>(src, elems, g, scales, codes);
  }
}

inline void dequantize_any(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                           DType dst_dtype, uint8_t* dst) {
  switch (dst_dtype) {
    case DType::kBF16: return dequantize<DType::kBF16>(scales, codes, elems, g, dst);
    case DType::kF16: return dequantize<DType::kF16>(scales, codes, elems, g, dst);
    default: return dequantize<DType::kF32>(scales, codes, elems, g, dst);
  }
}

}  // namespace pdkv::codec::PDKV_FP8_KERNEL_NS
