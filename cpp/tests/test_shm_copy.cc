// The shm copy engine (transport/shm/copy_engine.h): run_copies through mapped
// memory and through cross-memory attach (to this very process), and the copy
// threads' queue.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm/copy_engine.h"

namespace pdkv::shm {
namespace {

constexpr size_t kLen = 1 << 16;

// A "peer" region mapped into this process (RemoteRegion unmaps it).
std::shared_ptr<RemoteRegion> mapped_region(uint64_t id) {
  auto r = std::make_shared<RemoteRegion>();
  r->id = id;
  r->len = kLen;
  void* p = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  r->base = static_cast<char*>(p);
  r->shared_len = kLen;  // shared whole, as Agent.alloc memory
  r->remote_addr = reinterpret_cast<uint64_t>(p);
  return r;
}

std::vector<char> pattern(size_t n, char seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>(seed + i * 7);
  return v;
}

TEST(ShmCopy, WriteAndReadThroughMappedRegions) {
  auto r = mapped_region(1);
  auto src = pattern(4096, 3);
  Binding w;
  w.op = OpKind::kWrite;
  w.regions = {r};
  w.ops = {CopyOp{src.data(), reinterpret_cast<uint64_t>(r->base) + 100, 1000, 0, true},
           CopyOp{src.data() + 1000, reinterpret_cast<uint64_t>(r->base) + 5000, 3096, 0, true}};
  ASSERT_TRUE(run_copies(w).ok());
  EXPECT_EQ(std::memcmp(r->base + 100, src.data(), 1000), 0);
  EXPECT_EQ(std::memcmp(r->base + 5000, src.data() + 1000, 3096), 0);

  std::vector<char> back(4096, 0);
  Binding rd = w;
  rd.op = OpKind::kRead;
  rd.ops = {CopyOp{back.data(), reinterpret_cast<uint64_t>(r->base) + 100, 1000, 0, true},
            CopyOp{back.data() + 1000, reinterpret_cast<uint64_t>(r->base) + 5000, 3096, 0, true}};
  ASSERT_TRUE(run_copies(rd).ok());
  EXPECT_EQ(back, src);
}

// An NHD -> HND re-layout as one two-level op (a piece per head per token, head-major
// as the planner lists it): source_order() swaps its levels so the source is read
// token by token; the pieces are the same, so the copy is bit-exact either way, for
// a write and for a read, and an op whose outer level already steps further is kept.
TEST(ShmCopy, TwoLevelTransposeIsCopiedInSourceOrderBitExact) {
  constexpr uint64_t kTokens = 16, kHeads = 8, kPiece = 256, kBlock = kTokens * kHeads * kPiece;
  auto r = mapped_region(1);
  auto nhd = pattern(kBlock, 5);
  auto planned = [&](char* local, char* remote, OpKind op) {
    // A write reads NHD locally (token stride kHeads*kPiece) into HND remotely; a read
    // reads NHD remotely into HND locally.
    const bool w = op == OpKind::kWrite;
    CopyOp o{local, reinterpret_cast<uint64_t>(remote), kPiece, 0, true};
    o.count = kTokens;
    o.local_stride = w ? kHeads * kPiece : kPiece;
    o.remote_stride = w ? kPiece : kHeads * kPiece;
    o.count2 = kHeads;
    o.local_stride2 = w ? kPiece : kTokens * kPiece;
    o.remote_stride2 = w ? kTokens * kPiece : kPiece;
    return o;
  };
  auto expect_hnd = [&](const char* hnd) {
    for (uint64_t h = 0; h < kHeads; ++h)
      for (uint64_t t = 0; t < kTokens; ++t)
        ASSERT_EQ(std::memcmp(hnd + (h * kTokens + t) * kPiece, nhd.data() + (t * kHeads + h) * kPiece, kPiece), 0)
            << "head " << h << " token " << t;
  };
  Binding w;
  w.op = OpKind::kWrite;
  w.regions = {r};
  w.ops = {planned(nhd.data(), r->base, OpKind::kWrite)};
  const CopyOp swapped = source_order(w.ops[0], OpKind::kWrite);
  EXPECT_EQ(swapped.count, kHeads);
  EXPECT_EQ(swapped.local_stride, kPiece);
  EXPECT_EQ(swapped.count2, kTokens);
  EXPECT_EQ(swapped.local_stride2, kHeads * kPiece);
  EXPECT_EQ(swapped.remote_stride, kTokens * kPiece);
  EXPECT_EQ(swapped.remote_stride2, kPiece);
  ASSERT_TRUE(run_copies(w).ok());
  expect_hnd(r->base);

  std::memcpy(r->base, nhd.data(), kBlock);  // the peer holds NHD; read it into HND here
  std::vector<char> hnd(kBlock, 0);
  Binding rd = w;
  rd.op = OpKind::kRead;
  rd.ops = {planned(hnd.data(), r->base, OpKind::kRead)};
  EXPECT_EQ(source_order(rd.ops[0], OpKind::kRead).count, kHeads);
  ASSERT_TRUE(run_copies(rd).ok());
  expect_hnd(hnd.data());

  // The other way round (HND -> NHD written): the source's outer level already steps
  // further than its inner one, so the op is kept as planned.
  CopyOp keep = planned(nhd.data(), r->base, OpKind::kRead);
  const CopyOp same = source_order(keep, OpKind::kWrite);
  EXPECT_EQ(same.count, keep.count);
  EXPECT_EQ(same.local_stride, keep.local_stride);
  EXPECT_EQ(same.count2, keep.count2);
}

TEST(ShmCopy, CrossMemoryAttachMixedWithMappedRegions) {
  auto mapped = mapped_region(1);
  auto cma = std::make_shared<RemoteRegion>();  // reached by process_vm_writev (base null)
  std::vector<char> target(kLen, 0);
  cma->id = 2;
  cma->len = kLen;
  cma->remote_addr = reinterpret_cast<uint64_t>(target.data());
  auto src = pattern(3000, 11);
  Binding w;
  w.op = OpKind::kWrite;
  w.cma = true;
  w.pid = ::getpid();
  w.regions = {mapped, cma};
  w.ops = {CopyOp{src.data(), reinterpret_cast<uint64_t>(mapped->base), 1000, 0, true},
           CopyOp{src.data() + 1000, cma->remote_addr + 64, 2000, 1, false}};
  Status st = run_copies(w);
  if (st.code() == StatusCode::kConnectionError && st.message().find("Operation not permitted") != std::string::npos)
    GTEST_SKIP() << "cross-memory attach is not permitted here: " << st.message();
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(mapped->base, src.data(), 1000), 0);
  EXPECT_EQ(std::memcmp(target.data() + 64, src.data() + 1000, 2000), 0);
}

TEST(ShmCopy, CrossMemoryAttachToAMissingProcessIsAConnectionError) {
  auto cma = std::make_shared<RemoteRegion>();
  std::vector<char> local(16, 1);
  Binding w;
  w.op = OpKind::kWrite;
  w.cma = true;
  w.pid = 0x3fffffff;  // above pid_max: no such process
  w.regions = {cma};
  w.ops = {CopyOp{local.data(), 0x1000, local.size(), 0, false}};
  Status st = run_copies(w);
  EXPECT_EQ(st.code(), StatusCode::kConnectionError);
  EXPECT_NE(st.message().find("is gone"), std::string::npos) << st.message();
}

// A copy longer than its transfer's time stops at the deadline (checked every few
// MiB), and a cancelled transfer's copy stops early; bytes copied before stay.
TEST(ShmCopy, StopsAtTheDeadlineAndOnCancel) {
  constexpr size_t kBig = 32u << 20;
  std::vector<char> src(kBig, 5), dst(kBig, 0);
  Binding w;
  w.op = OpKind::kWrite;
  w.total = kBig;
  w.ops = {CopyOp{src.data(), reinterpret_cast<uint64_t>(dst.data()), kBig, 0, true}};

  auto live = std::make_shared<Transfer>(1, OpKind::kWrite, "peer", "shm", kBig, Clock::time_point::max(), 0);
  ASSERT_TRUE(run_copies(w, live.get()).ok());
  EXPECT_EQ(dst, src);

  auto late = std::make_shared<Transfer>(2, OpKind::kWrite, "peer", "shm", kBig, Clock::now(), 0);
  Status st = run_copies(w, late.get());
  EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
  EXPECT_NE(st.message().find("timed out during the copy (0 of 33554432 bytes"), std::string::npos) << st.message();

  auto gone = std::make_shared<Transfer>(3, OpKind::kWrite, "peer", "shm", kBig, Clock::time_point::max(), 0);
  gone->cancel();
  st = run_copies(w, gone.get());
  EXPECT_EQ(st.code(), StatusCode::kCancelled) << st.to_string();
}

TEST(ShmCopyEngine, RunsEveryJobInOrderOnOneThreadAndStopsEmpty) {
  std::vector<uint64_t> seen;
  std::mutex mu;
  CopyEngine engine([&](Job& job) {
    std::lock_guard<std::mutex> lk(mu);
    seen.push_back(job.lease);
  });
  engine.start(1);
  for (uint64_t i = 1; i <= 50; ++i) engine.submit(Job{nullptr, nullptr, "", i});
  auto left = engine.stop();  // the thread finishes the queue first
  EXPECT_TRUE(left.empty());
  ASSERT_EQ(seen.size(), 50u);
  for (uint64_t i = 0; i < 50; ++i) EXPECT_EQ(seen[i], i + 1);
}

TEST(ShmCopyEngine, JobsSubmittedAfterStopAreHandedBack) {
  std::atomic<int> ran{0};
  CopyEngine engine([&](Job&) { ++ran; });
  engine.start(2);
  EXPECT_TRUE(engine.stop().empty());
  engine.submit(Job{nullptr, nullptr, "late", 7});
  auto left = engine.stop();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].lease, 7u);
  EXPECT_EQ(left[0].notif, "late");
  EXPECT_EQ(ran.load(), 0);
}

}  // namespace
}  // namespace pdkv::shm
