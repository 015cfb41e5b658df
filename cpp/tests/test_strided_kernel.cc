// The strided-copy kernel's source (cpp/src/cuda/strided_copy.cu), compiled as host
// C++ (cuda/host_shim.h) and run over whole grids, every (block, thread) pair, on odd
// shapes: pieces of 1, 13 (fp8 rows), 15, 16, 17 ... bytes, unaligned offsets and
// strides, runs cut by append_run(); checked byte for byte against a plain loop, with
// guard bytes around every piece (nothing outside them may be written). What this
// cannot show (a GPU's speed, its memory model) bench/gpu_check.sh measures on one.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cuda/strided_copy.h"

#include "cuda/host_shim.h"  // the kernel as host code
#include "cuda/strided_copy.cu"

namespace pdkv::cuda {
namespace {

uint64_t addr(const std::vector<uint8_t>& v, uint64_t off) { return reinterpret_cast<uint64_t>(v.data()) + off; }

// Runs the kernel over runs[] as a grid x block launch.
void launch(const std::vector<StridedRun>& runs, unsigned grid, unsigned block) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned t = 0; t < block; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      pdkv_strided_copy(runs.data(), static_cast<unsigned>(runs.size()));
    }
  gridDim.x = blockDim.x = 1;
  blockIdx.x = threadIdx.x = 0;
}

struct Shape {
  uint64_t len, count, src_off, src_stride, dst_off, dst_stride;
};

void check_shape(const Shape& s, unsigned grid, unsigned block) {
  SCOPED_TRACE("len " + std::to_string(s.len) + " count " + std::to_string(s.count) + " src +" +
               std::to_string(s.src_off) + "/" + std::to_string(s.src_stride) + " dst +" + std::to_string(s.dst_off) +
               "/" + std::to_string(s.dst_stride) + " grid " + std::to_string(grid) + "x" + std::to_string(block));
  const uint64_t sbytes = s.src_off + (s.count - 1) * s.src_stride + s.len + 64;
  const uint64_t dbytes = s.dst_off + (s.count - 1) * s.dst_stride + s.len + 64;
  std::vector<uint8_t> src(sbytes), dst(dbytes, 0xA5), want(dbytes, 0xA5);
  std::mt19937 rng(static_cast<uint32_t>(s.len * 131 + s.count));
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  // Vectors' data are 16-byte aligned (operator new); offsets make them unaligned.
  ASSERT_EQ(addr(src, 0) % 16, 0u);
  ASSERT_EQ(addr(dst, 0) % 16, 0u);
  for (uint64_t i = 0; i < s.count; ++i)
    std::memcpy(&want[s.dst_off + i * s.dst_stride], &src[s.src_off + i * s.src_stride], s.len);
  std::vector<StridedRun> runs;
  append_run(runs, addr(src, s.src_off), addr(dst, s.dst_off), s.len, s.count, s.src_stride, s.dst_stride);
  for (const StridedRun& r : runs) ASSERT_LE(r.len * r.count, kStridedRunChunk);
  launch(runs, grid, block);
  EXPECT_EQ(dst, want);
}

TEST(StridedKernel, OddShapesAllAlignments) {
  const uint64_t lens[] = {1, 3, 4, 8, 13, 15, 16, 17, 24, 32, 100, 256, 4096 + 3};
  const uint64_t offs[] = {0, 1, 4, 8, 13};
  for (uint64_t len : lens)
    for (uint64_t so : offs)
      for (uint64_t dof : {uint64_t(0), uint64_t(3), uint64_t(16)}) {
        // Strides: packed-ish, padded, unaligned.
        const uint64_t ss = len + (so % 5), ds = len + 16 + dof;
        check_shape(Shape{len, 7, so, ss, dof, ds}, 3, 5);
      }
}

TEST(StridedKernel, GridShapes) {
  const Shape s{13, 1000, 5, 40, 0, 13};  // fp8 rows of 13 bytes into a packed buffer
  for (auto [g, b] : {std::pair<unsigned, unsigned>{1, 1}, {1, 256}, {7, 3}, {64, 32}, {8192, 1}})
    check_shape(s, g, b);
}

TEST(StridedKernel, TpSplitLikeRuns) {
  // A tp4 -> tp2 head split: 512-byte pieces from a 1024-byte stride, 16-byte aligned
  // (the vector path), many more pieces than one work unit holds.
  check_shape(Shape{512, 3000, 0, 1024, 512, 2048}, 16, 64);
  // Pieces bigger than a work unit: cut by bytes.
  check_shape(Shape{(kStridedRunChunk * 2) + 48, 3, 16, (kStridedRunChunk * 3), 0, (kStridedRunChunk * 2) + 48}, 5, 32);
}

TEST(StridedKernel, AppendRunCuts) {
  std::vector<StridedRun> runs;
  append_run(runs, 0x1000, 0x2000, 256, 1000, 1024, 256);  // 256 pieces per unit
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].count, kStridedRunChunk / 256);
  EXPECT_EQ(runs[3].count, 1000 - 3 * (kStridedRunChunk / 256));
  EXPECT_EQ(runs[1].src, 0x1000 + 256 * 1024u);
  EXPECT_EQ(runs[1].dst, 0x2000 + 256 * 256u);
  runs.clear();
  append_run(runs, 0, 0, 100, 5, 100, 100);  // back to back on both sides: one piece
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].len, 500u);
  EXPECT_EQ(runs[0].count, 1u);
  runs.clear();
  append_run(runs, 0, 0, 0, 5, 1, 1);  // nothing
  append_run(runs, 0, 0, 5, 0, 1, 1);
  EXPECT_TRUE(runs.empty());
}

TEST(StridedKernel, ProgressionsFromIovecs) {
  std::vector<char> mem(1 << 16);
  char* b = mem.data();
  std::vector<iovec> v = {{b, 10}, {b + 40, 10}, {b + 80, 10}, {b + 120, 10},  // a run of 4, stride 40
                          {b + 130, 7},                                         // alone
                          {b + 200, 16}, {b + 216, 16},                         // touching: stride 16
                          {b + 100, 16}};                                       // going back: alone
  std::vector<std::tuple<size_t, size_t, uint64_t>> got;
  for_each_progression(v.data(), v.size(), [&](size_t f, size_t k, uint64_t s) { got.emplace_back(f, k, s); });
  const std::vector<std::tuple<size_t, size_t, uint64_t>> want = {{0, 4, 40}, {4, 1, 0}, {5, 2, 16}, {7, 1, 0}};
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace pdkv::cuda
