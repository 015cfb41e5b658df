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

// How many extents walk_segment_runs() leaves after coalescing neighbours.
uint64_t count_segment_runs(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                            const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr);

}  // namespace pdkv::planner
