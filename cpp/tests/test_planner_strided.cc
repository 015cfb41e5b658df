// Strided runs (issue 14, a peer's fragmented blocks): planner::plan_strided against a
// row-by-row reference, the shared expansion for transports without strides
// (expand_strided), and the tcp receiver's check of strided descriptors
// (check_strided_extents).
//
// Layouts are unbound, so runs carry absolute (made-up) addresses and nothing is
// dereferenced. Expanded piece by piece, a strided plan must name exactly the rows
// the reference maps, never overlap, and stay O(blocks) (O(layers x parts) for
// consecutive ids) where plan_blocks() gives one extent per token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/plan_runs.h"
#include "planner_rows.h"
#include "pdkv/kv_layout.h"
#include "pdkv/spi/transport.h"
#include "transport/tcp/wire.h"

namespace pdkv {
namespace {

using planner::StridedExtent;
using namespace pdkv::test;  // NOLINT: the shared pools and reference

// This file's pools: contiguous, 3 layers, 16 blocks, head_dim 4, at 4 GiB unless told.
Pool make_pool(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint32_t layers = 3, uint32_t blocks = 16,
               uint32_t head_dim = 4, uint64_t base = 1ull << 32) {
  return contiguous_pool(block_tokens, heads, order, layers, blocks, head_dim, base);
}

// Every row of every piece; also checks that a run's pieces never overlap.
Rows expand(const std::vector<StridedExtent>& runs, uint64_t row) {
  Rows out;
  for (const StridedExtent& e : runs) {
    EXPECT_GE(e.count, 1u);
    EXPECT_EQ(e.len % row, 0u);
    if (e.count > 1) {
      EXPECT_GE(e.local_stride, e.len);
      EXPECT_GE(e.remote_stride, e.len);
    }
    for (uint64_t i = 0; i < e.count; ++i)
      for (uint64_t k = 0; k < e.len; k += row)
        out.emplace_back(e.local_offset + i * e.local_stride + k, e.remote_offset + i * e.remote_stride + k);
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
};

constexpr TokenOrder N = TokenOrder::kNHD, H = TokenOrder::kHND;
const Case kCases[] = {
    {"tp4:tp2 push (2 heads into a 4-head NHD block)", 8, 2, N, 8, 4, N, 2, 0, 2},
    {"tp2:tp4 pull (2 of 4 NHD heads)", 8, 2, N, 8, 4, N, 2, 0, 2},
    {"tp4:tp2+hnd:nhd", 8, 2, H, 8, 4, N, 2, 0, 2},
    {"tp2:tp4+nhd:hnd (both cut)", 8, 4, N, 8, 2, H, 2, 2, 0},
    {"tp4:tp2+bs8:bs16+nhd:hnd", 8, 2, N, 16, 4, H, 2, 0, 2},
    {"bs16:bs8", 16, 2, N, 8, 2, N, 2, 0, 0},
    {"nhd:hnd", 8, 3, N, 8, 3, H, 3, 0, 0},
    {"gqa replica into slot 3", 8, 1, N, 8, 4, H, 1, 0, 3},
};

std::vector<StridedExtent> plan_ok(const Pool& l, const std::vector<uint32_t>& lids, const Pool& r,
                                   const std::vector<uint32_t>& rids, const PlanOptions& o) {
  auto res = planner::plan_strided(l.layout, lids, r.layout, rids, o);
  EXPECT_TRUE(res.ok()) << res.status().to_string();
  return res.ok() ? std::move(res).value() : std::vector<StridedExtent>{};
}

TEST(PlanStrided, NamesExactlyTheReferenceRowsInEveryMode) {
  for (const Case& c : kCases) {
    Pool a = make_pool(c.lt, c.lh, c.lo), b = make_pool(c.rt, c.rh, c.ro, 3, 16, 4, 1ull << 40);
    const uint64_t ntok = 5 * 16 - 3;  // a partial last block on both sides
    std::vector<uint32_t> lids, rids;
    for (uint32_t i = 0; i < (ntok + c.lt - 1) / c.lt; ++i) lids.push_back((7 * i + 3) % 16);  // scattered
    for (uint32_t i = 0; i < (ntok + c.rt - 1) / c.rt; ++i) rids.push_back(15 - i);
    PlanOptions o;
    o.num_tokens = ntok;
    o.num_heads = c.nh;
    o.local_head_offset = c.lho;
    o.remote_head_offset = c.rho;
    auto runs = plan_ok(a, lids, b, rids, o);
    EXPECT_EQ(expand(runs, row_bytes(a.geo)), reference(a, lids, b, rids, ntok, c.nh, c.lho, c.rho)) << c.name;
    // O(blocks x heads) runs per (layer, part), never O(tokens x heads).
    const uint64_t segs = a.layout.segments().size();
    EXPECT_LE(runs.size(), segs * (lids.size() + rids.size()) * c.nh) << c.name;
  }
}

TEST(PlanStrided, ConsecutiveIdsIntoAPeersCutBlocksAreOneRunPerSegment) {
  Pool a = make_pool(8, 2, N), b = make_pool(8, 4, N, 3, 16, 4, 1ull << 40);
  std::vector<uint32_t> ids{4, 5, 6, 7, 8, 9};
  PlanOptions o;
  o.num_heads = 2;
  o.remote_head_offset = 2;
  auto runs = plan_ok(a, ids, b, ids, o);
  EXPECT_LE(runs.size(), a.layout.segments().size());
  for (const StridedExtent& e : runs) {
    EXPECT_EQ(e.len, 2 * row_bytes(a.geo));                // one token's 2 heads
    EXPECT_EQ(e.local_stride, 2 * row_bytes(a.geo));       // this side dense
    EXPECT_EQ(e.remote_stride, 4 * row_bytes(a.geo));      // the peer's token stride
  }
  EXPECT_EQ(expand(runs, row_bytes(a.geo)), reference(a, ids, b, ids, 48, 2, 0, 2));
  // plan_blocks() lists the same bytes one token at a time.
  auto plain = plan_blocks(a.layout, ids, b.layout, ids, o);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->size(), a.layout.segments().size() * 48);
}

TEST(PlanStrided, SameErrorsAsPlanBlocks) {
  Pool a = make_pool(8, 2, N), b = make_pool(8, 4, N);
  auto no_heads = planner::plan_strided(a.layout, {0}, b.layout, {0}, {});
  ASSERT_FALSE(no_heads.ok());
  EXPECT_EQ(no_heads.status().code(), StatusCode::kInvalidArgument);
  PlanOptions o;
  o.num_heads = 2;
  o.remote_head_offset = 3;
  auto past = planner::plan_strided(a.layout, {0}, b.layout, {0}, o);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kOutOfRange);
}

TEST(PushStrided, MergesPiecesAtTheNextStrideOnly) {
  std::vector<StridedExtent> v;
  planner::push_strided(v, StridedExtent{1, 0, 2, 100, 8});
  planner::push_strided(v, StridedExtent{1, 8, 2, 108, 8});  // continues both sides: one plain extent
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].len, 16u);
  planner::push_strided(v, StridedExtent{1, 16, 2, 200, 16});  // same length, touching here only: a run of 2
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].count, 2u);
  EXPECT_EQ(v[0].local_stride, 16u);
  EXPECT_EQ(v[0].remote_stride, 100u);
  planner::push_strided(v, StridedExtent{1, 32, 2, 300, 16, 3, 16, 100});  // the run's next 3 pieces
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].count, 5u);
  planner::push_strided(v, StridedExtent{1, 80, 2, 601, 16});  // off by one byte remotely: a new extent
  EXPECT_EQ(v.size(), 2u);
  planner::push_strided(v, StridedExtent{1, 1000, 2, 700, 16});  // apart on both sides: stays plain
  EXPECT_EQ(v.size(), 3u);
  planner::push_strided(v, StridedExtent{1, 1016, 3, 0, 16});  // another region
  EXPECT_EQ(v.size(), 4u);
  std::vector<StridedExtent> t;
  planner::push_strided(t, StridedExtent{1, 0, 2, 0, 8, 4, 8, 8});  // touching pieces: a plain extent
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].count, 1u);
  EXPECT_EQ(t[0].len, 32u);
}

TEST(ExpandStrided, GivesEveryPieceInOrder) {
  std::vector<ResolvedExtent> in(3);
  in[0] = ResolvedExtent{1000, 7, 64, 16, MemKind::kHost, -1, 3, 32, 128};
  in[1] = ResolvedExtent{5000, 7, 0, 8};                                    // plain
  in[2] = ResolvedExtent{9000, 8, 0, 4, MemKind::kHost, -1, 5, 4, 4};      // touching: one extent
  auto out = expand_strided(in);
  ASSERT_EQ(out.size(), 5u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i].local_addr, 1000u + 32 * i);
    EXPECT_EQ(out[i].remote_offset, 64u + 128 * i);
    EXPECT_EQ(out[i].len, 16u);
    EXPECT_EQ(out[i].count, 1u);
    EXPECT_EQ(out[i].remote_region, 7u);
  }
  EXPECT_EQ(out[3].local_addr, 5000u);
  EXPECT_EQ(out[4].local_addr, 9000u);
  EXPECT_EQ(out[4].len, 20u);
  EXPECT_EQ(out[4].count, 1u);
}

// ---- the tcp receiver's check of strided descriptors (wire.h kFlagStrided)

tcp::FrameHeader strided_hdr(tcp::FrameType t, uint32_t n, uint64_t payload) {
  tcp::FrameHeader h{};
  h.magic = tcp::kFrameMagic;
  h.type = static_cast<uint16_t>(t);
  h.flags = tcp::kFlagStrided;
  h.count = n;
  h.payload = payload;
  return h;
}

Status check_one(tcp::WireStridedExtent e, tcp::FrameType t = tcp::FrameType::kReadReq, uint64_t payload = 0) {
  auto r = tcp::check_strided_extents(&e, 1, strided_hdr(t, 1, payload));
  return r.ok() ? Status::Ok() : r.status();
}

void expect_protocol_error(const Status& st, const std::string& mention) {
  EXPECT_EQ(st.code(), StatusCode::kProtocolError) << st.to_string();
  EXPECT_NE(st.message().find(mention), std::string::npos) << st.message();
}

TEST(TcpStridedFrame, ChecksEveryFieldBeforeAnythingIsAllocated) {
  EXPECT_TRUE(check_one({1, 0, 16, 4, 32}).ok());
  expect_protocol_error(check_one({1, 0, 16, 0, 32}), "count 0");
  expect_protocol_error(check_one({1, 0, 0, 4, 32}), "length 0");
  expect_protocol_error(check_one({1, 0, 64, 4, 32}), "overlap");
  expect_protocol_error(check_one({1, 0, 8, 1 << 17, 1ull << 50}), "overflows");
  expect_protocol_error(check_one({1, 0, 1, tcp::kMaxStridedPieces + 1, 1}), "pieces exceed");
  expect_protocol_error(check_one({1, 0, 1ull << 20, 2048, 1ull << 20}), "more than");  // 2 GiB > one frame
  // A write's payload must be the pieces' sum.
  EXPECT_TRUE(check_one({1, 0, 16, 4, 32}, tcp::FrameType::kWrite, 64).ok());
  expect_protocol_error(check_one({1, 0, 16, 4, 32}, tcp::FrameType::kWrite, 65), "add up to 64");
  // The pieces of all descriptors together are bounded too.
  tcp::WireStridedExtent two[2] = {{1, 0, 1, tcp::kMaxStridedPieces / 2 + 1, 1}, {1, 0, 1, tcp::kMaxStridedPieces / 2, 1}};
  auto r = tcp::check_strided_extents(two, 2, strided_hdr(tcp::FrameType::kReadReq, 2, 0));
  ASSERT_FALSE(r.ok());
  expect_protocol_error(r.status(), "pieces exceed");
  EXPECT_EQ(tcp::strided_span({1, 100, 16, 4, 32}), 3u * 32 + 16);
}

TEST(TcpStridedFrame, FlagIsAllowedOnDataFramesOnlyAndSizesTheDescriptors) {
  const tcp::ConnState open{tcp::ConnRole::kInbound, tcp::ConnPhase::kOpen};
  auto h = strided_hdr(tcp::FrameType::kReadReq, 3, 0);
  EXPECT_TRUE(tcp::check_header(h, open, {}).ok());
  EXPECT_EQ(tcp::control_bytes(h), 3u * 40);
  h.flags = 0;
  EXPECT_EQ(tcp::control_bytes(h), 3u * 24);
  auto notify = strided_hdr(tcp::FrameType::kNotify, 0, 0);
  EXPECT_EQ(tcp::check_header(notify, open, {}).code(), StatusCode::kProtocolError);
}

}  // namespace
}  // namespace pdkv
