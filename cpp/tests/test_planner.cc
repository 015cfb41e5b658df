// The extent planner (plan_blocks) against a reference computed row by row.
//
// Layouts here are unbound, so extents carry absolute (made-up) addresses and nothing
// is dereferenced. The reference maps every (segment, token, head) row of head_dim
// elements from its local address to its remote address; the planner's extents,
// expanded into rows, must give exactly the same set, and coalescing must leave no two
// neighbouring extents that continue each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pdkv/kv_layout.h"

namespace pdkv {
namespace {

struct Pool {
  KVGeometry geo;
  KVLayout layout;
};

// Per-layer K and V arrays, each at its own base far from the others.
Pool make_pool(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint32_t layers = 2, uint32_t blocks = 8,
               uint32_t head_dim = 4, uint64_t base = 1ull << 32) {
  KVGeometry g;
  g.num_layers = layers;
  g.num_blocks = blocks;
  g.block_tokens = block_tokens;
  g.kv_heads = heads;
  g.head_dim = head_dim;
  g.dtype = DType::kF16;
  g.order = order;
  std::vector<uint64_t> k, v;
  for (uint32_t l = 0; l < layers; ++l) {
    k.push_back(base + (2 * l) * (1ull << 24));
    v.push_back(base + (2 * l + 1) * (1ull << 24));
  }
  auto r = KVLayout::per_layer(g, k, v);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return Pool{g, std::move(r).value()};
}

using Rows = std::vector<std::pair<uint64_t, uint64_t>>;  // (local address, remote address)

uint64_t row_bytes(const KVGeometry& g) { return uint64_t(g.head_dim) * dtype_size(g.dtype); }

uint64_t row_addr(const Pool& p, size_t seg, const std::vector<uint32_t>& ids, uint64_t t, uint64_t h) {
  const KVGeometry& g = p.geo;
  const KVSegment& s = p.layout.segments()[seg];
  const uint64_t block = ids[t / g.block_tokens], slot = t % g.block_tokens;
  const uint64_t in_block = g.order == TokenOrder::kNHD ? (slot * g.kv_heads + h) : (h * g.block_tokens + slot);
  return s.addr + block * s.block_stride + in_block * row_bytes(g);
}

// What the transfer must move: every token < ntok and head < nh of every segment.
Rows reference(const Pool& l, const std::vector<uint32_t>& lids, const Pool& r, const std::vector<uint32_t>& rids,
               uint64_t ntok, uint32_t nh, uint32_t lho = 0, uint32_t rho = 0) {
  Rows out;
  for (size_t s = 0; s < l.layout.segments().size(); ++s)
    for (uint64_t t = 0; t < ntok; ++t)
      for (uint32_t h = 0; h < nh; ++h) out.emplace_back(row_addr(l, s, lids, t, lho + h), row_addr(r, s, rids, t, rho + h));
  std::sort(out.begin(), out.end());
  return out;
}

Rows expand(const std::vector<Extent>& ex, uint64_t row) {
  Rows out;
  for (const Extent& e : ex) {
    EXPECT_EQ(e.local_region, KVSegment::kUnbound);
    EXPECT_EQ(e.remote_region, KVSegment::kUnbound);
    EXPECT_EQ(e.len % row, 0u);
    for (uint64_t k = 0; k < e.len; k += row) out.emplace_back(e.local_offset + k, e.remote_offset + k);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void expect_coalesced(const std::vector<Extent>& ex) {
  for (size_t i = 1; i < ex.size(); ++i)
    EXPECT_FALSE(ex[i - 1].local_offset + ex[i - 1].len == ex[i].local_offset &&
                 ex[i - 1].remote_offset + ex[i - 1].len == ex[i].remote_offset)
        << "extents " << i - 1 << " and " << i << " continue each other";
}

std::vector<Extent> plan_ok(const Pool& l, const std::vector<uint32_t>& lids, const Pool& r,
                            const std::vector<uint32_t>& rids, const PlanOptions& o = {}) {
  auto res = plan_blocks(l.layout, lids, r.layout, rids, o);
  EXPECT_TRUE(res.ok()) << res.status().to_string();
  return res.ok() ? std::move(res).value() : std::vector<Extent>{};
}

TEST(Planner, ConsecutiveIdsCoalesceIntoOneExtentPerSegment) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  std::vector<uint32_t> lids{2, 3, 4, 5}, rids{0, 1, 2, 3};
  auto ex = plan_ok(a, lids, b, rids);
  ASSERT_EQ(ex.size(), a.layout.segments().size());
  for (const Extent& e : ex) EXPECT_EQ(e.len, 4 * a.geo.block_half_bytes());
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 16, 2));
}

TEST(Planner, OneBreakInTheRunSplitsEachSegmentInTwo) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  std::vector<uint32_t> lids{0, 1, 2, 3}, rids{4, 5, 0, 1};
  auto ex = plan_ok(a, lids, b, rids);
  EXPECT_EQ(ex.size(), 2 * a.layout.segments().size());
  expect_coalesced(ex);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 16, 2));
}

TEST(Planner, BlockSizeChangeMapsEveryToken) {
  Pool a = make_pool(8, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  std::vector<uint32_t> lids{3, 1}, rids{6, 7, 2, 0};  // 16 tokens on both sides
  auto ex = plan_ok(a, lids, b, rids);
  expect_coalesced(ex);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 16, 2));
  // Block 3's two halves land in adjacent blocks 6, 7: one extent per segment for it.
  EXPECT_EQ(ex.size(), 3 * a.layout.segments().size());
}

TEST(Planner, NhdToHndTransposesEveryRow) {
  Pool a = make_pool(4, 3, TokenOrder::kNHD), b = make_pool(4, 3, TokenOrder::kHND);
  std::vector<uint32_t> lids{0, 5}, rids{7, 2};
  auto ex = plan_ok(a, lids, b, rids);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 8, 3));
  auto back = plan_ok(b, rids, a, lids);
  EXPECT_EQ(expand(back, row_bytes(a.geo)), reference(b, rids, a, lids, 8, 3));
}

TEST(Planner, HndToHndWithDifferentBlockSizesKeepsHeadRunsContiguous) {
  Pool a = make_pool(8, 2, TokenOrder::kHND), b = make_pool(4, 2, TokenOrder::kHND);
  std::vector<uint32_t> lids{1}, rids{4, 5};
  auto ex = plan_ok(a, lids, b, rids);
  expect_coalesced(ex);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 8, 2));
}

TEST(Planner, ExplicitHeadSplitMovesOnlyThatRange) {
  // TP: a 4-head prefill rank feeds heads [2, 4) into a 2-head decode rank.
  Pool a = make_pool(4, 4, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kHND);
  std::vector<uint32_t> lids{0, 1}, rids{3, 6};
  PlanOptions o;
  o.num_heads = 2;
  o.local_head_offset = 2;
  auto ex = plan_ok(a, lids, b, rids, o);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 8, 2, 2, 0));
}

TEST(Planner, ExplicitTokenCountMovesOnlyThoseTokens) {
  Pool a = make_pool(8, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  std::vector<uint32_t> lids{2, 3}, rids{0, 1, 2};  // 16 vs 12 tokens: 11 asked for
  PlanOptions o;
  o.num_tokens = 11;
  auto ex = plan_ok(a, lids, b, rids, o);
  EXPECT_EQ(expand(ex, row_bytes(a.geo)), reference(a, lids, b, rids, 11, 2));
}

// ---- mismatches without an explicit plan are errors naming both geometries

void expect_mismatch(const Pool& a, const std::vector<uint32_t>& lids, const Pool& b,
                     const std::vector<uint32_t>& rids, const std::string& must_mention) {
  auto res = plan_blocks(a.layout, lids, b.layout, rids, {});
  ASSERT_FALSE(res.ok()) << "a partial plan was accepted";
  EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = res.status().message();
  EXPECT_NE(m.find(must_mention), std::string::npos) << m;
}

TEST(Planner, LayerRangeMovesOnlyThoseLayersSegments) {
  // Same shape and a head split: both planner paths honour the range.
  for (uint32_t heads : {2u, 3u}) {
    Pool a = make_pool(4, heads, TokenOrder::kNHD, /*layers=*/4), b = make_pool(4, 2, TokenOrder::kHND, 4);
    std::vector<uint32_t> ids{0, 1};
    PlanOptions o;
    o.num_heads = 2;
    o.first_layer = 1;
    o.num_layers = 2;
    auto ex = plan_ok(a, ids, b, ids, o);
    Rows want = reference(a, ids, b, ids, 8, 2);
    // Keep only segments of layers 1 and 2 (segment index = layer * 2 + part).
    Rows kept;
    for (const auto& row : want) {
      for (size_t s = 2; s < 6; ++s) {
        const uint64_t lo = a.layout.segments()[s].addr;
        if (row.first >= lo && row.first < lo + (1ull << 24)) kept.push_back(row);
      }
    }
    std::sort(kept.begin(), kept.end());
    EXPECT_EQ(expand(ex, row_bytes(a.geo)), kept) << "heads " << heads;
  }
}

TEST(PlannerMismatch, LayerRangeBeyondThePoolIsOutOfRange) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD, 4), b = make_pool(4, 2, TokenOrder::kNHD, 4);
  std::vector<uint32_t> ids{0};
  for (auto [first, n] : {std::pair<uint32_t, uint32_t>{4, 0}, {3, 2}, {0, 5}}) {
    PlanOptions o;
    o.first_layer = first;
    o.num_layers = n;
    auto res = plan_blocks(a.layout, ids, b.layout, ids, o);
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), StatusCode::kOutOfRange) << res.status().to_string();
    EXPECT_NE(res.status().message().find("layers"), std::string::npos);
  }
}

TEST(PlannerMismatch, DifferentHeadCountsNeedNumHeads) {
  // The reported case: 1-head -> 2-head pools used to move head 0 only.
  Pool a = make_pool(4, 1, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  expect_mismatch(a, {0}, b, {0}, "num_heads");
  auto res = plan_blocks(a.layout, {0}, b.layout, {0}, {});
  const std::string& m = res.status().message();
  EXPECT_NE(m.find("kv_heads=1"), std::string::npos) << m;
  EXPECT_NE(m.find("kv_heads=2"), std::string::npos) << m;
}

TEST(PlannerMismatch, DifferentTokenCapacityNeedsNumTokens) {
  Pool a = make_pool(8, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  expect_mismatch(a, {0}, b, {0}, "num_tokens");  // 8 tokens vs 4
  auto res = plan_blocks(a.layout, {0}, b.layout, {0}, {});
  const std::string& m = res.status().message();
  EXPECT_NE(m.find("block_tokens=8"), std::string::npos) << m;
  EXPECT_NE(m.find("block_tokens=4"), std::string::npos) << m;
}

TEST(PlannerMismatch, EqualBytesButDifferentGeometryIsNotSilentlyAccepted) {
  // An HND block read as NHD swaps heads and tokens: same bytes per block, different
  // geometry. 8 tokens x 2 heads vs 2 tokens x 8 heads.
  Pool a = make_pool(8, 2, TokenOrder::kNHD), b = make_pool(2, 8, TokenOrder::kNHD);
  ASSERT_EQ(a.geo.block_half_bytes(), b.geo.block_half_bytes());
  expect_mismatch(a, {0, 1}, b, {0, 1}, "kv heads");
}

TEST(PlannerMismatch, DifferentListLengthsWithEqualBlocks) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kHND);
  expect_mismatch(a, {0, 1}, b, {0}, "differ in length");
  Pool c = make_pool(4, 2, TokenOrder::kNHD);
  expect_mismatch(a, {0, 1}, c, {0}, "differ in length");
}

TEST(PlannerMismatch, IncompatibleElementShapeIsRejected) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD, 2, 8, 4), b = make_pool(4, 2, TokenOrder::kNHD, 2, 8, 8);
  expect_mismatch(a, {0}, b, {0}, "head_dim");
}

TEST(PlannerMismatch, BlockIdsBeyondThePoolAreOutOfRange) {
  Pool a = make_pool(4, 2, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  auto res = plan_blocks(a.layout, {0}, b.layout, {8}, {});
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), StatusCode::kOutOfRange);
}

TEST(DistinctBlocks, DuplicateDestinationsAreNamed) {
  EXPECT_TRUE(check_distinct_blocks({}, "remote").ok());
  EXPECT_TRUE(check_distinct_blocks({1, 2, 3}, "remote").ok());
  EXPECT_TRUE(check_distinct_blocks({3, 1, 2}, "remote").ok());
  Status st = check_distinct_blocks({7, 5, 9, 5}, "remote");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("remote block 5"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("positions 1 and 3"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace pdkv
