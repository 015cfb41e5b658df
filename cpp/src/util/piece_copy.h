// Copies of many small pieces into their final place (a heterogeneous transfer's
// head rows: 256 B to a few KiB each, at a stride), shared by the tcp receiver's
// scatter (transport/tcp/scatter.h) and the shm strided copy loop
// (transport/shm/copy_engine.cc).
//
// Why streaming stores: a regular store to a line not in the cache first reads the
// line (read for ownership). For contiguous destinations memcpy's large-copy path
// avoids that, but a piece of a few hundred bytes at a stride gets regular stores:
// every destination line is read, then written, then evicted. Non-temporal stores
// write whole lines without reading them and leave the cache to the socket buffers
// and the sources. Measured on the 2-core dev VM, 64 MiB into 512-byte pieces at a
// 1 KiB stride from a cache-resident buffer: 5-8 GB/s against 2.2-2.9 GB/s for a
// memcpy per piece (256 B to 8 KiB pieces: 2-3x). The destination is the transfer's
// target memory, which nobody reads until the transfer completes, so bypassing the
// cache costs nothing there.
//
// Stores are ordered by stream_fence(): call it before anything tells another
// thread or process that the bytes have landed.
//
// Thread safety: pure functions over the caller's memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "util/bench_switch.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace pdkv::util {

// False when the benchmark switch PDKV_BENCH_PIECE_COPY=memcpy asks for a plain
// memcpy per piece instead (read once per process; docs/benchmarks.md), to compare
// both in one build.
inline bool stream_pieces() {
  static const bool on = !bench_switch_is("PDKV_BENCH_PIECE_COPY", "memcpy");
  return on;
}

// Copies `len` bytes from `from` to `to` with streaming stores where `to` is 16-byte
// aligned (the tail under 16 bytes, and an unaligned `to`, by memcpy). Follow a
// series of these with stream_fence().
inline void stream_piece(char* to, const char* from, size_t len) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(to) & 15) == 0 && len >= 64 && stream_pieces()) {
    size_t i = 0;
    for (; i + 64 <= len; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
    }
    for (; i + 16 <= len; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
    if (i < len) std::memcpy(to + i, from + i, len - i);
    return;
  }
#endif
  std::memcpy(to, from, len);
}

// Orders the streaming stores before every later store (the "landed" signal).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// How many pieces ahead the strided loop prefetches its source (scattered: the
// hardware prefetcher cannot guess it).
inline constexpr uint64_t kPiecePrefetchAhead = 8;

// Copies `count` pieces of `len` bytes, piece i from src + i * src_stride to
// dst + i * dst_stride, then fences. The pieces must not overlap across src and dst.
inline void copy_strided(char* dst, uint64_t dst_stride, const char* src, uint64_t src_stride, uint64_t len,
                         uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    if (i + kPiecePrefetchAhead < count) __builtin_prefetch(src + (i + kPiecePrefetchAhead) * src_stride, 0);
    stream_piece(dst + i * dst_stride, src + i * src_stride, static_cast<size_t>(len));
  }
  stream_fence();
}

}  // namespace pdkv::util
