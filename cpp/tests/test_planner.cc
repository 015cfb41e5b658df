// The extent planner (plan_blocks) against a reference computed row by row.
//
// Layouts here are unbound, so extents carry absolute (made-up) addresses and nothing
// is dereferenced. The reference maps every (segment, token, head) row of head_dim
// elements from its local address to its remote address; the planner's extents,
// expanded into rows, must give exactly the same set, and coalescing must leave no two
// neighbouring extents that continue each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/relayout.h"
#include "pdkv/kv_layout.h"
#include "planner_rows.h"

namespace pdkv {
namespace {

using namespace pdkv::test;  // NOLINT: the shared pools and reference

// Per-layer K and V arrays, each at its own base far from the others.
Pool make_pool(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint32_t layers = 2, uint32_t blocks = 8,
               uint32_t head_dim = 4, uint64_t base = 1ull << 32, uint64_t spacing = 1ull << 24) {
  const KVGeometry g = f16_geometry(block_tokens, heads, order, layers, blocks, head_dim);
  std::vector<uint64_t> k, v;
  for (uint32_t l = 0; l < layers; ++l) {
    k.push_back(base + (2 * l) * spacing);
    v.push_back(base + (2 * l + 1) * spacing);
  }
  auto r = KVLayout::per_layer(g, k, v);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return Pool{g, std::move(r).value()};
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

// ---- strided layouts: every engine layout against the same row-by-row reference

enum class Kind { kNHD, kHND, kVllmCpu, kCrossLayer, kHeadMajorPool };

// A pool of `kind` at its own made-up base. kVllmCpu: per layer [blocks, H, T, 2*D]
// (K at +0, V at +D); kCrossLayer: [blocks, layers, 2, T, H, D] in one buffer;
// kHeadMajorPool: per layer and part a token pool [H, blocks*T, D] paged by T (a
// block's rows are not one dense run).
Pool make_kind(Kind kind, uint32_t T, uint32_t H, uint32_t layers = 2, uint32_t blocks = 8, uint32_t D = 4,
               uint64_t base = 1ull << 32, uint64_t spacing = 1ull << 24) {
  if (kind == Kind::kNHD || kind == Kind::kHND)
    return make_pool(T, H, kind == Kind::kNHD ? TokenOrder::kNHD : TokenOrder::kHND, layers, blocks, D, base,
                     spacing);
  KVGeometry g;
  g.num_layers = layers;
  g.num_blocks = blocks;
  g.block_tokens = T;
  g.kv_heads = H;
  g.head_dim = D;
  g.dtype = DType::kF16;
  const uint64_t e = 2, row = D * e, half = uint64_t(T) * H * row;
  std::vector<KVSegment> segs;
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      KVSegment s;
      if (kind == Kind::kVllmCpu) {
        s.addr = base + l * spacing + p * row;
        s.block_stride = 2 * half;
        s.token_stride = 2 * row;
        s.head_stride = 2 * row * T;
      } else if (kind == Kind::kCrossLayer) {
        s.addr = base + (2 * l + p) * half;
        s.block_stride = 2 * layers * half;
        s.token_stride = H * row;
        s.head_stride = row;
      } else {
        s.addr = base + (2 * l + p) * spacing;
        s.block_stride = T * row;
        s.token_stride = row;
        s.head_stride = uint64_t(blocks) * T * row;
      }
      segs.push_back(s);
    }
  }
  auto r = KVLayout::make(g, std::move(segs));
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return Pool{g, std::move(r).value()};
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNHD: return "NHD";
    case Kind::kHND: return "HND";
    case Kind::kVllmCpu: return "vllm-cpu";
    case Kind::kCrossLayer: return "cross-layer";
    default: return "head-major-pool";
  }
}

constexpr Kind kKinds[] = {Kind::kNHD, Kind::kHND, Kind::kVllmCpu, Kind::kCrossLayer, Kind::kHeadMajorPool};

TEST(StridedLayout, OlderConstructorsFillTheOrdersStrides) {
  Pool n = make_pool(4, 3, TokenOrder::kNHD), h = make_pool(4, 3, TokenOrder::kHND);
  const uint64_t row = row_bytes(n.geo);
  for (const KVSegment& s : n.layout.segments()) {
    EXPECT_EQ(s.token_stride, 3 * row);
    EXPECT_EQ(s.head_stride, row);
  }
  for (const KVSegment& s : h.layout.segments()) {
    EXPECT_EQ(s.token_stride, row);
    EXPECT_EQ(s.head_stride, 4 * row);
  }
}

TEST(StridedLayout, EndAddressComesFromTheStrides) {
  // vLLM CPU: the V segment starts one row into the block; its last row ends the pool.
  Pool p = make_kind(Kind::kVllmCpu, 4, 2, /*layers=*/1, /*blocks=*/3);
  const uint64_t block = 2 * 4 * 2 * 8;  // 2 parts x T x H x 8-byte rows
  EXPECT_EQ(p.layout.end_addr(), p.layout.min_addr() + 3 * block);
  EXPECT_EQ(p.layout.segment_span(p.layout.segments()[1]), 3 * block - 8);
}

TEST(StridedLayout, OverlappingRowsAreRejectedNamingTheDimension) {
  KVGeometry g;
  g.num_layers = 1;
  g.num_blocks = 4;
  g.block_tokens = 4;
  g.kv_heads = 2;
  g.head_dim = 4;
  g.kv_parts = 1;
  g.dtype = DType::kF32;  // 16-byte rows
  auto bad = [&](uint64_t bs, uint64_t ts, uint64_t hs, const std::string& dim) {
    KVSegment s;
    s.addr = 4096;
    s.block_stride = bs;
    s.token_stride = ts;
    s.head_stride = hs;
    auto r = KVLayout::make(g, {s});
    ASSERT_FALSE(r.ok()) << bs << " " << ts << " " << hs;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(dim + " stride"), std::string::npos) << r.status().message();
  };
  bad(128, 16, 8, "head");      // heads 8 bytes apart, rows are 16
  bad(128, 16, 16, "head");     // heads and tokens on the same bytes
  bad(112, 32, 16, "block");    // a block spans 128 bytes, the next starts 112 later
}

TEST(StridedLayout, EveryKindToEveryKindMatchesTheReference) {
  for (Kind a : kKinds)
    for (Kind b : kKinds) {
      Pool l = make_kind(a, 4, 2), r = make_kind(b, 4, 2, 2, 8, 4, 1ull << 40);
      std::vector<uint32_t> lids{1, 2, 3, 6}, rids{5, 0, 1, 2};
      auto ex = plan_ok(l, lids, r, rids);
      expect_coalesced(ex);
      EXPECT_EQ(expand(ex, row_bytes(l.geo)), reference(l, lids, r, rids, 16, 2))
          << kind_name(a) << " -> " << kind_name(b);
    }
}

TEST(StridedLayout, VllmCpuBlocksMoveAsOneRunPerLayer) {
  // K and V interleave per head inside a block: equal layouts move whole layer-blocks.
  Pool l = make_kind(Kind::kVllmCpu, 4, 2, 3), r = make_kind(Kind::kVllmCpu, 4, 2, 3, 8, 4, 1ull << 40);
  std::vector<uint32_t> ids{2, 3, 4};
  auto ex = plan_ok(l, ids, r, ids);
  ASSERT_EQ(ex.size(), 3u);  // one per layer
  EXPECT_EQ(ex[0].len, 3 * 2 * l.geo.block_half_bytes());
  EXPECT_EQ(expand(ex, row_bytes(l.geo)), reference(l, ids, r, ids, 12, 2));
}

TEST(StridedLayout, HeterogeneousRunsAreAsLongAsBothSidesAllow) {
  // NHD 4 heads -> NHD 2 heads (a TP split): one run per token (2 heads' rows).
  Pool a = make_pool(4, 4, TokenOrder::kNHD), b = make_pool(4, 2, TokenOrder::kNHD);
  std::vector<uint32_t> ids{0};
  PlanOptions o;
  o.num_heads = 2;
  o.local_head_offset = 2;
  auto ex = plan_ok(a, ids, b, ids, o);
  ASSERT_EQ(ex.size(), 4 * a.layout.segments().size());
  for (const Extent& e : ex) EXPECT_EQ(e.len, 2 * row_bytes(a.geo));
  // HND block size 8 -> 4: one run per head and remote block.
  Pool c = make_pool(8, 2, TokenOrder::kHND), d = make_pool(4, 2, TokenOrder::kHND);
  auto ex2 = plan_ok(c, {0}, d, {0, 1});
  ASSERT_EQ(ex2.size(), 4 * c.layout.segments().size());
  // One head: NHD and HND blocks hold the same bytes; whole blocks move.
  Pool e1 = make_pool(4, 1, TokenOrder::kNHD), e2 = make_pool(4, 1, TokenOrder::kHND);
  auto ex3 = plan_ok(e1, {0, 1}, e2, {0, 1});
  ASSERT_EQ(ex3.size(), e1.layout.segments().size());
}

// Property test: random kinds, block sizes, head splits, partial last blocks, block
// ids and layer ranges, every plan equal to the row-by-row reference.
TEST(StridedLayout, RandomPlansMatchTheReference) {
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  auto next = [&](uint64_t n) {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed % n;
  };
  const uint32_t sizes[] = {1, 2, 4, 8};
  for (int iter = 0; iter < 300; ++iter) {
    const Kind ka = kKinds[next(5)], kb = kKinds[next(5)];
    const uint32_t ta = sizes[next(4)], tb = sizes[next(4)];
    const uint32_t ha = 1 + next(4), hb = 1 + next(4);
    const uint32_t nh = 1 + next(std::min(ha, hb));
    const uint32_t lho = next(ha - nh + 1), rho = next(hb - nh + 1);
    Pool l = make_kind(ka, ta, ha, 3, 8), r = make_kind(kb, tb, hb, 3, 8, 4, 1ull << 40);
    const uint64_t ntok = 1 + next(std::min(ta, tb) * 4);  // fits 4 blocks of the smaller size at least
    auto pick = [&](uint32_t T) {
      std::vector<uint32_t> all{0, 1, 2, 3, 4, 5, 6, 7}, ids;
      const size_t n = (ntok + T - 1) / T;
      for (size_t i = 0; i < n; ++i) {
        const size_t j = i + next(all.size() - i);
        std::swap(all[i], all[j]);
        ids.push_back(all[i]);
      }
      return ids;
    };
    std::vector<uint32_t> lids = pick(ta), rids = pick(tb);
    PlanOptions o;
    o.num_tokens = ntok;
    o.num_heads = nh;
    o.local_head_offset = lho;
    o.remote_head_offset = rho;
    auto ex = plan_ok(l, lids, r, rids, o);
    expect_coalesced(ex);
    ASSERT_EQ(expand(ex, row_bytes(l.geo)), reference(l, lids, r, rids, ntok, nh, lho, rho))
        << "iter " << iter << ": " << kind_name(ka) << " T=" << ta << " H=" << ha << " -> " << kind_name(kb)
        << " T=" << tb << " H=" << hb << " tokens=" << ntok << " heads=" << nh << "+" << lho << "/" << rho;
  }
}

// ---- staging (core/relayout.h): gather + wire, or wire + scatter, in real memory,
// must move exactly the rows the direct plan moves.

// A pool of `kind` in real memory: make_kind's layout moved onto `mem`.
Pool in_memory(Kind kind, uint32_t T, uint32_t H, uint32_t layers, std::vector<uint8_t>& mem) {
  Pool p = make_kind(kind, T, H, layers, 8, 4, 0, /*spacing=*/1 << 14);
  uint64_t end = p.layout.end_addr();
  mem.assign(end, 0);
  std::vector<KVSegment> segs = p.layout.segments();
  for (auto& s : segs) s.addr += reinterpret_cast<uint64_t>(mem.data());
  auto r = KVLayout::make(p.geo, segs);
  EXPECT_TRUE(r.ok());
  return Pool{p.geo, std::move(r).value()};
}

void fill(std::vector<uint8_t>& mem, uint64_t seed) {
  for (auto& b : mem) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<uint8_t>(seed >> 56);
  }
}

void apply(const std::vector<Extent>& ex, bool to_remote, uint64_t staging_base) {
  for (const Extent& e : ex) {
    uint8_t* staged = reinterpret_cast<uint8_t*>(staging_base + e.local_offset);
    uint8_t* remote = reinterpret_cast<uint8_t*>(e.remote_offset);
    if (to_remote)
      std::memcpy(remote, staged, e.len);
    else
      std::memcpy(staged, remote, e.len);
  }
}

TEST(Staging, RandomStagedTransfersEqualTheDirectPlan) {
  uint64_t seed = 0x1234567ull;
  auto next = [&](uint64_t n) {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed % n;
  };
  const uint32_t sizes[] = {1, 2, 4, 8};
  int staged_cases = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const Kind ka = kKinds[next(5)], kb = kKinds[next(5)];
    const uint32_t ta = sizes[next(4)], tb = sizes[next(4)], ha = 1 + next(4), hb = 1 + next(4);
    const uint32_t nh = 1 + next(std::min(ha, hb));
    std::vector<uint8_t> lmem, rmem, want;
    Pool l = in_memory(ka, ta, ha, 3, lmem), r = in_memory(kb, tb, hb, 3, rmem);
    PlanOptions o;
    o.num_tokens = 1 + next(std::min(ta, tb) * 4);
    o.num_heads = nh;
    o.local_head_offset = next(ha - nh + 1);
    o.remote_head_offset = next(hb - nh + 1);
    o.first_layer = next(3);
    o.num_layers = next(3 - o.first_layer + 1);
    std::vector<uint32_t> lids, rids;
    for (uint32_t i = 0; i < (o.num_tokens + ta - 1) / ta; ++i) lids.push_back(7 - i);
    for (uint32_t i = 0; i < (o.num_tokens + tb - 1) / tb; ++i) rids.push_back((3 * i + 1) % 8);
    const bool push = next(2);
    fill(push ? lmem : rmem, iter + 1);
    // The reference: the direct plan applied to copies.
    std::vector<uint8_t> lref = lmem, rref = rmem;
    auto direct = plan_blocks(l.layout, lids, r.layout, rids, o);
    ASSERT_TRUE(direct.ok()) << direct.status().to_string();
    const int64_t lshift = reinterpret_cast<int64_t>(lref.data()) - reinterpret_cast<int64_t>(lmem.data());
    const int64_t rshift = reinterpret_cast<int64_t>(rref.data()) - reinterpret_cast<int64_t>(rmem.data());
    for (const Extent& e : *direct) {
      uint8_t* lp = reinterpret_cast<uint8_t*>(e.local_offset + lshift);
      uint8_t* rp = reinterpret_cast<uint8_t*>(e.remote_offset + rshift);
      push ? std::memcpy(rp, lp, e.len) : std::memcpy(lp, rp, e.len);
    }
    // Staged, whether or not staging would be chosen for these sizes.
    auto scope_r = planner::plan_scope(l.layout, lids, r.layout, rids, o);
    ASSERT_TRUE(scope_r.ok());
    const planner::PlanScope scope = scope_r.value();
    KVGeometry sg = r.geo;
    sg.num_layers = static_cast<uint32_t>((scope.seg_end - scope.seg_begin) / 2);
    sg.kv_heads = nh;
    sg.num_blocks = static_cast<uint32_t>((o.num_tokens + tb - 1) / tb);
    auto staging = KVLayout::contiguous(sg, 0, false);
    ASSERT_TRUE(staging.ok());
    StagedPlan plan{staging.value(), KVLayout::contiguous_bytes(sg), scope};
    auto buf = StagingBuffer::allocate(plan.bytes);
    ASSERT_TRUE(buf.ok());
    std::vector<Extent> wire = staged_wire_extents(plan, 0, r.layout, rids);
    StagedTransfer st(push ? OpKind::kWrite : OpKind::kRead, plan, l.layout, lids, *buf);
    ASSERT_TRUE(st.begin_post(std::chrono::steady_clock::time_point::max()));
    const uint64_t base = reinterpret_cast<uint64_t>((*buf)->data());
    if (push) {
      apply(wire, true, base);
    } else {
      apply(wire, false, base);
      st.scatter();
    }
    st.finish_post();
    ASSERT_EQ(lmem, lref) << "iter " << iter;
    ASSERT_EQ(rmem, rref) << "iter " << iter << ": " << kind_name(ka) << " T=" << ta << " H=" << ha << " -> "
                          << kind_name(kb) << " T=" << tb << " H=" << hb;
    auto chosen = plan_staged(l.layout, lids, r.layout, rids, o);
    ASSERT_TRUE(chosen.ok());
    staged_cases += chosen->has_value();
  }
  EXPECT_EQ(staged_cases, 0);  // these plans are small: the direct plan is kept
}

TEST(Staging, LargeFragmentedPlansAreStagedIntoFewExtents) {
  // NHD -> HND, 8 heads x 16 tokens x 64 blocks x 8 segments: 65536 rows.
  Pool a = make_pool(16, 8, TokenOrder::kNHD, 4, 64), b = make_pool(16, 8, TokenOrder::kHND, 4, 64, 4, 1ull << 40);
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 64; ++i) ids.push_back(i);
  auto plan = plan_staged(a.layout, ids, b.layout, ids, {});
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(plan->has_value());
  auto wire = staged_wire_extents(**plan, 7, b.layout, ids);
  EXPECT_EQ(wire.size(), 8u);  // one run of 64 whole blocks per (layer, part)
  EXPECT_EQ((*plan)->bytes, 8u * 64 * b.geo.block_half_bytes());
  // Whole blocks already: no staging.
  auto same = plan_staged(a.layout, ids, a.layout, ids, {});
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->has_value());
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
