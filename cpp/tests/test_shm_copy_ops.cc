// The shm op builder (transport/shm/copy_ops.h) and two-level copies: a run becomes
// one op inside or outside the peer's mapped window and is cut into pieces only
// across the window's edge; every byte of a run is checked against the region as the
// peer confirmed it (first byte to the end of the last piece, overflow-safe); a
// two-level op copies exactly its pieces, through the mapping and by cross-memory
// attach, and stops at its transfer's deadline or on cancel.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm/copy_engine.h"
#include "transport/shm/copy_ops.h"

namespace pdkv::shm {
namespace {

constexpr uint64_t kLen = 1 << 16;

// A peer region of kLen bytes mapped into this process, shared in [lo, hi) only
// (the rest by cross-memory attach, to this very process).
std::shared_ptr<RemoteRegion> region(char* mem, uint64_t lo, uint64_t hi) {
  auto r = std::make_shared<RemoteRegion>();
  r->id = 9;
  r->len = kLen;
  r->remote_addr = reinterpret_cast<uint64_t>(mem);
  if (hi > lo) {
    // A second mapping of the window would need a memfd; the same pages serve here.
    r->base = mem + lo;
    r->shared_offset = lo;
    r->shared_len = hi - lo;
  }
  return r;
}

// 4 repetitions (stride2 4096) of 8 pieces of 64 bytes (stride 256) on the peer's side,
// dense on ours (pieces at 64, repetitions at 512).
ResolvedExtent two_level(uint64_t local, uint64_t remote_offset) {
  ResolvedExtent e;
  e.local_addr = local;
  e.remote_region = 9;
  e.remote_offset = remote_offset;
  e.len = 64;
  e.count = 8;
  e.local_stride = 64;
  e.remote_stride = 256;
  e.count2 = 4;
  e.local_stride2 = 512;
  e.remote_stride2 = 4096;
  return e;
}

struct Mem {
  std::vector<char> local = std::vector<char>(kLen);
  std::vector<char> peer = std::vector<char>(kLen, 0);
  Mem() {
    for (uint64_t i = 0; i < kLen; ++i) local[i] = static_cast<char>(i * 13 + 1);
  }
};

// Expects exactly the pieces of `e` (from local) in peer, zero elsewhere.
void expect_landed(const Mem& m, const ResolvedExtent& e) {
  std::vector<char> want(kLen, 0);
  const char* l = reinterpret_cast<const char*>(e.local_addr);
  for (uint64_t j = 0; j < e.count2; ++j)
    for (uint64_t i = 0; i < e.count; ++i)
      std::memcpy(want.data() + e.remote_offset + j * e.remote_stride2 + i * e.remote_stride,
                  l + j * e.local_stride2 + i * e.local_stride, e.len);
  EXPECT_EQ(m.peer, want);
}

bool cma_denied(const Status& st) {
  return st.code() == StatusCode::kConnectionError && st.message().find("not permitted") != std::string::npos;
}

TEST(ShmCopyOps, ATwoLevelRunInsideTheWindowIsOneMappedOp) {
  Mem m;
  auto r = region(m.peer.data(), 0, kLen);
  Binding b;
  b.op = OpKind::kWrite;
  b.regions = {r};
  const ResolvedExtent e = two_level(reinterpret_cast<uint64_t>(m.local.data()), 1000);
  ASSERT_TRUE(add_run_ops(b, *r, 0, e, "p").ok());
  ASSERT_EQ(b.ops.size(), 1u);
  EXPECT_TRUE(b.ops[0].mapped);
  EXPECT_EQ(b.ops[0].count2, 4u);
  EXPECT_EQ(b.ops[0].remote_stride2, 4096u);
  EXPECT_EQ(b.total, 4u * 8 * 64);
  EXPECT_FALSE(b.cma);
  ASSERT_TRUE(run_copies(b).ok());
  expect_landed(m, e);
  // And back: a read of the same op fills our side.
  std::vector<char> back(kLen, 0);
  Binding rd = b;
  rd.op = OpKind::kRead;
  rd.ops[0].local = back.data();
  ASSERT_TRUE(run_copies(rd).ok());
  for (uint64_t j = 0; j < 4; ++j)
    for (uint64_t i = 0; i < 8; ++i)
      EXPECT_EQ(std::memcmp(back.data() + j * 512 + i * 64, m.local.data() + j * 512 + i * 64, 64), 0);
}

TEST(ShmCopyOps, ATwoLevelRunOutsideTheWindowIsOneCrossMemoryOp) {
  Mem m;
  auto r = region(m.peer.data(), 40000, kLen);  // the run ends before the window
  Binding b;
  b.op = OpKind::kWrite;
  b.pid = ::getpid();
  b.regions = {r};
  const ResolvedExtent e = two_level(reinterpret_cast<uint64_t>(m.local.data()), 1000);
  ASSERT_TRUE(add_run_ops(b, *r, 0, e, "p").ok());
  ASSERT_EQ(b.ops.size(), 1u);
  EXPECT_FALSE(b.ops[0].mapped);
  EXPECT_EQ(b.ops[0].count2, 4u);
  EXPECT_TRUE(b.cma);
  Status st = run_copies(b);
  if (cma_denied(st)) GTEST_SKIP() << st.message();
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_landed(m, e);
}

TEST(ShmCopyOps, ARunAcrossTheWindowsEdgeIsCutThereAndLandsWhole) {
  Mem m;
  auto r = region(m.peer.data(), 4096 + 1000 + 300, kLen);  // the edge cuts repetition 1's piece 1
  Binding b;
  b.op = OpKind::kWrite;
  b.pid = ::getpid();
  b.regions = {r};
  const ResolvedExtent e = two_level(reinterpret_cast<uint64_t>(m.local.data()), 1000);
  ASSERT_TRUE(add_run_ops(b, *r, 0, e, "p").ok());
  EXPECT_GT(b.ops.size(), 1u);
  EXPECT_EQ(b.total, 4u * 8 * 64);
  for (const CopyOp& o : b.ops) EXPECT_EQ(o.count2, 1u);
  Status st = run_copies(b);
  if (cma_denied(st)) GTEST_SKIP() << st.message();
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_landed(m, e);
}

TEST(ShmCopyOps, OnlyTheRepetitionAcrossTheEdgeIsCutIntoPieces) {
  Mem m;
  auto r = region(m.peer.data(), 4096 + 1000 + 300, kLen);  // the edge cuts repetition 1's piece 1
  Binding b;
  b.op = OpKind::kWrite;
  b.pid = ::getpid();
  b.regions = {r};
  const ResolvedExtent e = two_level(reinterpret_cast<uint64_t>(m.local.data()), 1000);
  ASSERT_TRUE(add_run_ops(b, *r, 0, e, "p").ok());
  // Repetition 0 before the window: one cross-memory op of 8 pieces; repetition 1:
  // piece 0 outside, piece 1 cut in two, pieces 2-7 inside; repetitions 2, 3: one
  // mapped op of 8 pieces each.
  ASSERT_EQ(b.ops.size(), 1u + 1 + 2 + 6 + 1 + 1);
  EXPECT_FALSE(b.ops.front().mapped);
  EXPECT_EQ(b.ops.front().count, 8u);
  for (size_t k : {b.ops.size() - 2, b.ops.size() - 1}) {
    EXPECT_TRUE(b.ops[k].mapped);
    EXPECT_EQ(b.ops[k].count, 8u);
    EXPECT_EQ(b.ops[k].remote_stride, 256u);
  }
  EXPECT_EQ(b.total, 4u * 8 * 64);
  Status st = run_copies(b);
  if (cma_denied(st)) GTEST_SKIP() << st.message();
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_landed(m, e);
}

TEST(ShmCopyOps, EveryByteOfARunIsCheckedAgainstTheConfirmedRegion) {
  Mem m;
  auto r = region(m.peer.data(), 0, kLen);
  const uint64_t local = reinterpret_cast<uint64_t>(m.local.data());
  auto refused = [&](const ResolvedExtent& e) {
    Binding b;
    b.regions = {r};
    Status st = add_run_ops(b, *r, 0, e, "peer-x");
    EXPECT_TRUE(b.ops.empty());
    return st;
  };
  // The last piece of the last repetition ends one byte past the region.
  ResolvedExtent last = two_level(local, 0);
  last.remote_offset = kLen - (3 * 4096 + 7 * 256 + 64) + 1;
  Status st = refused(last);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("peer-x"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("65536 bytes as the peer confirms it"), std::string::npos) << st.message();
  // Exactly to the end is fine.
  last.remote_offset -= 1;
  Binding ok;
  ok.regions = {r};
  EXPECT_TRUE(add_run_ops(ok, *r, 0, last, "p").ok());
  // Spans that wrap around 2^64: refused, not wrapped into the region.
  ResolvedExtent wrap = two_level(local, 0);
  wrap.remote_stride2 = ~0ull / 2;
  st = refused(wrap);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("more than 2^64"), std::string::npos) << st.message();
  wrap = two_level(local, 0);
  wrap.count2 = 1ull << 62;
  EXPECT_EQ(refused(wrap).code(), StatusCode::kOutOfRange);
  ResolvedExtent far = two_level(local, kLen + 1);
  EXPECT_EQ(refused(far).code(), StatusCode::kOutOfRange);
  // Empty runs are refused.
  ResolvedExtent empty = two_level(local, 0);
  empty.count2 = 0;
  EXPECT_EQ(refused(empty).code(), StatusCode::kInvalidArgument);
}

TEST(ShmCopyOps, CrossMemoryAttachRefusedIsNotSupported) {
  Mem m;
  auto r = region(m.peer.data(), 40000, kLen);
  r->cma_denied = "cross-memory attach to pid 1 is not permitted (test)";
  Binding b;
  b.regions = {r};
  Status st = add_run_ops(b, *r, 0, two_level(reinterpret_cast<uint64_t>(m.local.data()), 1000), "p");
  EXPECT_EQ(st.code(), StatusCode::kNotSupported);
  EXPECT_NE(st.message().find("(test)"), std::string::npos);
  // Inside the window it needs no cross-memory attach.
  Binding in;
  in.regions = {r};
  EXPECT_TRUE(add_run_ops(in, *r, 0, two_level(reinterpret_cast<uint64_t>(m.local.data()), 40000), "p").ok());
}

TEST(ShmCopyOps, ATwoLevelCopyStopsAtTheDeadlineAndOnCancel) {
  // 64 MiB of 256-byte pieces in 4 repetitions: the clock is read every few MiB.
  constexpr uint64_t kRows = 1u << 16, kRep = 4, kRow = 256;
  std::vector<char> src(kRows * kRep * kRow, 3), dst(kRows * kRep * kRow, 0);
  Binding w;
  w.op = OpKind::kWrite;
  w.total = kRows * kRep * kRow;
  CopyOp o{src.data(), reinterpret_cast<uint64_t>(dst.data()), kRow, 0, true};
  o.count = kRows;
  o.local_stride = kRow;
  o.remote_stride = kRep * kRow;  // pieces of one repetition interleave with the others'
  o.count2 = kRep;
  o.local_stride2 = kRows * kRow;
  o.remote_stride2 = kRow;
  w.ops = {o};
  auto live = std::make_shared<Transfer>(1, OpKind::kWrite, "peer", "shm", w.total, Clock::time_point::max(), 0);
  ASSERT_TRUE(run_copies(w, live.get()).ok());
  EXPECT_EQ(dst, src);

  auto late = std::make_shared<Transfer>(2, OpKind::kWrite, "peer", "shm", w.total, Clock::now(), 0);
  Status st = run_copies(w, late.get());
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  auto gone = std::make_shared<Transfer>(3, OpKind::kWrite, "peer", "shm", w.total, Clock::time_point::max(), 0);
  gone->cancel();
  EXPECT_EQ(run_copies(w, gone.get()).code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace pdkv::shm
