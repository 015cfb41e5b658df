// RegionTable: the table every inbound and outbound access is checked against
// (pdkv/region.h). Addresses here are plain numbers: the table never dereferences them.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <future>
#include <limits>
#include <thread>

#include <gtest/gtest.h>

#include "pdkv/spi/region_table.h"

namespace pdkv {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
constexpr uint32_t kHostOnly = mem_kind_bit(MemKind::kHost);
constexpr uint32_t kAnyKind = mem_kind_bit(MemKind::kHost) | mem_kind_bit(MemKind::kCuda);

RegionDesc add_ok(RegionTable& t, uint64_t addr, uint64_t len, bool exported = true) {
  auto r = t.add(addr, len, MemKind::kHost, -1, exported);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : RegionDesc{};
}

TEST(RegionTable, AddReturnsIncreasingIdsThatAreNeverReused) {
  RegionTable t;
  RegionDesc a = add_ok(t, 0x1000, 0x100);
  RegionDesc b = add_ok(t, 0x2000, 0x100);
  EXPECT_EQ(a.id, 1u);
  EXPECT_EQ(b.id, 2u);
  ASSERT_TRUE(t.remove(b.id).ok());
  RegionDesc c = add_ok(t, 0x2000, 0x100);  // the same range again gets a new id
  EXPECT_EQ(c.id, 3u);
  EXPECT_EQ(t.get(b.id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.remove(b.id).code(), StatusCode::kNotFound);
}

TEST(RegionTable, RejectsEmptyNullAndWrappingRanges) {
  RegionTable t;
  EXPECT_EQ(t.add(0x1000, 0, MemKind::kHost, -1, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.add(0, 0x100, MemKind::kHost, -1, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.add(kMax - 0xff, 0x100, MemKind::kHost, -1, true).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(t.add(0x1000, kMax, MemKind::kHost, -1, true).status().code(), StatusCode::kOutOfRange);
  // The last byte of the address space is fine: [kMax - 0xff, kMax) does not wrap.
  EXPECT_TRUE(t.add(kMax - 0x100, 0x100, MemKind::kHost, -1, true).ok());
  EXPECT_TRUE(t.list().size() == 1);
}

TEST(RegionTable, RejectsDeviceMismatch) {
  RegionTable t;
  EXPECT_EQ(t.add(0x1000, 16, MemKind::kHost, 0, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.add(0x1000, 16, MemKind::kCuda, -1, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(t.add(0x1000, 16, MemKind::kCuda, 0, true).ok());
}

TEST(RegionTable, RejectsEveryKindOfOverlapButAllowsAdjacentRanges) {
  RegionTable t;
  RegionDesc r = add_ok(t, 0x10000, 0x1000);  // [0x10000, 0x11000)
  struct Case {
    uint64_t addr, len;
  } overlapping[] = {
      {0x10000, 0x1000},   // the same range
      {0x0f000, 0x1001},   // ends one byte inside
      {0x10fff, 0x1000},   // starts at the last byte
      {0x10100, 0x10},     // inside
      {0x0f000, 0x10000},  // contains it
  };
  for (const auto& c : overlapping) {
    auto res = t.add(c.addr, c.len, MemKind::kHost, -1, true);
    ASSERT_FALSE(res.ok()) << std::hex << c.addr << "+" << c.len;
    EXPECT_EQ(res.status().code(), StatusCode::kAlreadyExists);
    EXPECT_NE(res.status().message().find("region " + std::to_string(r.id)), std::string::npos)
        << res.status().message();
  }
  add_ok(t, 0x0f000, 0x1000);  // ends exactly where r starts
  add_ok(t, 0x11000, 0x1000);  // starts exactly where r ends
  EXPECT_EQ(t.list().size(), 3u);
}

TEST(RegionTable, PinChecksBoundsWithoutOverflow) {
  RegionTable t;
  RegionDesc r = add_ok(t, 0x10000, 0x1000);
  uint64_t addr = 0;
  // Whole region, and an empty range at its very end, are inside.
  auto whole = t.pin(r.id, 0, 0x1000, true, kHostOnly, &addr);
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  EXPECT_EQ(addr, 0x10000u);
  auto last = t.pin(r.id, 0xfff, 1, true, kHostOnly, &addr);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(addr, 0x10fffu);
  EXPECT_TRUE(t.pin(r.id, 0x1000, 0, true, kHostOnly, nullptr).ok());

  struct Case {
    uint64_t offset, len;
  } outside[] = {
      {0, 0x1001},                // one byte too long
      {0x1000, 1},                // starts at the end
      {0x1001, 0},                // starts past the end
      {8, kMax - 4},              // offset + len wraps to a small number (3)
      {kMax, 2},                  // offset + len wraps to 1
      {kMax - 0xfff, 0x1000},     // wraps to 0
      {0x800, kMax},              // a huge length
  };
  for (const auto& c : outside) {
    uint64_t out = 0xdead;
    auto p = t.pin(r.id, c.offset, c.len, true, kHostOnly, &out);
    ASSERT_FALSE(p.ok()) << "offset " << c.offset << " len " << c.len;
    EXPECT_EQ(p.status().code(), StatusCode::kOutOfRange) << p.status().to_string();
    EXPECT_EQ(out, 0xdeadu) << "a rejected pin must not hand out an address";
  }
  // Rejected pins took no reference: after dropping the good ones, removal returns at once.
  whole.value().reset();
  last.value().reset();
  EXPECT_TRUE(t.remove(r.id).ok());
}

TEST(RegionTable, InboundAccessNeedsAnExportedRegion) {
  RegionTable t;
  RegionDesc priv = add_ok(t, 0x10000, 0x1000, /*exported=*/false);
  auto in = t.pin(priv.id, 0, 16, /*inbound=*/true, kHostOnly, nullptr);
  ASSERT_FALSE(in.ok());
  EXPECT_EQ(in.status().code(), StatusCode::kNotFound);
  EXPECT_NE(in.status().message().find("not exported"), std::string::npos) << in.status().message();
  // The owner itself may still use it as a local source or destination.
  EXPECT_TRUE(t.pin(priv.id, 0, 16, /*inbound=*/false, kHostOnly, nullptr).ok());
  EXPECT_EQ(t.pin(999, 0, 16, false, kHostOnly, nullptr).status().code(), StatusCode::kNotFound);
}

TEST(RegionTable, PinHonoursTheTransportsMemoryKinds) {
  RegionTable t;
  auto gpu = t.add(0x7f0000000000, 0x1000, MemKind::kCuda, 0, true);
  ASSERT_TRUE(gpu.ok());
  auto p = t.pin(gpu->id, 0, 16, true, kHostOnly, nullptr);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(p.status().message().find("cuda"), std::string::npos) << p.status().message();
  EXPECT_EQ(t.pin(gpu->id, 0, 16, true, 0, nullptr).status().code(), StatusCode::kNotSupported);
  EXPECT_TRUE(t.pin(gpu->id, 0, 16, true, kAnyKind, nullptr).ok());
  EXPECT_TRUE(t.pin(gpu->id, 0, 16, true, mem_kind_bit(MemKind::kCuda), nullptr).ok());
}

TEST(RegionTable, FindNeedsTheWholeRangeInsideOneRegion) {
  RegionTable t;
  RegionDesc a = add_ok(t, 0x10000, 0x1000);
  add_ok(t, 0x11000, 0x1000);  // adjacent: a range spanning both is still not inside one
  auto f = t.find(0x10800, 0x800);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->id, a.id);
  EXPECT_EQ(t.find(0x10800, 0x801).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.find(0x0ffff, 2).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.find(0x10800, kMax).status().code(), StatusCode::kNotFound);
}

TEST(RegionTable, DeregistrationWaitsForPinsAndRefusesNewOnes) {
  RegionTable t;
  RegionDesc r = add_ok(t, 0x10000, 0x1000);
  auto p1 = t.pin(r.id, 0, 16, true, kHostOnly, nullptr);
  auto p2 = t.pin(r.id, 16, 16, false, kHostOnly, nullptr);
  ASSERT_TRUE(p1.ok() && p2.ok());

  std::atomic<bool> removed{false};
  auto done = std::async(std::launch::async, [&] {
    Status st = t.remove(r.id);
    removed = true;
    return st;
  });
  // remove() takes the region out of the table before it waits: new pins fail at once.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (t.get(r.id).ok() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(t.pin(r.id, 0, 16, true, kHostOnly, nullptr).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.find(0x10000, 16).status().code(), StatusCode::kNotFound);

  // While a pin is held remove() cannot have returned, however long we look.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(removed);
  p1.value().reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(removed) << "one pin is still held";
  // Moving a pin keeps exactly one reference.
  RegionPin moved = std::move(p2.value());
  ASSERT_NE(moved.desc(), nullptr);
  EXPECT_EQ(moved.desc()->id, r.id);
  moved.reset();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "remove() did not return";
  EXPECT_TRUE(done.get().ok());
}

TEST(RegionTable, TakeThenWaitUnpinnedReturnsAtOnceWithoutPins) {
  RegionTable t;
  RegionDesc r = add_ok(t, 0x10000, 0x1000);
  auto e = t.take(r.id);
  ASSERT_TRUE(e.ok());
  RegionTable::wait_unpinned(e.value());  // must not block
  EXPECT_EQ(t.take(r.id).status().code(), StatusCode::kNotFound);
  add_ok(t, 0x10000, 0x1000);  // the range is free again
}

TEST(RegionTable, ShmBackedRegionsKeepTheirOwnFd) {
  RegionTable t;
  int fd = ::memfd_create("pdkv-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  // The memfd must hold at least the registered length.
  EXPECT_EQ(t.add(0x10000, 8192, MemKind::kHost, -1, true, fd).status().code(), StatusCode::kInvalidArgument);
  auto shared = t.add(0x10000, 4096, MemKind::kHost, -1, true, fd);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  EXPECT_TRUE(shared->shareable);
  ::close(fd);  // the table holds its own dup
  auto dup = t.dup_shm_fd(shared->id);
  ASSERT_TRUE(dup.ok()) << dup.status().to_string();
  EXPECT_GE(dup.value(), 0);
  // Peers get it sealed against resizing (a shrink would SIGBUS us), still writable.
  const int seals = ::fcntl(dup.value(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(::ftruncate(dup.value(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(dup.value(), 8192), 0);
  EXPECT_EQ(::pwrite(dup.value(), "x", 1, 0), 1);
  ::close(dup.value());

  RegionDesc plain = add_ok(t, 0x20000, 4096);
  EXPECT_EQ(t.dup_shm_fd(plain.id).status().code(), StatusCode::kNotSupported);
  RegionDesc priv = add_ok(t, 0x30000, 4096, /*exported=*/false);
  EXPECT_EQ(t.dup_shm_fd(priv.id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.add(0x40000, 16, MemKind::kHost, -1, true, /*shm_fd=*/1 << 20).status().code(),
            StatusCode::kInvalidArgument);  // not an open fd
}

// A memfd that cannot be sealed against resizing is never shared with peers.
TEST(RegionTable, AnUnsealableMemfdIsRefused) {
  RegionTable t;
  int fd = ::memfd_create("pdkv-test", MFD_CLOEXEC);  // no MFD_ALLOW_SEALING
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  auto r = t.add(0x10000, 4096, MemKind::kHost, -1, true, fd);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("MFD_ALLOW_SEALING"), std::string::npos) << r.status().to_string();
  ::close(fd);
}

}  // namespace
}  // namespace pdkv
