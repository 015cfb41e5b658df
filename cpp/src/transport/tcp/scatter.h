// Copies between one contiguous buffer and a list of extents (iovecs): the receiver
// scatters a landed chunk of payload into the destination extents, the sender
// gathers small extents into its staging chunk (out_msg.h).
//
// The scatter writes the pieces with streaming stores (util/piece_copy.h): a
// heterogeneous transfer's pieces are a few hundred bytes at a stride (a TP head
// split at llama-3-70b-tp8 geometry: 512 B at 1 KiB), where regular stores read
// every destination line before writing it. The gather reads scattered pieces into
// a cache-resident chunk, prefetching a few pieces ahead.
//
// Thread safety: pure functions over the caller's memory.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

namespace pdkv::tcp {

// A position in an iovec list: byte `off` of entry `idx` (idx == count: the end).
struct IovCursor {
  size_t idx = 0;
  size_t off = 0;
};

// Copies `n` bytes from `from` into dst[cur...], advancing `cur` (at most to the
// end of dst), and fences the streaming stores: the bytes are in place on return.
void scatter_to_iov(const iovec* dst, size_t ndst, IovCursor& cur, const char* from, uint64_t n);

// Copies up to `cap` bytes from src[cur...] into `to`, advancing `cur`; returns the
// bytes copied (less than `cap` only at the end of src).
size_t gather_from_iov(const iovec* src, size_t nsrc, IovCursor& cur, char* to, size_t cap);

}  // namespace pdkv::tcp
