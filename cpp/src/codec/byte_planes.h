// Byte-plane split: element i's byte k goes to plane k (planes stored one after the
// other). For bf16 the high plane holds sign + 7 exponent bits, which are highly
// repetitive in KV, while the low plane is mostly mantissa noise; split, an entropy
// coder finds the repetition that interleaving hides. A trailing partial element (a
// length that is not a multiple of the element size) is carried unchanged at the end.
//
// The 2- and 4-byte loops have a fixed stride the compiler vectorises (about 10 GB/s
// per core, against a few hundred MB/s for zstd on the planes: the split is not the
// cost); `fast == false` runs the generic strided loop, the reference the tests
// compare them with (CodecKernels::kScalar).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pdkv::codec {

template <size_t E>
inline void split_fixed(const uint8_t* src, size_t n, uint8_t* dst) {
  for (size_t i = 0; i < n; ++i)
    for (size_t k = 0; k < E; ++k) dst[k * n + i] = src[i * E + k];
}

template <size_t E>
inline void merge_fixed(const uint8_t* src, size_t n, uint8_t* dst) {
  for (size_t i = 0; i < n; ++i)
    for (size_t k = 0; k < E; ++k) dst[i * E + k] = src[k * n + i];
}

inline void split_planes(const uint8_t* src, size_t len, size_t esize, uint8_t* dst, bool fast = true) {
  const size_t n = len / esize;
  if (fast && esize == 2) {
    split_fixed<2>(src, n, dst);
  } else if (fast && esize == 4) {
    split_fixed<4>(src, n, dst);
  } else {
    for (size_t k = 0; k < esize; ++k) {
      uint8_t* plane = dst + k * n;
      for (size_t i = 0; i < n; ++i) plane[i] = src[i * esize + k];
    }
  }
  std::memcpy(dst + n * esize, src + n * esize, len - n * esize);
}

inline void merge_planes(const uint8_t* src, size_t len, size_t esize, uint8_t* dst, bool fast = true) {
  const size_t n = len / esize;
  if (fast && esize == 2) {
    merge_fixed<2>(src, n, dst);
  } else if (fast && esize == 4) {
    merge_fixed<4>(src, n, dst);
  } else {
    for (size_t k = 0; k < esize; ++k) {
      const uint8_t* plane = src + k * n;
      for (size_t i = 0; i < n; ++i) dst[i * esize + k] = plane[i];
    }
  }
  std::memcpy(dst + n * esize, src + n * esize, len - n * esize);
}

}  // namespace pdkv::codec
