// Re-mapping registered engine pages onto a memfd and back (core/page_share.h), and
// RegionTable::add reporting the shared window.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "core/page_share.h"
#include "pdkv/spi/region_table.h"

namespace pdkv {
namespace {

const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

// Bytes of [lo, hi) mapped from a pdkv memfd now.
uint64_t memfd_bytes(uint64_t lo, uint64_t hi) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uint64_t n = 0;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:pdkv-registered") == std::string::npos) continue;
    uint64_t a = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
    uint64_t b = std::stoull(line.substr(line.find('-') + 1), nullptr, 16);
    if (a < hi && b > lo) n += std::min(b, hi) - std::max(a, lo);
  }
  return n;
}

struct Anon {
  explicit Anon(uint64_t n) : len(n) {
    p = static_cast<char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<char>(i * 7 + 3);
  }
  ~Anon() { ::munmap(p, len); }
  bool intact() const {
    for (uint64_t i = 0; i < len; ++i)
      if (p[i] != static_cast<char>(i * 7 + 3)) return false;
    return true;
  }
  char* p;
  uint64_t len;
};

TEST(PageShare, WholePagesMoveToAMemfdAndBackWithTheirBytes) {
  Anon a(64 * kPage);
  const uint64_t addr = reinterpret_cast<uint64_t>(a.p) + 100, len = 40 * kPage;  // unaligned both ends
  std::string why;
  auto sp = detail::share_pages(addr, len, kPage, &why);
  ASSERT_TRUE(sp.ok()) << sp.status().message();
  EXPECT_EQ(sp->offset, kPage - 100);
  EXPECT_EQ(sp->len, 39 * kPage);
  EXPECT_EQ(memfd_bytes(addr, addr + len), sp->len);
  EXPECT_TRUE(a.intact());
  // A second mapping of the memfd (a peer's) aliases the engine's pages.
  char* peer = static_cast<char*>(::mmap(nullptr, sp->len, PROT_READ | PROT_WRITE, MAP_SHARED, sp->fd, 0));
  ASSERT_NE(peer, MAP_FAILED);
  peer[5] = 42;
  EXPECT_EQ(a.p[kPage + 5], 42);
  a.p[kPage + 5] = static_cast<char>((kPage + 5) * 7 + 3);
  detail::SharedPages pages = *sp;
  ASSERT_TRUE(detail::unshare_pages(addr, pages).ok());
  EXPECT_EQ(memfd_bytes(addr, addr + len), 0u);
  EXPECT_TRUE(a.intact());
  peer[5] = 99;  // no longer the engine's memory
  EXPECT_TRUE(a.intact());
  ::munmap(peer, sp->len);
  ::close(sp->fd);
}

TEST(PageShare, SmallSharedAndFileMemoryStayPrivate) {
  Anon a(8 * kPage);
  std::string why;
  auto sp = detail::share_pages(reinterpret_cast<uint64_t>(a.p), 8 * kPage, 16 * kPage, &why);
  ASSERT_TRUE(sp.ok());
  EXPECT_EQ(sp->len, 0u);
  EXPECT_NE(why.find("fewer than"), std::string::npos) << why;
  void* shared = ::mmap(nullptr, 8 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  sp = detail::share_pages(reinterpret_cast<uint64_t>(shared), 8 * kPage, kPage, &why);
  ASSERT_TRUE(sp.ok());
  EXPECT_EQ(sp->len, 0u);
  EXPECT_NE(why.find("not private anonymous"), std::string::npos) << why;
  ::munmap(shared, 8 * kPage);
}

TEST(PageShare, UnshareLeavesAFreedAndReusedRangeAlone) {
  void* p = ::mmap(nullptr, 16 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  std::string why;
  auto sp = detail::share_pages(addr, 16 * kPage, kPage, &why);
  ASSERT_TRUE(sp.ok() && sp->len == 16 * kPage) << why;
  ::munmap(p, 16 * kPage);  // freed while registered
  void* q = ::mmap(p, 16 * kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(q, p);
  std::memset(q, 0x5a, 16 * kPage);
  detail::SharedPages pages = *sp;
  ASSERT_TRUE(detail::unshare_pages(addr, pages).ok());
  for (uint64_t i = 0; i < 16 * kPage; ++i) ASSERT_EQ(static_cast<char*>(q)[i], 0x5a);
  ::munmap(q, 16 * kPage);
  ::close(sp->fd);
}

TEST(PageShare, RegionTableReportsTheWindowAndGivesThePagesBack) {
  Anon a(32 * kPage);
  RegionTable t;
  const uint64_t addr = reinterpret_cast<uint64_t>(a.p) + 8;
  auto d = t.add(addr, 20 * kPage, MemKind::kHost, -1, true, -1, kPage);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_FALSE(d->shareable);  // not Agent.alloc memory
  EXPECT_EQ(d->shared_offset, kPage - 8);
  EXPECT_EQ(d->shared_len, 19 * kPage);
  auto fd = t.dup_shm_fd(d->id);
  ASSERT_TRUE(fd.ok());
  ::close(*fd);
  // Unexported memory, and the same range again (AlreadyExists, nothing moved).
  auto again = t.add(addr, 20 * kPage, MemKind::kHost, -1, true, -1, kPage);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
  auto e = t.take(d->id);
  ASSERT_TRUE(e.ok());
  RegionTable::wait_unpinned(*e);
  ASSERT_TRUE((*e)->unshare_pages().ok());
  EXPECT_EQ(memfd_bytes(addr, addr + 20 * kPage), 0u);
  EXPECT_TRUE(a.intact());
  auto local = t.add(addr, 20 * kPage, MemKind::kHost, -1, false, -1, kPage);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(local->shared_len, 0u);
}

}  // namespace
}  // namespace pdkv
