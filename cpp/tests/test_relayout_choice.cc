// The staging decision (core/relayout.h plan_staged) for a transport that takes
// strided runs and walks their pieces while copying (tcp): a TP head split inside NHD
// blocks goes direct (one run per (layer, part) and block range, whatever the piece
// count), NHD <-> HND is still staged (one run per head and block direct), and a
// transport that lists every extent still stages the head split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "core/relayout.h"
#include "pdkv/kv_layout.h"

namespace pdkv {
namespace {

// llama-3-70b-like blocks (16 tokens, head_dim 128, bf16), 8 layers, 512 blocks.
KVLayout pool(uint32_t heads, TokenOrder order, uint64_t base) {
  KVGeometry g;
  g.num_layers = 8;
  g.num_blocks = 512;
  g.block_tokens = 16;
  g.kv_heads = heads;
  g.head_dim = 128;
  g.dtype = DType::kBF16;
  g.order = order;
  auto r = KVLayout::contiguous(g, base, /*interleaved=*/false);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

// Block ids 0..n-1, or n of the pool's blocks in a shuffled order (an arithmetic
// progression would not do: whole blocks at a fixed stride coalesce into one run).
std::vector<uint32_t> ids(uint32_t n, bool scattered) {
  std::vector<uint32_t> v(scattered ? 512 : n);
  std::iota(v.begin(), v.end(), 0u);
  if (scattered) std::shuffle(v.begin(), v.end(), std::mt19937(7));
  v.resize(n);
  return v;
}

TEST(StagingChoice, HeadSplitGoesDirectForAStridedTransport) {
  const KVLayout wide = pool(4, TokenOrder::kNHD, 1ull << 40), narrow = pool(2, TokenOrder::kNHD, 1ull << 41);
  // Consecutive ids on both sides (one run per (layer, part)), or shuffled on both
  // (one run per block, staging would not coalesce them).
  for (bool scattered : {false, true}) {
    SCOPED_TRACE(scattered);
    const auto l = ids(256, scattered), r = ids(256, scattered);
    PlanOptions o;
    o.num_heads = 2;
    o.local_head_offset = 2;  // tp2 -> tp4 push: 512-byte pieces at a 1 KiB stride here
    auto push = plan_staged(wide, l, narrow, r, o, /*strided=*/true);
    ASSERT_TRUE(push.ok()) << push.status().to_string();
    EXPECT_FALSE(push->has_value());
    o.local_head_offset = 0;
    o.remote_head_offset = 2;  // tp4 -> tp2 pull's shape: the pieces apart on the far side
    auto pull = plan_staged(narrow, r, wide, l, o, /*strided=*/true);
    ASSERT_TRUE(pull.ok());
    EXPECT_FALSE(pull->has_value());
  }
}

TEST(StagingChoice, ScatteredLocalBlocksAgainstConsecutiveRemoteOnesAreStaged) {
  // The staging buffer is in the peer's block order: the wire then moves one run per
  // (layer, part) instead of one per block (256x fewer), which prepares faster.
  const KVLayout wide = pool(4, TokenOrder::kNHD, 1ull << 40), narrow = pool(2, TokenOrder::kNHD, 1ull << 41);
  PlanOptions o;
  o.num_heads = 2;
  o.local_head_offset = 2;
  auto push = plan_staged(wide, ids(256, true), narrow, ids(256, false), o, /*strided=*/true);
  ASSERT_TRUE(push.ok());
  EXPECT_TRUE(push->has_value());
}

TEST(StagingChoice, ListingTransportsStillStageTheHeadSplit) {
  const KVLayout wide = pool(4, TokenOrder::kNHD, 1ull << 40), narrow = pool(2, TokenOrder::kNHD, 1ull << 41);
  PlanOptions o;
  o.num_heads = 2;
  o.local_head_offset = 2;
  auto push = plan_staged(wide, ids(256, false), narrow, ids(256, false), o, /*strided=*/false);
  ASSERT_TRUE(push.ok());
  EXPECT_TRUE(push->has_value());
}

TEST(StagingChoice, RowOrderChangesAreStillStaged) {
  const KVLayout nhd = pool(8, TokenOrder::kNHD, 1ull << 40), hnd = pool(8, TokenOrder::kHND, 1ull << 41);
  auto plan = plan_staged(nhd, ids(256, false), hnd, ids(256, false), PlanOptions{}, /*strided=*/true);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->has_value());
}

}  // namespace
}  // namespace pdkv
