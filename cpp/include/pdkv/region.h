// pdkv/region.h (public, for users): the descriptor of a registered memory region.
// The table that validates every access (RegionTable, RegionPin) is for transport
// authors: pdkv/spi/region_table.h.
//
// A region is [addr, addr + len) of host or device memory that an Agent may read
// from or write into. Rules (deterministic, and tested):
//   * Registering a range that overlaps an existing region (including the exact same
//     range) fails with AlreadyExists naming the other region. Register a pool once.
//   * A zero-length range fails with InvalidArgument.
//   * Deregistration removes the region at once (new transfers and inbound requests
//     that name it fail with NotFound), then blocks until every transfer already
//     using it has finished, so the memory may be freed as soon as it returns.
//
// Thread safety: RegionDesc is a plain value.
#pragma once

#include <cstdint>

#include "pdkv/types.h"

namespace pdkv {

struct RegionDesc {
  uint64_t id = 0;
  uint64_t addr = 0;   // in the owner's address space (device pointer for kCuda)
  uint64_t len = 0;    // bytes
  MemKind kind = MemKind::kHost;
  int32_t device = -1;  // CUDA ordinal for kCuda, -1 for host
  bool remote_access = true;  // peers may read/write it (exported in metadata)
  bool shareable = false;     // backed by a memfd a same-host peer can map (shm transport)
  // Bytes [shared_offset, shared_offset + shared_len) are memfd-backed, so same-host
  // peers copy into them directly: all of an Agent.alloc region; the whole pages of
  // engine memory re-mapped at registration (ShmOptions.share_pages_min_bytes); 0
  // bytes otherwise (peers use cross-memory attach).
  uint64_t shared_offset = 0;
  uint64_t shared_len = 0;
};

}  // namespace pdkv
