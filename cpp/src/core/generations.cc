#include "pdkv/spi/generations.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <unordered_set>

#include "pdkv/metadata.h"
#include "util/bytes.h"

namespace pdkv {
namespace detail {

// One layout's generations and pins; guarded by mu. Pins outlive the table entry
// (a layout removed while a transfer holds its blocks).
struct LayoutGens {
  std::string name;
  std::mutex mu;
  std::condition_variable cv;  // a pin count dropped to 0
  std::vector<uint32_t> gen;
  std::vector<uint32_t> pins;
  // The published copy of gen (docs/wire-shm.md "Shared generation tables"): a sealed
  // memfd of gen.size() u32s that same-host readers map read-only. Written under mu
  // with release stores; 0 everywhere once the layout is removed. -1/nullptr when the
  // memfd could not be made (readers then fall back to leases).
  int fd = -1;
  uint32_t* shared = nullptr;
  size_t shared_len = 0;
  void publish(uint32_t id) {
    if (shared) __atomic_store_n(&shared[id], gen[id], __ATOMIC_RELEASE);
  }
  ~LayoutGens() {
    if (shared) ::munmap(shared, shared_len);
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace detail

namespace {

uint32_t next_gen(uint32_t g) { return g == UINT32_MAX ? 1 : g + 1; }  // 0 is never a generation

Status block_out_of_range(const detail::LayoutGens& l, uint32_t id) {
  return OutOfRange("block " + std::to_string(id) + " is beyond layout '" + l.name + "' (" +
                    std::to_string(l.gen.size()) + " blocks)");
}

}  // namespace

Status validate_claim(const GenClaim& c) {
  PDKV_RETURN_IF_ERROR(validate_name("claimed layout name", c.layout));
  if (c.blocks.size() != c.gens.size())
    return InvalidArgument("block generations: " + std::to_string(c.gens.size()) + " generations for " +
                           std::to_string(c.blocks.size()) + " blocks");
  if (c.blocks.empty()) return InvalidArgument("block generations: no blocks");
  if (c.blocks.size() > kMaxClaimBlocks)
    return InvalidArgument("block generations: " + std::to_string(c.blocks.size()) + " blocks (limit " +
                           std::to_string(kMaxClaimBlocks) + " per transfer)");
  for (size_t i = 0; i < c.gens.size(); ++i)
    if (c.gens[i] == 0)
      return InvalidArgument("block generations: entry " + std::to_string(i) + " (block " +
                             std::to_string(c.blocks[i]) + ") has generation 0, which no block ever has");
  return Status::Ok();
}

std::string encode_claim(const GenClaim& c) {
  util::ByteWriter w;
  w.put_str(c.layout);
  w.put<uint32_t>(static_cast<uint32_t>(c.blocks.size()));
  for (size_t i = 0; i < c.blocks.size(); ++i) {
    w.put<uint32_t>(c.blocks[i]);
    w.put<uint32_t>(c.gens[i]);
  }
  return w.take();
}

Result<GenClaim> decode_claim(std::string_view in) {
  if (in.size() > kMaxClaimBytes)
    return ProtocolError("block generations are " + std::to_string(in.size()) + " bytes (limit " +
                         std::to_string(kMaxClaimBytes) + ")");
  util::ByteReader r(in);
  GenClaim c;
  PDKV_RETURN_IF_ERROR(r.get_str(&c.layout, "claimed layout name", 128));
  uint32_t n = 0;
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "block generation count", 8, kMaxClaimBlocks));
  c.blocks.resize(n);
  c.gens.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    PDKV_RETURN_IF_ERROR(r.get(&c.blocks[i], "block"));
    PDKV_RETURN_IF_ERROR(r.get(&c.gens[i], "generation"));
  }
  if (r.remaining() != 0)
    return ProtocolError("block generations have " + std::to_string(r.remaining()) + " trailing bytes");
  Status v = validate_claim(c);
  if (!v.ok()) return ProtocolError(v.message());
  return c;
}

void GenPin::reset() {
  if (!l_) return;
  bool released = false;
  {
    std::lock_guard<std::mutex> lk(l_->mu);
    for (uint32_t b : blocks_) released |= --l_->pins[b] == 0;
  }
  if (released) l_->cv.notify_all();
  l_.reset();
  blocks_.clear();
}

Status GenerationTable::add_layout(const std::string& name, uint32_t num_blocks) {
  auto l = std::make_shared<detail::LayoutGens>();
  l->name = name;
  std::lock_guard<std::mutex> lk(mu_);
  if (layouts_.count(name)) return AlreadyExists("generations of layout '" + name + "' exist already");
  auto it = retired_.find(name);
  const uint32_t start = it == retired_.end() ? 1 : next_gen(it->second);
  l->gen.assign(num_blocks, start);
  l->pins.assign(num_blocks, 0);
  share(*l);
  layouts_.emplace(name, std::move(l));
  return Status::Ok();
}

void GenerationTable::remove_layout(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = layouts_.find(name);
  if (it == layouts_.end()) return;
  uint32_t top = 0;
  {
    std::lock_guard<std::mutex> lk2(it->second->mu);
    for (uint32_t g : it->second->gen) top = std::max(top, g);
  }
  {
    // Readers still mapping the table see 0 (no generation) and fail their claims.
    std::lock_guard<std::mutex> lk2(it->second->mu);
    if (it->second->shared)
      for (size_t i = 0; i < it->second->gen.size(); ++i) __atomic_store_n(&it->second->shared[i], 0u, __ATOMIC_RELEASE);
  }
  auto& r = retired_[name];
  r = std::max(r, top);
  layouts_.erase(it);
}

void GenerationTable::share(detail::LayoutGens& l) {
  if (l.gen.empty()) return;
  const size_t len = l.gen.size() * sizeof(uint32_t);
  int fd = ::memfd_create(("pdkv-gens-" + l.name).substr(0, 240).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return;
  void* p = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(len)) == 0)
    p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  // A reader maps exactly len bytes; the seals keep the file from shrinking under it,
  // and the table's values are our word only: F_SEAL_FUTURE_WRITE (after our own
  // writable mapping exists, which keeps working) refuses every later write(), and
  // every new writable shared mapping, to anyone holding the file. A kernel without
  // it (< 5.1) shares no table: readers take leases instead.
  if (p == MAP_FAILED ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    if (p != MAP_FAILED) ::munmap(p, len);
    ::close(fd);
    return;
  }
  l.fd = fd;
  l.shared = static_cast<uint32_t*>(p);
  l.shared_len = len;
  for (uint32_t i = 0; i < l.gen.size(); ++i) l.publish(i);
}

Result<int> GenerationTable::dup_shared_fd(const std::string& layout, uint32_t* num_blocks) const {
  PDKV_ASSIGN_OR_RETURN(auto l, find(layout));
  if (l->fd < 0) return NotSupported("layout '" + layout + "' has no shared generation table");
  // Peers get a read-only open of the file (not a dup of our read-write one): it can
  // be neither written nor mapped writable, even before the seals are looked at.
  int fd = ::open(("/proc/self/fd/" + std::to_string(l->fd)).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotSupported("layout '" + layout + "': reopening its generation table read-only failed (" +
                                  std::string(std::strerror(errno)) + "; is /proc mounted?)");
  *num_blocks = static_cast<uint32_t>(l->gen.size());
  return fd;
}

Result<std::shared_ptr<detail::LayoutGens>> GenerationTable::find(const std::string& layout) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = layouts_.find(layout);
  if (it == layouts_.end()) return NotFound("no layout named '" + layout + "'");
  return it->second;
}

Result<std::vector<uint32_t>> GenerationTable::get(const std::string& layout, const std::vector<uint32_t>& ids) const {
  PDKV_ASSIGN_OR_RETURN(auto l, find(layout));
  std::vector<uint32_t> out;
  out.reserve(ids.size());
  std::lock_guard<std::mutex> lk(l->mu);
  for (uint32_t id : ids) {
    if (id >= l->gen.size()) return block_out_of_range(*l, id);
    out.push_back(l->gen[id]);
  }
  return out;
}

Result<std::vector<uint32_t>> GenerationTable::bump(const std::string& layout, const std::vector<uint32_t>& ids,
                                                    double timeout_s) {
  PDKV_ASSIGN_OR_RETURN(auto l, find(layout));
  std::unordered_set<uint32_t> seen;
  seen.reserve(ids.size());
  std::vector<uint32_t> out;
  out.reserve(ids.size());
  std::unique_lock<std::mutex> lk(l->mu);
  for (uint32_t id : ids) {
    if (id >= l->gen.size()) return block_out_of_range(*l, id);
    if (!seen.insert(id).second)
      return InvalidArgument("block " + std::to_string(id) + " is named twice in a generation bump");
  }
  for (uint32_t id : ids) {
    l->gen[id] = next_gen(l->gen[id]);
    l->publish(id);
    out.push_back(l->gen[id]);
  }
  auto unpinned = [&] {
    return std::all_of(ids.begin(), ids.end(), [&](uint32_t id) { return l->pins[id] == 0; });
  };
  if (timeout_s < 0) {
    l->cv.wait(lk, unpinned);
  } else if (!l->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), unpinned)) {
    uint32_t busy = 0, first = 0;
    for (uint32_t id : ids)
      if (l->pins[id]) first = busy++ ? first : id;
    return TimeoutError("layout '" + layout + "': block " + std::to_string(first) + (busy > 1 ? " (and " +
                        std::to_string(busy - 1) + " more)" : "") + " still in use by a transfer accepted under "
                        "its old generation after " + std::to_string(timeout_s) + " s; the new generations are in "
                        "force (new transfers naming the old ones fail) but that transfer may still touch the block");
  }
  return out;
}

Result<GenPin> GenerationTable::check_and_pin(const GenClaim& claim) {
  PDKV_RETURN_IF_ERROR(validate_claim(claim));
  PDKV_ASSIGN_OR_RETURN(auto l, find(claim.layout));
  {
    std::lock_guard<std::mutex> lk(l->mu);
    for (size_t i = 0; i < claim.blocks.size(); ++i) {
      const uint32_t id = claim.blocks[i];
      if (id >= l->gen.size()) return block_out_of_range(*l, id);
      if (l->gen[id] != claim.gens[i])
        return StaleBlock("layout '" + claim.layout + "' block " + std::to_string(id) + ": the transfer expects "
                          "generation " + std::to_string(claim.gens[i]) + ", the block is at generation " +
                          std::to_string(l->gen[id]) + " (freed or reused since it was handed out); nothing was "
                          "transferred");
    }
    for (uint32_t id : claim.blocks) ++l->pins[id];
  }
  return GenPin(std::move(l), claim.blocks);
}

}  // namespace pdkv
