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

#include "util/bench_switches.h"

#if defined(__x86_64__) || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pdkv::util {

// How stream_piece() writes a piece.
enum class PieceStores {
  kMemcpy,  // a plain memcpy per piece (benchmark switch BenchSwitch::kPieceCopy=memcpy)
  kSse,     // 16-byte streaming stores (BenchSwitch::kPieceCopy=sse; every x86-64)
  kAvx2,    // 32-byte streaming stores
  kAvx512,  // 64-byte streaming stores: one instruction per cache line
};

// Why the widest stores (copy_strided(), the shm copy): a line written by four 16-byte non-temporal stores leaves
// the write-combining buffer as one line only when all four arrive before it is
// flushed; a 64-byte store writes the whole line at once. Measured on the 2-core dev
// VM (Xeon, AVX-512), 64 MiB of 512-byte pieces read at a 1 KiB stride into 8 KiB
// destination runs (a TP2 -> TP4 push), against memcpy of the same bytes as 8 KiB
// runs, thread CPU time: 16-byte 0.77x, 32-byte 0.90-0.94x, 64-byte 0.98-1.01x
// (bench/piece_copy_bench.cc; docs/benchmarks.md "Full-line streaming stores").
//
// The widest the CPU has, unless the benchmark switch BenchSwitch::kPieceCopy=memcpy or
// =sse asks for an older path (read once per process; docs/benchmarks.md), to compare
// them in one build.
inline PieceStores piece_stores() {
  static const PieceStores s = [] {
    if (bench_switch_is(util::BenchSwitch::kPieceCopy, "memcpy")) return PieceStores::kMemcpy;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (bench_switch_is(util::BenchSwitch::kPieceCopy, "sse")) return PieceStores::kSse;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return PieceStores::kAvx512;
    if (__builtin_cpu_supports("avx2")) return PieceStores::kAvx2;
    return PieceStores::kSse;
#elif defined(__SSE2__)
    return PieceStores::kSse;
#else
    return PieceStores::kMemcpy;
#endif
  }();
  return s;
}

// The stores of stream_piece() (the tcp landing scatter and gather, the staging
// copies): the widest the CPU has too, as copy_strided's. Measured on a quiet machine
// (load ~1; bench/results/hetero/tcp-quiet/wide-vs-sse.txt: tp2:tp4, tp4:tp2, nhd:hnd at
// llama-3-8b and llama-3-70b-tp8, push and pull, 3 rounds, 16-byte stores
// (BenchSwitch::kPieceCopy=sse) and wide back to back): 0.787x -> 0.824x the homogeneous
// transfer on average over the 36 pairs each, better in 8 of the 12 groups; an earlier
// comparison at load 8-19 was within noise.

// False when stream_piece() copies by plain memcpy.
inline bool stream_pieces() { return piece_stores() != PieceStores::kMemcpy; }

namespace piece_copy_detail {

#if defined(__SSE2__)
// 16-byte streaming stores from `to + i` (16-byte aligned) while `to + i` is below
// `stop` bytes; returns the new i.
inline size_t stream16(char* to, const char* from, size_t i, size_t stop) {
  for (; i + 16 <= stop; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
  return i;
}

// Bytes from `to` (16-byte aligned) to the next `align`-byte boundary, at most len
// rounded down to 16.
inline size_t head_to(const char* to, size_t len, size_t align) {
  const size_t head = (align - (reinterpret_cast<uintptr_t>(to) & (align - 1))) & (align - 1);
  return head < (len & ~size_t(15)) ? head : (len & ~size_t(15));
}

inline size_t stream_sse(char* to, const char* from, size_t len) {
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
  return stream16(to, from, i, len);
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) inline size_t stream_avx2(char* to, const char* from, size_t len) {
  size_t i = stream16(to, from, 0, head_to(to, len, 32));
  for (; i + 64 <= len; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i + 32), b);
  }
  return stream16(to, from, i, len);
}

__attribute__((target("avx512f"))) inline size_t stream_avx512(char* to, const char* from, size_t len) {
  size_t i = stream16(to, from, 0, head_to(to, len, 64));
  for (; i + 64 <= len; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(to + i), _mm512_loadu_si512(from + i));
  return stream16(to, from, i, len);
}
#endif

}  // namespace piece_copy_detail

// stream_piece() with the stores `how` (piece_stores() unless a test picks one; a
// kind this CPU lacks must not be passed).
inline void stream_piece_with(PieceStores how, char* to, const char* from, size_t len) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(to) & 15) == 0 && len >= 64 && how != PieceStores::kMemcpy) {
    size_t i = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (how == PieceStores::kAvx512)
      i = piece_copy_detail::stream_avx512(to, from, len);
    else if (how == PieceStores::kAvx2)
      i = piece_copy_detail::stream_avx2(to, from, len);
    else
#endif
      i = piece_copy_detail::stream_sse(to, from, len);
    if (i < len) std::memcpy(to + i, from + i, len - i);
    return;
  }
#endif
  (void)how;
  std::memcpy(to, from, len);
}

// Copies `len` bytes from `from` to `to` with streaming stores of piece_stores()'s
// width where `to` is 16-byte aligned and len is 64 or more (the tail the stores leave,
// and an unaligned `to` or a shorter piece, by memcpy).
// Follow a series of these with stream_fence().
inline void stream_piece(char* to, const char* from, size_t len) { stream_piece_with(piece_stores(), to, from, len); }

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
// dst + i * dst_stride, with the stores `how`, without a fence: follow a series of
// these with stream_fence(). The pieces must not overlap across src and dst.
//
// Why not a fence per call: an sfence waits until every write-combining buffer has
// drained, so a fence after each run of 16 pieces stalls the loop 8 times per 32 KiB
// block. Measured on the 2-core dev VM (AMD EPYC, Zen 4), an NHD -> HND block copy
// (16 tokens x 8 heads x 256 B, 64 MiB and 1 GiB): 1.59-1.79x the homogeneous memcpy's
// CPU with a fence per run of one head, 1.36x with one fence per block.
inline void copy_strided_unfenced(PieceStores how, char* dst, uint64_t dst_stride, const char* src,
                                  uint64_t src_stride, uint64_t len, uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    if (i + kPiecePrefetchAhead < count) __builtin_prefetch(src + (i + kPiecePrefetchAhead) * src_stride, 0);
    stream_piece_with(how, dst + i * dst_stride, src + i * src_stride, static_cast<size_t>(len));
  }
}

// copy_strided_unfenced(), then the fence.
inline void copy_strided_with(PieceStores how, char* dst, uint64_t dst_stride, const char* src, uint64_t src_stride,
                              uint64_t len, uint64_t count) {
  copy_strided_unfenced(how, dst, dst_stride, src, src_stride, len, count);
  stream_fence();
}

// copy_strided_with() the stores piece_stores() picks (the widest).
inline void copy_strided(char* dst, uint64_t dst_stride, const char* src, uint64_t src_stride, uint64_t len,
                         uint64_t count) {
  copy_strided_with(piece_stores(), dst, dst_stride, src, src_stride, len, count);
}

}  // namespace pdkv::util
