#include "pdkv/spi/region_table.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "core/page_share.h"
#include "util/log.h"

namespace pdkv {
namespace {
std::string range_str(uint64_t addr, uint64_t len) {
  char buf[64];
  snprintf(buf, sizeof buf, "[0x%llx, 0x%llx)", (unsigned long long)addr, (unsigned long long)(addr + len));
  return buf;
}
}  // namespace

detail::RegionEntry::~RegionEntry() {
  Status s = unshare_pages();
  if (!s.ok()) PDKV_LOG_ERROR("region %llu: %s", (unsigned long long)desc.id, s.message().c_str());
  if (shm_fd >= 0) ::close(shm_fd);
}

Status detail::RegionEntry::unshare_pages() {
  if (remapped_len == 0) return Status::Ok();
  SharedPages pages{shm_fd, remapped_offset, remapped_len, static_cast<dev_t>(memfd_dev),
                    static_cast<ino_t>(memfd_ino)};
  remapped_len = 0;
  return detail::unshare_pages(desc.addr, pages);
}

void detail::RegionEntry::unpin() {
  if (inflight.fetch_sub(1, std::memory_order_acq_rel) == 1 && revoked.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(mu);
    cv.notify_all();
  }
}

void RegionPin::reset() {
  if (e_) {
    e_->unpin();
    e_.reset();
  }
}

Result<RegionDesc> RegionTable::add(uint64_t addr, uint64_t len, MemKind kind, int32_t device, bool remote_access,
                                    int shm_fd, uint64_t share_min_bytes) {
  if (len == 0) return InvalidArgument("cannot register an empty memory range");
  if (addr == 0) return InvalidArgument("cannot register memory at address 0");
  if (addr > ~0ull - len) return OutOfRange("memory range " + range_str(addr, len) + " wraps around");
  if (kind == MemKind::kHost && device != -1) return InvalidArgument("host memory takes device -1");
  if (kind == MemKind::kCuda && device < 0) return InvalidArgument("CUDA memory needs a device ordinal >= 0");
  int fd = -1;
  if (shm_fd >= 0) {
    if (kind != MemKind::kHost) return InvalidArgument("only host memory can be backed by a memfd");
    struct stat st {};
    if (::fstat(shm_fd, &st) != 0) return InvalidArgument("shm fd " + std::to_string(shm_fd) + " is not open");
    if (static_cast<uint64_t>(st.st_size) < len)
      return InvalidArgument("shm fd holds " + std::to_string(st.st_size) + " bytes, less than the " +
                             std::to_string(len) + " registered");
    // Peers get a dup of it: seal it first, so none can shrink it under us (SIGBUS).
    PDKV_RETURN_IF_ERROR(detail::seal_against_resize(shm_fd));
    fd = ::fcntl(shm_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return Internal("dup of shm fd failed: errno " + std::to_string(errno));
  }
  struct FdGuard {
    int& fd;
    ~FdGuard() {
      if (fd >= 0) ::close(fd);
    }
  } guard{fd};
  detail::SharedPages pages;
  if (fd < 0 && kind == MemKind::kHost && remote_access && share_min_bytes > 0) {
    // Checked before the re-map too: the pages of a registered region must never move.
    {
      std::shared_lock<std::shared_mutex> lk(mu_);
      PDKV_RETURN_IF_ERROR(overlap_locked(addr, len));
    }
    std::string why_not;
    PDKV_ASSIGN_OR_RETURN(pages, detail::share_pages(addr, len, share_min_bytes, &why_not));
    fd = pages.fd;
    if (pages.len == 0)
      PDKV_LOG_DEBUG("memory %s stays private (cross-memory attach for shm peers): %s", range_str(addr, len).c_str(),
                     why_not.c_str());
  }
  std::unique_lock<std::shared_mutex> lk(mu_);
  if (Status overlap = overlap_locked(addr, len); !overlap.ok()) {
    if (pages.len) (void)detail::unshare_pages(addr, pages);  // a racing registration won
    return overlap;
  }
  auto e = std::make_shared<detail::RegionEntry>();
  const bool whole_memfd = fd >= 0 && pages.len == 0;  // Agent.alloc memory
  e->desc = RegionDesc{next_id_++, addr, len, kind, device, remote_access, whole_memfd,
                       whole_memfd ? 0 : pages.offset, whole_memfd ? len : pages.len};
  e->shm_fd = fd;
  e->remapped_offset = pages.offset;
  e->remapped_len = pages.len;
  e->memfd_dev = pages.dev;
  e->memfd_ino = pages.ino;
  fd = -1;
  by_addr_[addr] = e->desc.id;
  by_id_[e->desc.id] = e;
  return e->desc;
}

Status RegionTable::overlap_locked(uint64_t addr, uint64_t len) const {
  // Overlap with the region starting at or before addr, or the first one after it.
  auto it = by_addr_.upper_bound(addr);
  if (it != by_addr_.begin()) {
    auto prev = std::prev(it);
    const RegionDesc& d = by_id_.at(prev->second)->desc;
    if (d.addr + d.len > addr)
      return AlreadyExists("memory " + range_str(addr, len) + " overlaps registered region " + std::to_string(d.id) +
                           " " + range_str(d.addr, d.len) + "; register each pool once");
  }
  if (it != by_addr_.end() && it->first < addr + len) {
    const RegionDesc& d = by_id_.at(it->second)->desc;
    return AlreadyExists("memory " + range_str(addr, len) + " overlaps registered region " + std::to_string(d.id) +
                         " " + range_str(d.addr, d.len) + "; register each pool once");
  }
  return Status::Ok();
}

Result<std::shared_ptr<detail::RegionEntry>> RegionTable::take(uint64_t id) {
  std::unique_lock<std::shared_mutex> lk(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return NotFound("no registered region " + std::to_string(id));
  auto e = it->second;
  by_addr_.erase(e->desc.addr);
  by_id_.erase(it);
  e->revoked.store(true, std::memory_order_release);
  return e;
}

void RegionTable::wait_unpinned(const std::shared_ptr<detail::RegionEntry>& e) {
  std::unique_lock<std::mutex> lk(e->mu);
  e->cv.wait(lk, [&] { return e->inflight.load(std::memory_order_acquire) == 0; });
}

Status RegionTable::remove(uint64_t id) {
  PDKV_ASSIGN_OR_RETURN(auto e, take(id));
  wait_unpinned(e);
  return Status::Ok();
}

Result<RegionPin> RegionTable::pin(uint64_t id, uint64_t offset, uint64_t len, bool inbound, uint32_t kinds_mask,
                                   uint64_t* addr_out) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return NotFound("region " + std::to_string(id) + " is not registered");
  const auto& e = it->second;
  const RegionDesc& d = e->desc;
  if (inbound && !d.remote_access) return NotFound("region " + std::to_string(id) + " is not exported to peers");
  if (!(kinds_mask & mem_kind_bit(d.kind)))
    return NotSupported("region " + std::to_string(id) + " holds " + std::string(mem_kind_name(d.kind)) +
                        " memory, which this transport cannot access");
  if (offset > d.len || len > d.len - offset)
    return OutOfRange("bytes [" + std::to_string(offset) + ", " + std::to_string(offset) + "+" + std::to_string(len) +
                      ") fall outside region " + std::to_string(id) + " (" + std::to_string(d.len) + " bytes)");
  e->inflight.fetch_add(1, std::memory_order_acq_rel);
  if (addr_out) *addr_out = d.addr + offset;
  return RegionPin(e);
}

Result<RegionDesc> RegionTable::find(uint64_t addr, uint64_t len) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = by_addr_.upper_bound(addr);
  if (it != by_addr_.begin()) {
    const RegionDesc& d = by_id_.at(std::prev(it)->second)->desc;
    if (addr >= d.addr && addr - d.addr <= d.len && len <= d.len - (addr - d.addr)) return d;
  }
  return NotFound("memory " + range_str(addr, len) + " is not inside one registered region");
}

Result<int> RegionTable::dup_shm_fd(uint64_t id) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return NotFound("region " + std::to_string(id) + " is not registered");
  if (!it->second->desc.remote_access) return NotFound("region " + std::to_string(id) + " is not exported to peers");
  if (it->second->shm_fd < 0) return NotSupported("region " + std::to_string(id) + " is not backed by shared memory");
  int fd = ::fcntl(it->second->shm_fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return Internal("dup failed: errno " + std::to_string(errno));
  return fd;
}

Result<RegionDesc> RegionTable::get(uint64_t id) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return NotFound("region " + std::to_string(id) + " is not registered");
  return it->second->desc;
}

std::vector<RegionDesc> RegionTable::list() const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  std::vector<RegionDesc> out;
  out.reserve(by_addr_.size());
  for (const auto& [addr, id] : by_addr_) out.push_back(by_id_.at(id)->desc);
  return out;
}

}  // namespace pdkv
