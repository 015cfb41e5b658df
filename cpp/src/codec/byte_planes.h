// Byte-plane split: element i's byte k goes to plane k (planes stored one after the
// other). For bf16 the high plane holds sign + 7 exponent bits, which are highly
// repetitive in KV, while the low plane is mostly mantissa noise; split, an entropy
// coder finds the repetition that interleaving hides. A trailing partial element (a
// length that is not a multiple of the element size) is carried unchanged at the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pdkv::codec {

inline void split_planes(const uint8_t* src, size_t len, size_t esize, uint8_t* dst) {
  const size_t n = len / esize;
  if (esize == 2) {
    uint8_t* lo = dst;
    uint8_t* hi = dst + n;
    for (size_t i = 0; i < n; ++i) {
      lo[i] = src[2 * i];
      hi[i] = src[2 * i + 1];
    }
  } else {
    for (size_t k = 0; k < esize; ++k) {
      uint8_t* plane = dst + k * n;
      for (size_t i = 0; i < n; ++i) plane[i] = src[i * esize + k];
    }
  }
  std::memcpy(dst + n * esize, src + n * esize, len - n * esize);
}

inline void merge_planes(const uint8_t* src, size_t len, size_t esize, uint8_t* dst) {
  const size_t n = len / esize;
  if (esize == 2) {
    const uint8_t* lo = src;
    const uint8_t* hi = src + n;
    for (size_t i = 0; i < n; ++i) {
      dst[2 * i] = lo[i];
      dst[2 * i + 1] = hi[i];
    }
  } else {
    for (size_t k = 0; k < esize; ++k) {
      const uint8_t* plane = src + k * n;
      for (size_t i = 0; i < n; ++i) dst[i * esize + k] = plane[i];
    }
  }
  std::memcpy(dst + n * esize, src + n * esize, len - n * esize);
}

}  // namespace pdkv::codec
