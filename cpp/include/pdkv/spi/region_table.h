// pdkv/spi/region_table.h (SPI, for transport authors and the core): the table of
// registered regions that validates every access, and the pin that keeps a region
// alive while a transfer uses it. Users see regions only as RegionDesc (pdkv/region.h);
// the registration rules are stated there.
//
// Thread safety: RegionTable is safe to use from any thread. RegionPin is a
// move-only token; destroy it from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv {

namespace detail {
struct RegionEntry {
  ~RegionEntry();
  RegionDesc desc;
  int shm_fd = -1;  // owned dup of the backing memfd, or -1
  // Engine pages re-mapped onto shm_fd at registration (len 0: none); given back to
  // private memory by unshare_pages() once no transfer uses the region.
  uint64_t remapped_offset = 0, remapped_len = 0;
  uint64_t memfd_dev = 0, memfd_ino = 0;
  std::atomic<int64_t> inflight{0};
  std::atomic<bool> revoked{false};
  std::mutex mu;
  std::condition_variable cv;
  void unpin();
  // Re-maps the engine pages back onto private memory (see core/page_share.h). Call
  // after wait_unpinned(); idempotent; the destructor calls it too.
  Status unshare_pages();
};
}  // namespace detail

// Keeps a region alive (deregistration waits) while a transfer uses it.
class RegionPin {
 public:
  RegionPin() = default;
  explicit RegionPin(std::shared_ptr<detail::RegionEntry> e) : e_(std::move(e)) {}
  RegionPin(RegionPin&&) noexcept = default;
  RegionPin& operator=(RegionPin&& o) noexcept {
    if (this != &o) { reset(); e_ = std::move(o.e_); }
    return *this;
  }
  RegionPin(const RegionPin&) = delete;
  RegionPin& operator=(const RegionPin&) = delete;
  ~RegionPin() { reset(); }
  void reset();
  const RegionDesc* desc() const { return e_ ? &e_->desc : nullptr; }

 private:
  std::shared_ptr<detail::RegionEntry> e_;
};

class RegionTable {
 public:
  // Adds a region and returns its descriptor (ids start at 1 and are never reused).
  // `shm_fd` >= 0: the memory is a MAP_SHARED mapping of that memfd (offset 0, at
  // least `len` bytes); the table keeps a dup of it so peers on this host can map it.
  // Otherwise, for exported host memory whose whole pages span at least
  // `share_min_bytes` (0: never), those pages are re-mapped onto a new memfd first
  // (core/page_share.h; RegionDesc::shared_offset/shared_len say which).
  Result<RegionDesc> add(uint64_t addr, uint64_t len, MemKind kind, int32_t device, bool remote_access,
                         int shm_fd = -1, uint64_t share_min_bytes = 0);
  // A new dup of region `id`'s memfd (caller closes it). NotFound / NotSupported.
  Result<int> dup_shm_fd(uint64_t id) const;
  // Removes a region, then waits for its pins to drop (see file comment).
  Status remove(uint64_t id);
  // The two halves of remove(): take the region out of the table (new lookups fail),
  // then wait until no transfer pins it.
  Result<std::shared_ptr<detail::RegionEntry>> take(uint64_t id);
  static void wait_unpinned(const std::shared_ptr<detail::RegionEntry>& e);
  // Pins region `id` after checking [offset, offset+len) lies inside it and, when
  // `inbound` is true, that peers may access it and its kind is in `kinds_mask`
  // (bit per MemKind). On success *ptr is the address of byte `offset`.
  Result<RegionPin> pin(uint64_t id, uint64_t offset, uint64_t len, bool inbound,
                        uint32_t kinds_mask, uint64_t* addr_out) const;
  // The region holding [addr, addr+len), if any.
  Result<RegionDesc> find(uint64_t addr, uint64_t len) const;
  Result<RegionDesc> get(uint64_t id) const;
  std::vector<RegionDesc> list() const;

 private:
  // AlreadyExists naming the region [addr, addr+len) overlaps; Ok if none. mu_ held.
  Status overlap_locked(uint64_t addr, uint64_t len) const;

  mutable std::shared_mutex mu_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<detail::RegionEntry>> by_id_;
  std::map<uint64_t, uint64_t> by_addr_;  // start addr -> id (host and device share one UVA space)
};

inline constexpr uint32_t mem_kind_bit(MemKind k) { return 1u << static_cast<uint32_t>(k); }

}  // namespace pdkv
