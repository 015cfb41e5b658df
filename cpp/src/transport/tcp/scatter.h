// Copies between one contiguous buffer and a list of extents (iovecs) or strided
// runs (PieceRun): the receiver scatters a landed chunk of payload into the
// destination extents, the sender gathers small extents into its staging chunk
// (out_msg.h).
//
// Strided runs are walked lazily: a heterogeneous transfer's pieces (a TP head split:
// 512 B at a 1 KiB stride, 100k+ of them per request) are generated from their run
// while copying, so nobody lists one iovec per piece at prepare (or per frame).
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
#include <vector>

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

// `count` pieces of `len` bytes, piece i at base + i * stride (count == 1: one plain
// extent, stride unused), the whole repeated `count2` times, repetition j at
// base + j * stride2 (count2 == 1: one level, stride2 unused); the pieces come
// repetition by repetition. Whoever builds one has checked it lies in memory it may
// touch and that no two of its pieces overlap (stride >= len when count > 1; the
// levels nest: planner::nested_disjoint).
struct PieceRun {
  char* base = nullptr;
  uint64_t len = 0;
  uint64_t count = 1;
  uint64_t stride = 0;
  uint64_t count2 = 1;
  uint64_t stride2 = 0;

  uint64_t pieces() const { return count * count2; }
  uint64_t bytes() const { return len * count * count2; }
  // The pieces as separate extents would number this many (touching pieces are one;
  // a run is normalized by make_run).
  uint64_t extents() const { return (count > 1 && stride != len ? count : 1) * count2; }
};

// The run of `count` x `count2` pieces in its simplest form: a level whose pieces
// touch folds into longer pieces, a level of one repetition folds away (the same
// bytes in the same order).
PieceRun make_run(char* base, uint64_t len, uint64_t count, uint64_t stride, uint64_t count2 = 1,
                  uint64_t stride2 = 0);

// A position in a PieceRun list: byte `off` of piece `piece` of repetition `rep` of
// run `idx` (idx == count: the end).
struct RunCursor {
  size_t idx = 0;
  uint64_t piece = 0;
  uint64_t off = 0;
  uint64_t rep = 0;
};

// scatter_to_iov / gather_from_iov over strided runs, one level or two (the same
// contracts; a chunk may end anywhere inside a piece and the next call resumes there).
void scatter_to_runs(const PieceRun* dst, size_t ndst, RunCursor& cur, const char* from, uint64_t n);
size_t gather_from_runs(const PieceRun* src, size_t nsrc, RunCursor& cur, char* to, size_t cap);

// Every piece of `runs` as its own iovec, in order (a run whose pieces touch is one;
// callers bound the pieces: kMaxStridedPieces per frame),
// appended to `out`: for the paths that need a list (the kernel's recvmsg/sendmsg
// straight into memory, codecs, device staging).
void append_iovecs(const PieceRun* runs, size_t n, std::vector<iovec>& out);

}  // namespace pdkv::tcp
