// The tcp scatter/gather helper (transport/tcp/scatter.h) and the strided piece copy
// (util/piece_copy.h): pieces under and over one 64-byte streaming block, 16-byte
// tails, unaligned destinations (the memcpy fallback), chunks that end inside a
// piece, mixed runs; nothing outside the pieces is written. The lazy walk of strided
// runs (PieceRun) is checked against the same pieces listed one by one.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <numeric>
#include <random>
#include <vector>

#include "pdkv/options/tcp.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/scatter.h"
#include "util/piece_copy.h"

namespace pdkv::tcp {
namespace {

// `lens` pieces laid out in `pool` at `stride` bytes apart (stride >= every len), with
// guard bytes between them that must never change.
struct Pieces {
  std::vector<char> pool;
  std::vector<iovec> iov;
  uint64_t bytes = 0;

  Pieces(const std::vector<size_t>& lens, size_t stride) : pool(lens.size() * stride + 64, '\x5a') {
    for (size_t i = 0; i < lens.size(); ++i) {
      iov.push_back({pool.data() + i * stride + 32, lens[i]});
      bytes += lens[i];
    }
  }
  // The bytes of every piece in order.
  std::vector<char> joined() const {
    std::vector<char> out;
    for (const iovec& v : iov)
      out.insert(out.end(), static_cast<const char*>(v.iov_base), static_cast<const char*>(v.iov_base) + v.iov_len);
    return out;
  }
  // True when every byte outside the pieces is still the guard value.
  bool guards_intact() const {
    std::vector<bool> inside(pool.size(), false);
    for (const iovec& v : iov) {
      const size_t at = static_cast<size_t>(static_cast<const char*>(v.iov_base) - pool.data());
      for (size_t k = 0; k < v.iov_len; ++k) inside[at + k] = true;
    }
    for (size_t k = 0; k < pool.size(); ++k)
      if (!inside[k] && pool[k] != '\x5a') return false;
    return true;
  }
};

std::vector<char> random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> out(n);
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

// Scatters `src` into the pieces in chunks of `chunk` bytes (the receiver's landing
// reads), then checks the pieces hold `src` and nothing else was written.
void scatter_in_chunks(Pieces& p, const std::vector<char>& src, uint64_t chunk) {
  IovCursor cur;
  for (uint64_t at = 0; at < src.size(); at += chunk) {
    const uint64_t n = std::min<uint64_t>(chunk, src.size() - at);
    scatter_to_iov(p.iov.data(), p.iov.size(), cur, src.data() + at, n);
  }
  EXPECT_EQ(cur.idx, p.iov.size());
  EXPECT_EQ(cur.off, 0u);
  EXPECT_EQ(p.joined(), src);
  EXPECT_TRUE(p.guards_intact());
}

TEST(TcpScatter, EveryCommonPieceSizeAndOthers) {
  for (size_t len : {64, 100, 256, 512, 768, 1024, 2048, 4096, 5000}) {
    SCOPED_TRACE(len);
    Pieces p(std::vector<size_t>(40, len), 2 * len + 64);
    const auto src = random_bytes(p.bytes, static_cast<uint32_t>(len));
    scatter_in_chunks(p, src, p.bytes);  // one chunk
  }
}

TEST(TcpScatter, ChunksThatEndInsideAPiece) {
  for (uint64_t chunk : {1ull, 7ull, 511ull, 512ull, 513ull, 4095ull, 65536ull}) {
    SCOPED_TRACE(chunk);
    Pieces p(std::vector<size_t>(64, 512), 1024);
    const auto src = random_bytes(p.bytes, static_cast<uint32_t>(chunk));
    scatter_in_chunks(p, src, chunk);
  }
}

TEST(TcpScatter, MixedSizesSwitchBetweenLoops) {
  std::vector<size_t> lens;
  for (int i = 0; i < 30; ++i) lens.insert(lens.end(), {512, 512, 512, 300, 256, 256, 4096, 1, 1024});
  Pieces p(lens, 4096 + 64);
  const auto src = random_bytes(p.bytes, 3);
  scatter_in_chunks(p, src, 3000);
}

TEST(TcpScatter, GatherIsTheInverse) {
  std::vector<size_t> lens;
  for (int i = 0; i < 50; ++i) lens.insert(lens.end(), {512, 512, 2048, 77, 256});
  Pieces p(lens, 2048 + 64);
  const auto want = random_bytes(p.bytes, 9);
  {
    IovCursor cur;
    scatter_to_iov(p.iov.data(), p.iov.size(), cur, want.data(), want.size());
  }
  for (size_t cap : {size_t(1), size_t(500), size_t(4096), size_t(1) << 20}) {
    SCOPED_TRACE(cap);
    std::vector<char> got;
    std::vector<char> buf(cap);
    IovCursor cur;
    for (;;) {
      const size_t n = gather_from_iov(p.iov.data(), p.iov.size(), cur, buf.data(), cap);
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
      if (n < cap) break;
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ(gather_from_iov(p.iov.data(), p.iov.size(), cur, buf.data(), cap), 0u);  // at the end: nothing
  }
}

TEST(TcpScatter, UnalignedDestinationsFallBackToMemcpy) {
  // Pieces of 600 bytes at a 1000-byte stride from 8 bytes into the pool: no
  // destination is 16-byte aligned.
  Pieces p(std::vector<size_t>(50, 600), 1000);
  for (iovec& v : p.iov) v.iov_base = static_cast<char*>(v.iov_base) + 8;
  const auto src = random_bytes(p.bytes, 4);
  scatter_in_chunks(p, src, 1500);
}

// Strided runs of several shapes in one pool: plain extents, runs of pieces apart
// (512 B at 1 KiB: a TP head split), pieces of odd lengths, a single-piece run.
struct Runs {
  std::vector<char> pool = std::vector<char>(1 << 20, '\x5a');
  std::vector<PieceRun> runs;
  Pieces listed{{}, 1};  // the same pieces, one iovec each (their guards checked by pool)

  Runs() {
    char* at = pool.data() + 64;
    auto add = [&](uint64_t len, uint64_t count, uint64_t stride) {
      runs.push_back(PieceRun{at, len, count, stride});
      at += (count - 1) * stride + len + 96;
    };
    add(512, 40, 1024);
    add(3000, 1, 0);
    add(100, 17, 333);
    add(4096, 3, 8192);
    add(512, 1, 0);
    add(64, 50, 128);
    add(1, 9, 2);
    listed.iov.clear();
    append_iovecs(runs.data(), runs.size(), listed.iov);
    for (const iovec& v : listed.iov) listed.bytes += v.iov_len;
  }
  std::vector<char> joined() const { return listed.joined(); }
  bool guards_intact() const {
    std::vector<bool> inside(pool.size(), false);
    for (const iovec& v : listed.iov) {
      const size_t at = static_cast<size_t>(static_cast<const char*>(v.iov_base) - pool.data());
      for (size_t k = 0; k < v.iov_len; ++k) inside[at + k] = true;
    }
    for (size_t k = 0; k < pool.size(); ++k)
      if (!inside[k] && pool[k] != '\x5a') return false;
    return true;
  }
};

TEST(TcpScatterRuns, ListingGivesEveryPieceInOrder) {
  Runs r;
  uint64_t pieces = 0;
  for (const PieceRun& run : r.runs) pieces += run.extents();
  EXPECT_EQ(r.listed.iov.size(), pieces);
  EXPECT_EQ(r.listed.iov.size(), 40u + 1 + 17 + 3 + 1 + 50 + 9);
  EXPECT_EQ(static_cast<char*>(r.listed.iov[1].iov_base) - static_cast<char*>(r.listed.iov[0].iov_base), 1024);
  // Pieces that touch are one extent.
  PieceRun touching{r.pool.data(), 512, 8, 512};
  EXPECT_EQ(touching.extents(), 1u);
}

TEST(TcpScatterRuns, ScatterInChunksLandsEveryPiece) {
  for (uint64_t chunk : {1ull, 7ull, 511ull, 512ull, 513ull, 4095ull, 65536ull, 1ull << 20}) {
    SCOPED_TRACE(chunk);
    Runs r;
    const auto src = random_bytes(r.listed.bytes, static_cast<uint32_t>(chunk));
    RunCursor cur;
    for (uint64_t at = 0; at < src.size(); at += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, src.size() - at);
      scatter_to_runs(r.runs.data(), r.runs.size(), cur, src.data() + at, n);
    }
    EXPECT_EQ(cur.idx, r.runs.size());
    EXPECT_EQ(cur.piece, 0u);
    EXPECT_EQ(cur.off, 0u);
    EXPECT_EQ(r.joined(), src);
    EXPECT_TRUE(r.guards_intact());
  }
}

TEST(TcpScatterRuns, GatherIsTheInverseAndMatchesTheList) {
  Runs r;
  const auto want = random_bytes(r.listed.bytes, 11);
  {
    RunCursor cur;
    scatter_to_runs(r.runs.data(), r.runs.size(), cur, want.data(), want.size());
  }
  for (size_t cap : {size_t(1), size_t(500), size_t(512), size_t(4096), size_t(256) << 10}) {
    SCOPED_TRACE(cap);
    std::vector<char> got, listed;
    std::vector<char> buf(cap);
    RunCursor cur;
    IovCursor icur;
    for (;;) {
      const size_t n = gather_from_runs(r.runs.data(), r.runs.size(), cur, buf.data(), cap);
      got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
      const size_t m = gather_from_iov(r.listed.iov.data(), r.listed.iov.size(), icur, buf.data(), cap);
      listed.insert(listed.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(m));
      EXPECT_EQ(n, m);  // chunk for chunk the same cut as the listed pieces
      if (n < cap) break;
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ(listed, want);
    EXPECT_EQ(gather_from_runs(r.runs.data(), r.runs.size(), cur, buf.data(), cap), 0u);
  }
}

// An OutMsg over runs gathers when its pieces are small, and lists them (the kernel
// reads them in place) when they are large, as it would for the same pieces listed.
TEST(TcpScatterRuns, OutMsgGathersSmallPiecesAndListsLargeOnes) {
  std::vector<char> pool(1 << 20);
  OutMsg small;
  small.own_runs.push_back(PieceRun{pool.data(), 512, 100, 1024});
  small.gather_below = TcpOptions{}.gather_below_bytes;
  small.finalize();
  EXPECT_TRUE(small.gather);
  EXPECT_TRUE(small.own_iov.empty());
  EXPECT_EQ(small.total, kHdr + 512 * 100);

  OutMsg large;
  large.own_runs.push_back(PieceRun{pool.data(), 16384, 10, 32768});
  large.gather_below = TcpOptions{}.gather_below_bytes;
  large.finalize();
  EXPECT_FALSE(large.gather);
  EXPECT_EQ(large.ndata, 10u);
  EXPECT_EQ(large.runs, nullptr);
  EXPECT_EQ(large.total, kHdr + 16384 * 10);
}

TEST(PieceCopy, StridedCopyEveryShape) {
  for (size_t len : {13, 64, 80, 512, 600, 2000, 8192}) {
    for (size_t misalign : {0, 8}) {
      SCOPED_TRACE(std::to_string(len) + " +" + std::to_string(misalign));
      const uint64_t count = 37, dstride = len * 2 + 48, sstride = len + 16;
      std::vector<char> src = random_bytes(count * sstride, static_cast<uint32_t>(len));
      std::vector<char> dst(count * dstride + 64, '\x5a');
      char* d = dst.data() + 32 + misalign;
      util::copy_strided(d, dstride, src.data(), sstride, len, count);
      std::vector<char> want(dst.size(), '\x5a');
      for (uint64_t i = 0; i < count; ++i)
        std::memcpy(want.data() + 32 + misalign + i * dstride, src.data() + i * sstride, len);
      EXPECT_EQ(dst, want);
    }
  }
}

TEST(TcpScatter, LandingThresholdTakesTheTpSplitPieces) {
  // A TP head split at llama-3-70b-tp8 geometry lands 512-byte pieces in a buffer, and
  // so do its 4 KiB block-halves (bench/results/tcpperf/pinned/land-below-ab.txt);
  // extents of 8 KiB and more go straight into place, and so does a single extent.
  const uint64_t below = TcpOptions{}.land_below_bytes;
  EXPECT_TRUE(lands(1000 * 512, 1000, below));
  EXPECT_TRUE(lands(1000 * 1024, 1000, below));
  EXPECT_TRUE(lands(1000 * 4096, 1000, below));
  EXPECT_FALSE(lands(1000 * 8192, 1000, below));
  EXPECT_FALSE(lands(1000 * 32768, 1000, below));
  EXPECT_FALSE(lands(100, 1, below));
}

}  // namespace
}  // namespace pdkv::tcp
