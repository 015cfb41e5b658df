// Bit-exact conversions between fp32 and the 16-bit float formats, round to nearest
// even (the IEEE default), used by the FP8 codec to read its input and write the
// receiver's dtype. No compiler extension (_Float16, __bf16) is needed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdkv::codec {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal (or zero) in fp16
    // Scaling by 2^24 is exact; rounding that to an integer is the subnormal mantissa
    // (1024 lands on the smallest normal, whose encoding is also 1024).
    return sign | uint16_t(std::lrint(bits_float(ax) * 16777216.0f));
  }
  const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u);
  return sign | uint16_t((r >> 13) - (112u << 10));
}

}  // namespace pdkv::codec
