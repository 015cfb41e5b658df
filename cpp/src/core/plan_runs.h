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
//
// A two-level run repeats that whole run `count2` times, repetition j shifted by
// j * local_stride2 / j * remote_stride2 (count2 == 1: one level, strides2 0): what
// NHD <-> HND with several heads needs (one head's tokens, repeated per head or per
// block), handed only to a transport with caps().two_level_extents.
struct StridedExtent {
  uint64_t local_region = 0;
  uint64_t local_offset = 0;
  uint64_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t len = 0;
  uint64_t count = 1;
  uint64_t local_stride = 0;
  uint64_t remote_stride = 0;
  uint64_t count2 = 1;
  uint64_t local_stride2 = 0;
  uint64_t remote_stride2 = 0;
};

// Whether the count x count2 pieces of `len` bytes at i * stride + j * stride2 are
// pairwise disjoint because one level nests inside the other's gaps: every piece of
// an inner repetition ends before the next repetition starts (stride2 >= span of the
// inner run), or one inner step jumps over every repetition (stride >= span of the
// outer level). Overflow-safe: a span past 2^64 is not nested.
inline bool nested_disjoint(uint64_t len, uint64_t count, uint64_t stride, uint64_t count2, uint64_t stride2) {
  auto span = [len](uint64_t n, uint64_t st, uint64_t* out) {
    uint64_t steps = 0;
    return !__builtin_mul_overflow(n - 1, st, &steps) && !__builtin_add_overflow(steps, len, out);
  };
  uint64_t inner = 0, outer = 0;
  if (count <= 1 || count2 <= 1) return (count <= 1 || stride >= len) && (count2 <= 1 || stride2 >= len);
  if (stride >= len && span(count, stride, &inner) && stride2 >= inner) return true;
  return stride2 >= len && span(count2, stride2, &outer) && stride >= outer;
}

// Appends `x` or extends the last run when `x` continues it: a plain extent that
// continues a plain one on both sides grows it; pieces of the same length that sit
// where the last run's next piece would (same strides) join it, and two plain
// extents of one length that touch on this side and not on the peer's become a run
// (the peer's scattered pieces; pieces scattered on this side too stay plain
// extents: measured, a run of them moved 0.7x the GB/s of the same plain extents).
// A run whose pieces touch on both sides is a plain extent.
inline void push_strided(std::vector<StridedExtent>& out, StridedExtent x) {
  if (x.count2 > 1 || (!out.empty() && out.back().count2 > 1)) {  // two-level runs come whole
    out.push_back(x);
    return;
  }
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

// A run of `n` pieces repeated `n2` times, in its simplest form: a level of one piece
// or of touching pieces folds away (a plain extent or a one-level run when it can).
inline StridedExtent two_level_run(uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t ls, uint64_t rs,
                                   uint64_t n2, uint64_t ls2, uint64_t rs2) {
  if (n > 1 && ls == len && rs == len) {
    len *= n;
    n = 1;
  }
  if (n == 1) {
    n = n2;
    ls = ls2;
    rs = rs2;
    n2 = 1;
  }
  if (n > 1 && n2 == 1 && ls == len && rs == len) {
    len *= n;
    n = 1;
  }
  if (n == 1) ls = rs = 0;
  if (n2 == 1) ls2 = rs2 = 0;
  return StridedExtent{0, lo, 0, ro, len, n, ls, rs, n2, ls2, rs2};
}

// Most bytes one head's pass over a group of spans moves before the next head's pass
// walks the same spans again (walk_segment_two_level): about what stays in a core's
// L2 between the passes.
inline constexpr uint64_t kHeadPassBytes = 256u << 10;

// walk_segment_strided() for a transport that takes two-level runs. Only where both
// token and head are cut (NHD <-> HND with several heads moved) does it differ: the
// chunks are joined into spans along which both sides stay affine in the token
// (consecutive blocks of a contiguous pool), spans that follow each other at one
// distance into groups, and a group of g spans becomes one run per head (the head's
// tokens, repeated per span) when the heads are fewer than the spans, else one run
// per span (its tokens, repeated per head); a head's run covers at most
// `head_pass_bytes` of spans (kHeadPassBytes; UINT64_MAX: no limit), so a large
// group takes several such passes, or one run per span where a pass would hold no
// more spans than heads. O(chunks) work; with consecutive block ids O(heads) runs per
// (layer, part) and head_pass_bytes moved, at most one per span, with scattered ids
// one per chunk. A run whose
// levels would not nest (nested_disjoint) is emitted per head instead.
// emit(const StridedExtent&) gets runs with regions 0, offsets from lbase/rbase.
template <class Emit>
void walk_segment_two_level(uint64_t LT, const KVSegment& L, uint64_t lbase, const std::vector<uint32_t>& lids,
                            uint64_t RT, const KVSegment& R, uint64_t rbase, const std::vector<uint32_t>& rids,
                            uint64_t row, const RowRange& rr, uint64_t head_pass_bytes, Emit&& emit) {
  const uint64_t nh = rr.num_heads;
  const bool heads_run = nh == 1 || (L.head_stride == row && R.head_stride == row);
  if (heads_run || (L.token_stride == row && R.token_stride == row)) {
    walk_segment_strided(LT, L, lbase, lids, RT, R, rbase, rids, row, rr,
                         [&](uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t ls, uint64_t rs) {
                           emit(StridedExtent{0, lo, 0, ro, len, n, ls, rs});
                         });
    return;
  }
  struct Span {
    uint64_t lo, ro, tokens;
  };
  std::vector<Span> spans;
  const uint64_t la = lbase + rr.local_head_offset * L.head_stride;
  const uint64_t ra = rbase + rr.remote_head_offset * R.head_stride;
  for (uint64_t t = 0; t < rr.num_tokens;) {
    const uint64_t lslot = t % LT, rslot = t % RT;
    const uint64_t c = std::min({LT - lslot, RT - rslot, rr.num_tokens - t});
    const uint64_t lo = la + lids[t / LT] * L.block_stride + lslot * L.token_stride;
    const uint64_t ro = ra + rids[t / RT] * R.block_stride + rslot * R.token_stride;
    if (!spans.empty() && lo == spans.back().lo + spans.back().tokens * L.token_stride &&
        ro == spans.back().ro + spans.back().tokens * R.token_stride) {
      spans.back().tokens += c;
    } else {
      spans.push_back(Span{lo, ro, c});
    }
    t += c;
  }
  auto nested = [&](uint64_t n, uint64_t ls, uint64_t rs, uint64_t n2, uint64_t ls2, uint64_t rs2) {
    return nested_disjoint(row, n, ls, n2, ls2) && nested_disjoint(row, n, rs, n2, rs2);
  };
  auto per_span = [&](const Span& x) {
    if (nested(x.tokens, L.token_stride, R.token_stride, nh, L.head_stride, R.head_stride)) {
      emit(two_level_run(x.lo, x.ro, row, x.tokens, L.token_stride, R.token_stride, nh, L.head_stride,
                         R.head_stride));
      return;
    }
    for (uint64_t h = 0; h < nh; ++h)
      emit(two_level_run(x.lo + h * L.head_stride, x.ro + h * R.head_stride, row, x.tokens, L.token_stride,
                         R.token_stride, 1, 0, 0));
  };
  for (size_t i = 0; i < spans.size();) {
    const Span& s = spans[i];
    size_t g = 1;
    uint64_t dl = 0, dr = 0;
    if (i + 1 < spans.size() && spans[i + 1].lo > s.lo && spans[i + 1].ro > s.ro) {
      dl = spans[i + 1].lo - s.lo;
      dr = spans[i + 1].ro - s.ro;
      while (i + g < spans.size() && spans[i + g].tokens == s.tokens && spans[i + g].lo == s.lo + g * dl &&
             spans[i + g].ro == s.ro + g * dr)
        ++g;
    }
    // A head's run walks every span of its group; the next head walks them again.
    // Passes of more than kHeadPassBytes leave the cache between heads (both ends
    // touch each line once per head), so a group is cut into passes of at most `pass`
    // spans, and where a pass would hold no more spans than there are heads, each
    // span is its own run (its tokens, repeated per head: every line of the block
    // touched once, one contiguous span on the side whose heads are outermost).
    const uint64_t span_bytes = s.tokens * nh * row;
    const size_t pass = static_cast<size_t>(std::max<uint64_t>(1, head_pass_bytes / std::max<uint64_t>(1, span_bytes)));
    if (g > 1 && nh < std::min(g, pass) && nested(s.tokens, L.token_stride, R.token_stride, g, dl, dr)) {
      for (size_t at = i; at < i + g;) {
        const size_t k = std::min(pass, i + g - at);
        if (k <= nh) {
          for (size_t j = at; j < at + k; ++j) per_span(spans[j]);
        } else {
          const Span& f = spans[at];
          for (uint64_t h = 0; h < nh; ++h)
            emit(two_level_run(f.lo + h * L.head_stride, f.ro + h * R.head_stride, row, f.tokens, L.token_stride,
                               R.token_stride, k, dl, dr));
        }
        at += k;
      }
      i += g;
      continue;
    }
    for (size_t k = i; k < i + g; ++k) per_span(spans[k]);
    i += g;
  }
}

// plan_blocks() as strided runs (same checks and errors, same bytes in the same
// order once every run is expanded piece by piece, except that a run whose pieces
// are one head's tokens may come before the next head's): O(blocks x layers x parts)
// runs for any pair of layouts, O(layers x parts) when the block ids are consecutive.
// With `two_level` (a transport with caps().two_level_extents), runs may have two
// levels (walk_segment_two_level): O(heads x layers x parts) runs for NHD <-> HND with
// consecutive block ids instead of O(blocks x heads x layers x parts); and where the
// pools' (layer, part) segments are evenly spaced in one region each (a contiguous
// pool), a run repeated in every segment is one two-level run across them: O(blocks)
// runs (x heads where both sides cut rows) for scattered block ids.
Result<std::vector<StridedExtent>> plan_strided(const KVLayout& local, const std::vector<uint32_t>& lids,
                                                const KVLayout& remote, const std::vector<uint32_t>& rids,
                                                const PlanOptions& opts, bool two_level = false);
// plan_strided() into `out` (cleared first; its capacity is kept): a caller that plans
// often reuses one vector instead of faulting in fresh pages for every plan.
Status plan_strided_into(std::vector<StridedExtent>& out, const KVLayout& local, const std::vector<uint32_t>& lids,
                         const KVLayout& remote, const std::vector<uint32_t>& rids, const PlanOptions& opts,
                         bool two_level = false);

// What a transport that takes strided runs is handed for one (layer, part) pair: its
// coalesced runs, plus one per local piece of each run whose local pieces are apart
// (the tcp sender lists those one by one).
uint64_t strided_segment_cost(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                              const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr);

// How many extents walk_segment_runs() leaves after coalescing neighbours.
uint64_t count_segment_runs(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                            const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr);

}  // namespace pdkv::planner
