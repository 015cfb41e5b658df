// Two-level runs (issue 14, NHD <-> HND with several heads over shm):
// planner::plan_strided(two_level = true) against a row-by-row reference in every
// mode, its run counts (O(heads) per (layer, part) for consecutive ids, one per block
// for scattered ones), the nesting rule that keeps a run's pieces disjoint, the
// normal form of a run, and the agent-side expansion for transports without them.
//
// Layouts are unbound: runs carry absolute (made-up) addresses, nothing is touched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/plan_runs.h"
#include "planner_rows.h"
#include "pdkv/kv_layout.h"
#include "pdkv/spi/transport.h"

namespace pdkv {
namespace {

using planner::StridedExtent;
using namespace pdkv::test;  // NOLINT: the shared pools and reference

// Defaults of this file's pools: 3 layers, 24 blocks, head_dim 4.
Pool make_pool(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint64_t base) {
  return contiguous_pool(block_tokens, heads, order, 3, 24, 4, base);
}

// Every row of every piece of every repetition, sorted; checks each run's nesting.
Rows expand(const std::vector<StridedExtent>& runs, uint64_t row) {
  Rows out;
  for (const StridedExtent& e : runs) {
    EXPECT_GE(e.count, 1u);
    EXPECT_GE(e.count2, 1u);
    EXPECT_EQ(e.len % row, 0u);
    EXPECT_TRUE(planner::nested_disjoint(e.len, e.count, e.local_stride, e.count2, e.local_stride2));
    EXPECT_TRUE(planner::nested_disjoint(e.len, e.count, e.remote_stride, e.count2, e.remote_stride2));
    for (uint64_t j = 0; j < e.count2; ++j)
      for (uint64_t i = 0; i < e.count; ++i)
        for (uint64_t k = 0; k < e.len; k += row)
          out.emplace_back(e.local_offset + j * e.local_stride2 + i * e.local_stride + k,
                           e.remote_offset + j * e.remote_stride2 + i * e.remote_stride + k);
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct Case {
  const char* name;
  uint32_t lt, lh;
  TokenOrder lo;
  uint32_t rt, rh;
  TokenOrder ro;
  uint32_t nh, lho, rho;
  bool cut_both;  // both token and head cut on one side: the two-level modes
};

constexpr TokenOrder N = TokenOrder::kNHD, H = TokenOrder::kHND;
const Case kCases[] = {
    {"nhd:hnd", 8, 4, N, 8, 4, H, 4, 0, 0, true},
    {"hnd:nhd", 8, 4, H, 8, 4, N, 4, 0, 0, true},
    {"tp2:tp4+nhd:hnd", 8, 4, N, 8, 2, H, 2, 2, 0, true},
    {"tp4:tp2+hnd:nhd", 8, 2, H, 8, 4, N, 2, 0, 2, true},
    {"tp4:tp2+bs8:bs16+nhd:hnd", 8, 2, N, 16, 4, H, 2, 0, 2, true},
    {"bs16:bs8+hnd:nhd", 16, 3, H, 8, 3, N, 3, 0, 0, true},
    {"tp4:tp2 (NHD)", 8, 2, N, 8, 4, N, 2, 0, 2, false},
    {"bs16:bs8", 16, 2, N, 8, 2, N, 2, 0, 0, false},
    {"gqa replica into slot 3", 8, 1, N, 8, 4, H, 1, 0, 3, false},
};

std::vector<StridedExtent> plan2(const Pool& l, const std::vector<uint32_t>& lids, const Pool& r,
                                 const std::vector<uint32_t>& rids, const PlanOptions& o) {
  auto res = planner::plan_strided(l.layout, lids, r.layout, rids, o, /*two_level=*/true);
  EXPECT_TRUE(res.ok()) << res.status().to_string();
  return res.ok() ? std::move(res).value() : std::vector<StridedExtent>{};
}

void ids_for(const Case& c, uint64_t ntok, bool scattered, std::vector<uint32_t>& lids, std::vector<uint32_t>& rids) {
  for (uint32_t i = 0; i < (ntok + c.lt - 1) / c.lt; ++i) lids.push_back(scattered ? (7 * i + 3) % 24 : 2 + i);
  for (uint32_t i = 0; i < (ntok + c.rt - 1) / c.rt; ++i) rids.push_back(scattered ? 23 - 2 * i : 1 + i);
}

// The options of case `c` for a request of `tokens` tokens.
PlanOptions options_for(const Case& c, uint64_t tokens) {
  PlanOptions o;
  o.num_tokens = tokens;
  o.num_heads = c.nh;
  o.local_head_offset = c.lho;
  o.remote_head_offset = c.rho;
  return o;
}

TEST(PlanTwoLevel, NamesExactlyTheReferenceRowsInEveryMode) {
  for (const Case& c : kCases) {
    for (bool scattered : {false, true}) {
      for (uint64_t ntok : {uint64_t(6 * 16 - 3), uint64_t(6 * 16)}) {  // partial last blocks, and whole ones
        Pool a = make_pool(c.lt, c.lh, c.lo, 1ull << 32), b = make_pool(c.rt, c.rh, c.ro, 1ull << 40);
        std::vector<uint32_t> lids, rids;
        ids_for(c, ntok, scattered, lids, rids);
        const PlanOptions o = options_for(c, ntok);
        auto runs = plan2(a, lids, b, rids, o);
        const Rows got = expand(runs, row_bytes(a.geo));
        EXPECT_EQ(got, reference(a, lids, b, rids, ntok, c.nh, c.lho, c.rho)) << c.name;
        EXPECT_TRUE(std::adjacent_find(got.begin(), got.end(), [](auto& x, auto& y) { return x.first == y.first; }) ==
                    got.end());
        const uint64_t segs = a.layout.segments().size();
        // At most one run per (layer, part) and block: never one per (block, head).
        EXPECT_LE(runs.size(), segs * (lids.size() + rids.size())) << c.name;
        // The one-level plan of the same modes is no shorter.
        auto one = planner::plan_strided(a.layout, lids, b.layout, rids, o);
        ASSERT_TRUE(one.ok());
        EXPECT_LE(runs.size(), one->size()) << c.name;
      }
    }
  }
}

TEST(PlanTwoLevel, ConsecutiveIdsAreOneRunPerHeadAndSegment) {
  for (const Case& c : kCases) {
    if (!c.cut_both) continue;
    Pool a = make_pool(c.lt, c.lh, c.lo, 1ull << 32), b = make_pool(c.rt, c.rh, c.ro, 1ull << 40);
    std::vector<uint32_t> lids, rids;
    ids_for(c, 96, false, lids, rids);
    const PlanOptions o = options_for(c, 96);
    auto runs = plan2(a, lids, b, rids, o);
    const uint64_t segs = a.layout.segments().size();
    EXPECT_LE(runs.size(), segs * c.nh) << c.name;
    auto one = planner::plan_strided(a.layout, lids, b.layout, rids, o);
    ASSERT_TRUE(one.ok());
    EXPECT_GE(one->size(), segs * c.nh * (96 / std::max(c.lt, c.rt))) << c.name;  // per (block, head)
  }
}

// Where both sides cut tokens and heads (NHD <-> HND), a short plan stays per (layer,
// part) instead of one run per (block, head) across segments: each block's heads are
// then moved in one pass (one run per block for large rows), touching its lines once.
TEST(PlanTwoLevel, SmallCutBothPlansStayPerSegment) {
  for (const Case& c : kCases) {
    if (!c.cut_both) continue;
    for (bool scattered : {false, true}) {
      Pool a = make_pool(c.lt, c.lh, c.lo, 1ull << 32), b = make_pool(c.rt, c.rh, c.ro, 1ull << 40);
      std::vector<uint32_t> lids, rids;
      ids_for(c, 96, scattered, lids, rids);
      const PlanOptions o = options_for(c, 96);
      auto runs = plan2(a, lids, b, rids, o);
      EXPECT_EQ(expand(runs, row_bytes(a.geo)), reference(a, lids, b, rids, 96, c.nh, c.lho, c.rho)) << c.name;
      const uint64_t segs = a.layout.segments().size();
      EXPECT_GE(runs.size(), segs) << c.name;  // none spans two segments
      for (const StridedExtent& e : runs) EXPECT_LT(e.local_stride2, a.layout.segments()[1].addr - a.layout.segments()[0].addr) << c.name;
    }
  }
}

// Blocks of 32 KiB (16 tokens x 8 heads x 256 B) NHD -> HND with consecutive ids: a
// head's pass over the blocks would move more than kHeadPassBytes per head, so each
// block is one run (its tokens, repeated per head: 32 KiB contiguous on the HND side);
// a plan over kCheapPerSegmentRuns keeps O(heads) runs per (layer, part) instead.
TEST(PlanTwoLevel, LargeBlocksMoveTheirHeadsInOneRunWhileThePlanIsShort) {
  for (uint32_t layers : {3u, 100u}) {
    Pool a = contiguous_pool(16, 8, N, layers, 24, 128, 1ull << 32), b = contiguous_pool(16, 8, H, layers, 24, 128, 1ull << 40);
    std::vector<uint32_t> ids(24);
    for (uint32_t i = 0; i < 24; ++i) ids[i] = i;
    PlanOptions o;
    o.num_tokens = 24 * 16;
    o.num_heads = 8;
    auto runs = plan2(a, ids, b, ids, o);
    EXPECT_EQ(expand(runs, row_bytes(a.geo)), reference(a, ids, b, ids, 24 * 16, 8, 0, 0)) << layers;
    const uint64_t segs = a.layout.segments().size();
    if (layers == 3) {
      ASSERT_EQ(runs.size(), segs * 24);  // one per (segment, block)
      for (const StridedExtent& e : runs) {
        EXPECT_EQ(e.len * e.count * e.count2, 32768u);
        EXPECT_EQ(e.count2, 8u);  // the block's heads
      }
    } else {
      EXPECT_EQ(runs.size(), segs * 8);  // 24 x 200 runs would be over 4096: one per (segment, head)
    }
  }
}

// Scattered ids in contiguous pools (K/V apart, or interleaved per block): each
// block's run repeats in every (layer, part) at one distance, so it is one two-level
// run across them: O(blocks) runs per request, not O(blocks x layers x parts), and
// still exactly the reference rows.
TEST(PlanTwoLevel, ScatteredIdsAreOneRunPerBlockAcrossSegments) {
  for (const Case& c : kCases) {
    for (bool interleaved : {false, true}) {
      // Where both sides cut tokens and heads, a per-segment plan of up to 4096 runs
      // stays per segment (kv_layout.cc kCheapPerSegmentRuns; SmallCutBothPlansStay...):
      // enough layers that it would be longer.
      const uint32_t layers = c.cut_both ? 300 : 8;
      const KVGeometry lg = f16_geometry(c.lt, c.lh, c.lo, layers, 24, 4),
                       rg = f16_geometry(c.rt, c.rh, c.ro, layers, 24, 4);
      auto la = KVLayout::contiguous(lg, 1ull << 32, interleaved), lb = KVLayout::contiguous(rg, 1ull << 40, interleaved);
      ASSERT_TRUE(la.ok() && lb.ok());
      Pool a{lg, std::move(la).value()}, b{rg, std::move(lb).value()};
      std::vector<uint32_t> lids, rids;
      ids_for(c, 96, true, lids, rids);
      const PlanOptions o = options_for(c, 96);
      auto runs = plan2(a, lids, b, rids, o);
      EXPECT_EQ(expand(runs, row_bytes(a.geo)), reference(a, lids, b, rids, 96, c.nh, c.lho, c.rho))
          << c.name << (interleaved ? " interleaved" : "");
      const uint64_t segs = a.layout.segments().size();  // layers x 2 parts
      const uint64_t groups = interleaved ? 2 : 1;        // K/V interleaved: one group per part
      const uint64_t chunks = lids.size() + rids.size();
      EXPECT_LE(runs.size(), groups * chunks * (c.cut_both ? c.nh : 1)) << c.name;
      EXPECT_LT(runs.size(), segs * (96 / std::max(c.lt, c.rt))) << c.name;  // fewer than one per (segment, block)
      // Per (layer, part) when the pools' segments are not evenly spaced: the first
      // layer's K moved past the others.
      KVLayout moved = a.layout;
      moved.mutable_segments()[0].addr += 1ull << 30;
      auto res = planner::plan_strided(moved, lids, b.layout, rids, o, /*two_level=*/true);
      ASSERT_TRUE(res.ok());
      EXPECT_GE(res->size(), segs * (96 / std::max(c.lt, c.rt)) / 2) << c.name;
    }
  }
}

TEST(NestedDisjoint, OneLevelMustNestInTheOthersGaps) {
  // 16 tokens of 256 B at 2048 (NHD), repeated per head at 256: inner steps jump the heads.
  EXPECT_TRUE(planner::nested_disjoint(256, 16, 2048, 8, 256));
  // HND: 16 tokens contiguous (stride 256), repeated per head at 4096: repetitions nest after.
  EXPECT_TRUE(planner::nested_disjoint(256, 16, 256, 8, 4096));
  // A repetition stride inside the inner run (and not over it): pieces collide.
  EXPECT_FALSE(planner::nested_disjoint(256, 16, 512, 2, 256 * 3));
  EXPECT_FALSE(planner::nested_disjoint(256, 4, 256, 2, 512));
  // Pieces overlapping at either level.
  EXPECT_FALSE(planner::nested_disjoint(256, 4, 100, 1, 0));
  EXPECT_FALSE(planner::nested_disjoint(256, 1, 0, 4, 100));
  // Spans past 2^64 are not nested, whatever the strides.
  EXPECT_FALSE(planner::nested_disjoint(256, 1ull << 40, 1ull << 30, 2, 1ull << 62));
  EXPECT_TRUE(planner::nested_disjoint(256, 1, 0, 1, 0));
}

TEST(TwoLevelRun, FoldsLevelsThatAreOnePieceOrTouch) {
  // Touching inner pieces: one piece per repetition, a one-level run.
  StridedExtent a = planner::two_level_run(0, 0, 64, 4, 64, 64, 3, 1000, 2000);
  EXPECT_EQ(a.len, 256u);
  EXPECT_EQ(a.count, 3u);
  EXPECT_EQ(a.local_stride, 1000u);
  EXPECT_EQ(a.remote_stride, 2000u);
  EXPECT_EQ(a.count2, 1u);
  // One piece repeated: the repetitions are the run.
  StridedExtent b = planner::two_level_run(0, 0, 64, 1, 0, 0, 5, 128, 64);
  EXPECT_EQ(b.count, 5u);
  EXPECT_EQ(b.count2, 1u);
  // Everything touching: a plain extent.
  StridedExtent c = planner::two_level_run(8, 16, 64, 2, 64, 64, 3, 128, 128);
  EXPECT_EQ(c.len, 384u);
  EXPECT_EQ(c.count, 1u);
  EXPECT_EQ(c.count2, 1u);
  EXPECT_EQ(c.local_stride, 0u);
  // A real two-level run stays.
  StridedExtent d = planner::two_level_run(0, 0, 64, 4, 256, 64, 4, 64, 256);
  EXPECT_EQ(d.count, 4u);
  EXPECT_EQ(d.count2, 4u);
}

TEST(ExpandTwoLevel, GivesEachRepetitionAsAOneLevelRunInOrder) {
  ResolvedExtent e;
  e.local_addr = 1000;
  e.remote_region = 7;
  e.remote_offset = 50;
  e.len = 8;
  e.count = 3;
  e.local_stride = 32;
  e.remote_stride = 8;
  e.count2 = 2;
  e.local_stride2 = 8;
  e.remote_stride2 = 24;
  EXPECT_EQ(e.bytes(), 48u);
  auto one = expand_two_level({e});
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[1].local_addr, 1008u);
  EXPECT_EQ(one[1].remote_offset, 74u);
  EXPECT_EQ(one[1].count, 3u);
  EXPECT_EQ(one[1].count2, 1u);
  // expand_strided() takes both levels apart, piece by piece.
  auto flat = expand_strided({e});
  ASSERT_EQ(flat.size(), 6u);
  EXPECT_EQ(flat[4].local_addr, 1000u + 8 + 32);
  EXPECT_EQ(flat[4].remote_offset, 50u + 24 + 8);
  EXPECT_EQ(flat[4].len, 8u);
}

}  // namespace
}  // namespace pdkv
