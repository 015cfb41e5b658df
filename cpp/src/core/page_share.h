// Sharing engine-allocated host memory with same-host peers (the shm transport).
//
// Memory pdkv allocates (Agent.alloc) is a memfd that a peer maps and copies into
// with memcpy. Memory an engine allocated itself (a torch/numpy pool) is private, so
// a peer could only reach it by cross-memory attach, 2.5-4x slower. At registration
// the whole pages inside such a region are re-mapped onto a new memfd at the same
// virtual addresses (contents copied first), so the engine's pointers stay valid and
// peers map the memfd like Agent.alloc memory. The partial pages at either end,
// which other allocations share, are left alone (cross-memory attach).
// At deregistration, after every transfer using the region finished, the pages are
// re-mapped back onto private memory holding the current contents: a peer that
// still maps the memfd (frozen, or slow to unmap) then aliases nothing of ours.
//
// Contract (docs/transports.md): the process must not write the region while it is
// being registered or deregistered (a write between the copy and the re-map would
// be lost); pdkv's own transfers never do. Only private anonymous read-write memory
// with ordinary pages is re-mapped (heap, malloc'd or mmapped pools); file mappings,
// shared mappings and hugetlbfs pages keep cross-memory attach, and so does every
// region of a process where CUDA is initialised (its pages may be pinned for DMA).
//
// Thread safety: the functions are reentrant; they change this process's mappings
// of the given range only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "pdkv/status.h"

namespace pdkv::detail {

// The memfd now backing bytes [offset, offset + len) of a registered region.
struct SharedPages {
  int fd = -1;          // the memfd; its holder closes it (unshare_pages does not)
  uint64_t offset = 0;  // from the region's start; a page boundary in memory
  uint64_t len = 0;     // whole pages; 0: nothing shared
  dev_t dev = 0;        // the memfd's identity, to recognise our mappings later
  ino_t ino = 0;
};

// Seals memfd `fd` against shrinking and growing, then against further seals
// (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): every memfd an agent hands a peer is
// sealed so, and a peer that ftruncate()s it gets EPERM instead of killing us with
// SIGBUS (a peer may still write its bytes: that is what the shm transport is for).
// OK if the file already carries both seals; InvalidArgument otherwise (a memfd made
// without MFD_ALLOW_SEALING, or sealed with F_SEAL_SEAL before).
Status seal_against_resize(int fd);

// Re-maps the whole pages of [addr, addr + len) onto a new memfd when they span at
// least `min_bytes` and are all private anonymous memory. Returns a window with
// len 0 (and says why in *why_not) when nothing is shared; an error only when the
// re-map failed half way and could not be undone.
Result<SharedPages> share_pages(uint64_t addr, uint64_t len, uint64_t min_bytes, std::string* why_not);

// Re-maps back onto private memory every part of the window that is still mapped
// from its memfd (the engine may have freed and reused the range: those parts are
// left alone); pages.len is 0 afterwards.
Status unshare_pages(uint64_t region_addr, SharedPages& pages);

}  // namespace pdkv::detail
