// util/piece_copy.h: every store width this CPU has copies every piece shape bit for
// bit and writes nothing outside the pieces (a destination not 16-byte aligned, a
// head before the first 32/64-byte boundary, a tail under 16 bytes).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "util/piece_copy.h"

namespace pdkv::util {
namespace {

std::vector<PieceStores> kinds_here() {
  std::vector<PieceStores> k = {PieceStores::kMemcpy};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  k.push_back(PieceStores::kSse);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) k.push_back(PieceStores::kAvx2);
  if (__builtin_cpu_supports("avx512f")) k.push_back(PieceStores::kAvx512);
#endif
  return k;
}

std::vector<char> random_bytes(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& c : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<char>(x);
  }
  return v;
}

// A buffer whose data() + pad is 64-byte aligned.
struct Aligned {
  explicit Aligned(size_t n) : raw(n + 128, '\x5a') {
    off = (64 - (reinterpret_cast<uintptr_t>(raw.data()) & 63)) & 63;
  }
  char* at(size_t i) { return raw.data() + off + i; }
  std::vector<char> raw;
  size_t off = 0;
};

TEST(PieceCopy, EveryStoreWidthEveryShape) {
  for (PieceStores how : kinds_here()) {
    for (size_t len : {13, 16, 48, 64, 80, 100, 112, 512, 528, 600, 2000, 8192}) {
      for (size_t dmis : {0, 8, 16, 32, 48}) {
        for (size_t smis : {0, 3}) {
          SCOPED_TRACE("stores " + std::to_string(static_cast<int>(how)) + " len " + std::to_string(len) + " dst +" +
                       std::to_string(dmis) + " src +" + std::to_string(smis));
          const uint64_t count = 21, dstride = len * 2 + 64, sstride = len + 48;
          const std::vector<char> src = random_bytes(count * sstride + 8, static_cast<uint32_t>(len + dmis));
          Aligned dst(count * dstride + 64);
          copy_strided_with(how, dst.at(dmis), dstride, src.data() + smis, sstride, len, count);
          std::vector<char> want(dst.raw.size(), '\x5a');
          for (uint64_t i = 0; i < count; ++i)
            std::memcpy(want.data() + dst.off + dmis + i * dstride, src.data() + smis + i * sstride, len);
          ASSERT_EQ(dst.raw, want);
        }
      }
    }
  }
}

TEST(PieceCopy, StridedCopiesAndPiecesTakeTheWidestStores) {
  const PieceStores s = piece_stores();
  const std::vector<PieceStores> k = kinds_here();
  if (bench_switch_is(util::BenchSwitch::kPieceCopy, "memcpy")) {
    EXPECT_EQ(s, PieceStores::kMemcpy);
  } else if (bench_switch_is(util::BenchSwitch::kPieceCopy, "sse")) {
    EXPECT_EQ(s, PieceStores::kSse);
  } else {
    EXPECT_EQ(s, k.back());
  }
  // stream_piece() (tcp's scatter and gather, the staging copies) takes the same stores.
  EXPECT_EQ(stream_pieces(), s != PieceStores::kMemcpy);
}

}  // namespace
}  // namespace pdkv::util
