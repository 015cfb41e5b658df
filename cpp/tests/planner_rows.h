// Shared by the planner tests (test_planner*.cc): unbound KV pools at made-up
// addresses, and the row-by-row reference a plan must equal once expanded (rows are
// (local address, remote address) pairs of one head's head_dim elements).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "pdkv/kv_layout.h"

namespace pdkv::test {

struct Pool {
  KVGeometry geo;
  KVLayout layout;
};

inline KVGeometry f16_geometry(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint32_t layers,
                               uint32_t blocks, uint32_t head_dim) {
  KVGeometry g;
  g.num_layers = layers;
  g.num_blocks = blocks;
  g.block_tokens = block_tokens;
  g.kv_heads = heads;
  g.head_dim = head_dim;
  g.dtype = DType::kF16;
  g.order = order;
  return g;
}

// One contiguous pool (K and V of every layer one after the other) at `base`.
inline Pool contiguous_pool(uint32_t block_tokens, uint32_t heads, TokenOrder order, uint32_t layers, uint32_t blocks,
                            uint32_t head_dim, uint64_t base) {
  const KVGeometry g = f16_geometry(block_tokens, heads, order, layers, blocks, head_dim);
  auto r = KVLayout::contiguous(g, base, /*interleaved=*/false);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return Pool{g, std::move(r).value()};
}

using Rows = std::vector<std::pair<uint64_t, uint64_t>>;  // (local address, remote address) of a row

inline uint64_t row_bytes(const KVGeometry& g) { return uint64_t(g.head_dim) * dtype_size(g.dtype); }

// The row's address from the segment's strides (checked against the dense NHD/HND
// formula in StridedLayout.OlderConstructorsFillTheOrdersStrides).
inline uint64_t row_addr(const Pool& p, size_t seg, const std::vector<uint32_t>& ids, uint64_t t, uint64_t h) {
  const KVSegment& s = p.layout.segments()[seg];
  return s.addr + ids[t / p.geo.block_tokens] * s.block_stride + (t % p.geo.block_tokens) * s.token_stride +
         h * s.head_stride;
}

// What the transfer must move: every token < ntok and head < nh of every segment, sorted.
inline Rows reference(const Pool& l, const std::vector<uint32_t>& lids, const Pool& r,
                      const std::vector<uint32_t>& rids, uint64_t ntok, uint32_t nh, uint32_t lho = 0,
                      uint32_t rho = 0) {
  Rows out;
  for (size_t s = 0; s < l.layout.segments().size(); ++s)
    for (uint64_t t = 0; t < ntok; ++t)
      for (uint32_t h = 0; h < nh; ++h) out.emplace_back(row_addr(l, s, lids, t, lho + h), row_addr(r, s, rids, t, rho + h));
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace pdkv::test
