// core/plan_runs.h: the planner's internals shared with the re-layout path
// (core/relayout.cc): what a plan moves, and the walk that cuts one (layer, part)
// pair into the longest runs contiguous on both sides.
//
// Thread safety: pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pdkv/kv_layout.h"
#include "pdkv/status.h"

namespace pdkv::planner {

// The tokens [0, num_tokens) and heads [offset, offset + num_heads) of each side.
struct RowRange {
  uint64_t num_tokens;
  uint32_t num_heads;
  uint32_t local_head_offset;
  uint32_t remote_head_offset;
};

// What plan_blocks() moves, validated: the segment range and rows, and whether every
// block maps to one block whole (equal shapes, every token and head).
struct PlanScope {
  size_t seg_begin = 0;
  size_t seg_end = 0;
  RowRange rows{0, 0, 0, 0};
  bool whole_blocks = false;
};

// plan_blocks()' checks (same errors); the scope they leave.
Result<PlanScope> plan_scope(const KVLayout& local, const std::vector<uint32_t>& lids, const KVLayout& remote,
                             const std::vector<uint32_t>& rids, const PlanOptions& opts);

// Calls emit(local_offset, remote_offset, len) for the runs of one (layer, part) pair,
// relative to `lbase`/`rbase` (absolute addresses when they are the segments' addr).
// Tokens are walked in chunks that stay inside one local and one remote block; inside
// a chunk both sides are affine in (token, head), so the longest runs contiguous on
// both sides follow from the strides: the whole chunk, one token's heads, one head's
// tokens, or single rows. Runs come in increasing token order.
template <class Emit>
void walk_segment_runs(uint64_t LT, const KVSegment& L, uint64_t lbase, const std::vector<uint32_t>& lids, uint64_t RT,
                       const KVSegment& R, uint64_t rbase, const std::vector<uint32_t>& rids, uint64_t row,
                       const RowRange& rr, Emit&& emit) {
  const uint64_t nh = rr.num_heads;
  const uint64_t la = lbase + rr.local_head_offset * L.head_stride;
  const uint64_t ra = rbase + rr.remote_head_offset * R.head_stride;
  const bool heads_run = nh == 1 || (L.head_stride == row && R.head_stride == row);
  const uint64_t unit = heads_run ? nh * row : row;  // bytes of one token's moved heads when they are one run
  for (uint64_t t = 0; t < rr.num_tokens;) {
    const uint64_t lslot = t % LT, rslot = t % RT;
    const uint64_t c = std::min({LT - lslot, RT - rslot, rr.num_tokens - t});
    const uint64_t lo = la + lids[t / LT] * L.block_stride + lslot * L.token_stride;
    const uint64_t ro = ra + rids[t / RT] * R.block_stride + rslot * R.token_stride;
    const bool tokens_run = c == 1 || (L.token_stride == unit && R.token_stride == unit);
    if (heads_run && tokens_run) {
      emit(lo, ro, c * unit);
    } else if (heads_run) {
      for (uint64_t i = 0; i < c; ++i) emit(lo + i * L.token_stride, ro + i * R.token_stride, unit);
    } else if (c == 1 || (L.token_stride == row && R.token_stride == row)) {
      for (uint64_t h = 0; h < nh; ++h) emit(lo + h * L.head_stride, ro + h * R.head_stride, c * row);
    } else {
      for (uint64_t i = 0; i < c; ++i)
        for (uint64_t h = 0; h < nh; ++h)
          emit(lo + i * L.token_stride + h * L.head_stride, ro + i * R.token_stride + h * R.head_stride, row);
    }
    t += c;
  }
}

// A run of `count` pieces of `len` bytes, piece i at local_offset + i * local_stride
// and remote_offset + i * remote_stride (count == 1: a plain extent, strides 0). What
// the planner hands a transport that takes strided runs (spi/transport.h
// ResolvedExtent): a peer's fragmented block costs one run, not one extent per token.
struct StridedExtent {
  uint64_t local_region = 0;
  uint64_t local_offset = 0;
  uint64_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t len = 0;
  uint64_t count = 1;
  uint64_t local_stride = 0;
  uint64_t remote_stride = 0;
};

// Appends `x` or extends the last run when `x` continues it: a plain extent that
// continues a plain one on both sides grows it; pieces of the same length that sit
// where the last run's next piece would (same strides) join it, and two plain
// extents of one length that touch on this side and not on the peer's become a run
// (the peer's scattered pieces; pieces scattered on this side too stay plain
// extents: measured, a run of them moved 0.7x the GB/s of the same plain extents).
// A run whose pieces touch on both sides is a plain extent.
inline void push_strided(std::vector<StridedExtent>& out, StridedExtent x) {
  if (x.count > 1 && x.local_stride == x.len && x.remote_stride == x.len) {
    x.len *= x.count;
    x.count = 1;
    x.local_stride = x.remote_stride = 0;
  }
  if (!out.empty()) {
    StridedExtent& b = out.back();
    if (b.local_region == x.local_region && b.remote_region == x.remote_region) {
      if (b.count == 1 && x.count == 1 && b.local_offset + b.len == x.local_offset &&
          b.remote_offset + b.len == x.remote_offset) {
        b.len += x.len;
        return;
      }
      if (b.len == x.len && b.count == 1 && x.count == 1 && x.local_offset == b.local_offset + b.len &&
          x.remote_offset >= b.remote_offset + b.len) {
        b.count = 2;
        b.local_stride = x.local_offset - b.local_offset;
        b.remote_stride = x.remote_offset - b.remote_offset;
        return;
      }
      if (b.len == x.len && (b.count > 1 || x.count > 1)) {
        const uint64_t ls = b.count > 1 ? b.local_stride : x.local_stride;
        const uint64_t rs = b.count > 1 ? b.remote_stride : x.remote_stride;
        const bool same = x.count == 1 || (x.local_stride == ls && x.remote_stride == rs);
        if (same && x.local_offset == b.local_offset + b.count * ls &&
            x.remote_offset == b.remote_offset + b.count * rs) {
          b.count += x.count;
          b.local_stride = ls;
          b.remote_stride = rs;
          return;
        }
      }
    }
  }
  out.push_back(x);
}

// walk_segment_runs() with each repeated piece pattern reported once:
// emit(local_offset, remote_offset, len, count, local_stride, remote_stride) covers
// `count` pieces. A chunk's pieces become one run per chunk (whole tokens' heads,
// or one head's tokens) or, when both token and head are cut, one run along the
// longer of the two.
template <class Emit>
void walk_segment_strided(uint64_t LT, const KVSegment& L, uint64_t lbase, const std::vector<uint32_t>& lids,
                          uint64_t RT, const KVSegment& R, uint64_t rbase, const std::vector<uint32_t>& rids,
                          uint64_t row, const RowRange& rr, Emit&& emit) {
  const uint64_t nh = rr.num_heads;
  const uint64_t la = lbase + rr.local_head_offset * L.head_stride;
  const uint64_t ra = rbase + rr.remote_head_offset * R.head_stride;
  const bool heads_run = nh == 1 || (L.head_stride == row && R.head_stride == row);
  const uint64_t unit = heads_run ? nh * row : row;
  for (uint64_t t = 0; t < rr.num_tokens;) {
    const uint64_t lslot = t % LT, rslot = t % RT;
    const uint64_t c = std::min({LT - lslot, RT - rslot, rr.num_tokens - t});
    const uint64_t lo = la + lids[t / LT] * L.block_stride + lslot * L.token_stride;
    const uint64_t ro = ra + rids[t / RT] * R.block_stride + rslot * R.token_stride;
    const bool tokens_run = c == 1 || (L.token_stride == unit && R.token_stride == unit);
    if (heads_run && tokens_run) {
      emit(lo, ro, c * unit, uint64_t(1), uint64_t(0), uint64_t(0));
    } else if (heads_run) {
      emit(lo, ro, unit, c, L.token_stride, R.token_stride);
    } else if (c == 1 || (L.token_stride == row && R.token_stride == row)) {
      emit(lo, ro, c * row, nh, L.head_stride, R.head_stride);
    } else if (c >= nh) {
      for (uint64_t h = 0; h < nh; ++h)
        emit(lo + h * L.head_stride, ro + h * R.head_stride, row, c, L.token_stride, R.token_stride);
    } else {
      for (uint64_t i = 0; i < c; ++i)
        emit(lo + i * L.token_stride, ro + i * R.token_stride, row, nh, L.head_stride, R.head_stride);
    }
    t += c;
  }
}

// plan_blocks() as strided runs (same checks and errors, same bytes in the same
// order once every run is expanded piece by piece, except that a run whose pieces
// are one head's tokens may come before the next head's): O(blocks x layers x parts)
// runs for any pair of layouts, O(layers x parts) when the block ids are consecutive.
Result<std::vector<StridedExtent>> plan_strided(const KVLayout& local, const std::vector<uint32_t>& lids,
                                                const KVLayout& remote, const std::vector<uint32_t>& rids,
                                                const PlanOptions& opts);

// What a transport that takes strided runs is handed for one (layer, part) pair: its
// coalesced runs, plus one per local piece of each run whose local pieces are apart
// (the tcp sender lists those one by one).
uint64_t strided_segment_cost(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                              const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr);

// How many extents walk_segment_runs() leaves after coalescing neighbours.
uint64_t count_segment_runs(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                            const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr);

}  // namespace pdkv::planner
