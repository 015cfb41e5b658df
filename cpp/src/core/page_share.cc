#include "core/page_share.h"

#include <dlfcn.h>
#include <link.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "util/socket.h"

namespace pdkv::detail {
namespace {

// Re-mapping goes in chunks so the extra memory at any moment is one chunk, not the
// whole pool (the kernel merges the neighbouring memfd mappings into one VMA).
constexpr uint64_t kChunkBytes = 64ull << 20;

struct Vma {
  uint64_t start = 0, end = 0;
  bool readable = false, writable = false, is_private = false;
  uint64_t offset = 0;
  unsigned dev_major = 0, dev_minor = 0;
  uint64_t inode = 0;
  std::string path;
};

// This process's mappings overlapping [lo, hi), in address order.
Result<std::vector<Vma>> mappings_overlapping(uint64_t lo, uint64_t hi) {
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return Internal("cannot read /proc/self/maps: " + util::errno_str(errno));
  std::vector<Vma> out;
  char line[4096 + 256];
  while (std::fgets(line, sizeof line, f)) {
    Vma v;
    char perms[8] = {};
    int path_at = 0;
    if (std::sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %x:%x %" SCNu64 " %n", &v.start, &v.end, perms,
                    &v.offset, &v.dev_major, &v.dev_minor, &v.inode, &path_at) < 7)
      continue;
    if (v.end <= lo || v.start >= hi) continue;
    v.readable = perms[0] == 'r';
    v.writable = perms[1] == 'w';
    v.is_private = perms[3] == 'p';
    if (path_at > 0) {
      v.path = line + path_at;
      while (!v.path.empty() && (v.path.back() == '\n' || v.path.back() == ' ')) v.path.pop_back();
    }
    out.push_back(std::move(v));
  }
  std::fclose(f);
  return out;
}

// Private anonymous memory with ordinary pages: what malloc, numpy and torch's CPU
// allocator hand out. Named anonymous memory ("[anon:...]", the heap) counts.
bool is_plain_anonymous(const Vma& v) {
  if (!v.readable || !v.writable || !v.is_private || v.inode != 0) return false;
  return v.path.empty() || v.path == "[heap]" || v.path.rfind("[anon:", 0) == 0;
}

// Empty when [lo, hi) is entirely plain anonymous memory, else why not.
std::string why_not_shareable(const std::vector<Vma>& vmas, uint64_t lo, uint64_t hi) {
  uint64_t at = lo;
  for (const Vma& v : vmas) {
    if (v.start > at) break;  // a hole
    if (!is_plain_anonymous(v))
      return "its pages are not private anonymous memory (" + (v.path.empty() ? std::string("a shared or file mapping")
                                                                               : v.path) + ")";
    at = v.end;
    if (at >= hi) return {};
  }
  return "part of it is not mapped";
}

// The path of a loaded CUDA driver library (libcuda.so*, or the one $PDKV_CUDA_DRIVER
// names), or "" when none is loaded. Looked up in the loader's list, not by a failing
// dlopen: that would leave the thread's dlerror state allocated for good.
std::string loaded_cuda_driver() {
  struct Search {
    std::string custom, found;
  } search;
  if (const char* c = std::getenv("PDKV_CUDA_DRIVER"); c && *c) search.custom = c;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        const std::string path = info->dlpi_name ? info->dlpi_name : "";
        const std::string base = path.substr(path.rfind('/') + 1);
        const bool custom = !s->custom.empty() && (path == s->custom || base == s->custom);
        if (custom || base.rfind("libcuda.so", 0) == 0) {
          s->found = path;
          return 1;
        }
        return 0;
      },
      &search);
  return search.found;
}

// Non-empty (why not) when CUDA is in use in this process. Pages pinned for DMA
// (cudaHostRegister, or torch's pinned_use_cuda_host_register) are private anonymous
// memory too, but re-mapping them would leave the device's DMA on the old physical
// pages: silent corruption. Which ranges are pinned cannot be listed, so once a CUDA
// driver is loaded AND initialised here, nothing is re-mapped. Probing never loads or
// initialises CUDA: an unloaded library or CUDA_ERROR_NOT_INITIALIZED means no pins.
std::string cuda_in_use(uint64_t addr) {
  const std::string lib = loaded_cuda_driver();
  if (lib.empty()) return {};
  void* h = ::dlopen(lib.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // loaded: succeeds, only a reference
  if (!h) return {};
  using GetAttr = int (*)(void*, int, unsigned long long);
  auto get_attr = reinterpret_cast<GetAttr>(::dlsym(h, "cuPointerGetAttribute"));
  unsigned memory_type = 0;
  constexpr int kNotInitialized = 3, kAttrMemoryType = 2;
  const int r = get_attr ? get_attr(&memory_type, kAttrMemoryType, addr) : kNotInitialized;
  ::dlclose(h);
  if (r != kNotInitialized)
    return "CUDA is initialised in this process, and pages pinned for DMA (cudaHostRegister) must not be re-mapped";
  return {};
}

// Replaces [dst, dst + n) with memfd bytes [off, off + n) after copying the current
// contents into them.
Status move_chunk_to_memfd(int fd, uint64_t dst, uint64_t off, uint64_t n) {
  for (uint64_t done = 0; done < n;) {
    ssize_t w = ::pwrite(fd, reinterpret_cast<const char*>(dst + done), n - done, static_cast<off_t>(off + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Internal("copying registered pages into a memfd failed: " + util::errno_str(errno));
    done += static_cast<uint64_t>(w);
  }
  void* p = ::mmap(reinterpret_cast<void*>(dst), n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                   static_cast<off_t>(off));
  if (p == MAP_FAILED) return Internal("re-mapping registered pages onto a memfd failed: " + util::errno_str(errno));
  return Status::Ok();
}

// Replaces [dst, dst + n) with private anonymous memory holding its current contents.
Status move_chunk_to_private(uint64_t dst, uint64_t n) {
  void* tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (tmp == MAP_FAILED) return Internal("allocating private pages failed: " + util::errno_str(errno));
  std::memcpy(tmp, reinterpret_cast<const void*>(dst), n);
  void* p = ::mremap(tmp, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(dst));
  if (p == MAP_FAILED) {
    const int err = errno;
    ::munmap(tmp, n);
    return Internal("re-mapping shared pages back to private memory failed: " + util::errno_str(err));
  }
  return Status::Ok();
}

}  // namespace

Status seal_against_resize(int fd) {
  constexpr int kResize = F_SEAL_SHRINK | F_SEAL_GROW;
  if (::fcntl(fd, F_ADD_SEALS, kResize | F_SEAL_SEAL) == 0) return Status::Ok();
  const int err = errno;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && (seals & kResize) == kResize) return Status::Ok();
  return InvalidArgument("a memfd shared with peers must be sealed against resizing, and sealing this one failed (" +
                         util::errno_str(err) + "); create it with MFD_ALLOW_SEALING");
}

Result<SharedPages> share_pages(uint64_t addr, uint64_t len, uint64_t min_bytes, std::string* why_not) {
  SharedPages none;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t lo = (addr + page - 1) / page * page;
  const uint64_t hi = (addr + len) / page * page;
  if (min_bytes == 0) {
    *why_not = "sharing registered pages is off (ShmOptions.share_pages_min_bytes = 0)";
    return none;
  }
  if (hi <= lo || hi - lo < min_bytes) {
    *why_not = "its whole pages span fewer than " + std::to_string(min_bytes) + " bytes";
    return none;
  }
  PDKV_ASSIGN_OR_RETURN(auto vmas, mappings_overlapping(lo, hi));
  *why_not = why_not_shareable(vmas, lo, hi);
  if (why_not->empty()) *why_not = cuda_in_use(lo);
  if (!why_not->empty()) return none;

  int fd = ::memfd_create("pdkv-registered", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Internal("memfd_create failed: " + util::errno_str(errno));
  struct stat st {};
  if (::ftruncate(fd, static_cast<off_t>(hi - lo)) != 0 || ::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ResourceExhausted("sizing a memfd of " + std::to_string(hi - lo) + " bytes failed: " + util::errno_str(err));
  }
  // Peers get this fd: sealed before any page of ours lives in it.
  if (Status sealed = seal_against_resize(fd); !sealed.ok()) {
    ::close(fd);
    *why_not = sealed.message();
    return none;
  }
  SharedPages sp{fd, lo - addr, hi - lo, st.st_dev, st.st_ino};
  for (uint64_t off = 0; off < sp.len; off += kChunkBytes) {
    Status s = move_chunk_to_memfd(fd, lo + off, off, std::min(kChunkBytes, sp.len - off));
    if (s.ok()) continue;
    // Give back what was moved (the failed chunk is intact unless the kernel dropped it).
    SharedPages moved = sp;
    moved.len = off;
    Status undo = unshare_pages(addr, moved);
    ::close(fd);
    if (!undo.ok()) return undo.with_context(s.message());
    *why_not = s.message();
    return none;
  }
  return sp;
}

Status unshare_pages(uint64_t region_addr, SharedPages& pages) {
  const uint64_t lo = region_addr + pages.offset, hi = lo + pages.len;
  Status result;
  if (pages.len > 0) {
    auto vmas = mappings_overlapping(lo, hi);
    if (!vmas.ok()) result = vmas.status();
    for (const Vma& v : vmas.ok() ? *vmas : std::vector<Vma>{}) {
      // Ours: a mapping of this memfd at the offset it was placed at.
      const bool ours = v.inode == static_cast<uint64_t>(pages.ino) && v.dev_major == major(pages.dev) &&
                        v.dev_minor == minor(pages.dev) && !v.is_private && v.offset == v.start - lo;
      if (!ours) continue;
      const uint64_t from = std::max(v.start, lo), to = std::min(v.end, hi);
      for (uint64_t at = from; at < to && result.ok(); at += kChunkBytes)
        result = move_chunk_to_private(at, std::min(kChunkBytes, to - at));
    }
  }
  pages.len = 0;
  return result;
}

}  // namespace pdkv::detail
