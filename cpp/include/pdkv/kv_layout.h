// pdkv/kv_layout.h: how a paged KV pool is laid out, and how block ids become
// byte extents.
//
// A KV pool has, for every layer, a K part and a V part (or a single latent
// part, kv_parts == 1, for MLA-style caches). Each (layer, part) is a
// "segment": `num_blocks` blocks of `block_tokens x kv_heads` rows of `head_dim`
// contiguous elements. A segment is described by byte strides:
//   address of row (block b, token slot t, head h) =
//       addr + b * block_stride + t * token_stride + h * head_stride
// so one description covers
//   NHD blocks [block_tokens, kv_heads, head_dim]   (token_stride = H*D*e, head_stride = D*e)
//   HND blocks [kv_heads, block_tokens, head_dim]   (token_stride = D*e, head_stride = T*D*e)
//   per-layer K and V tensors [num_blocks, T, H, D], K/V interleaved per block
//   [num_blocks, 2, T, H, D], vLLM GPU [2, num_blocks, T, H, D], one pool for every
//   layer, cross-layer blocks [num_blocks, layers, 2, T, H, D] (block_stride = all
//   layers), vLLM CPU [num_blocks, H, T, 2*D] (K at +0, V at +D*e, token_stride = 2*D*e),
//   SGLang-style token pools [tokens, H, D] seen as pages of T tokens, and MLA latents.
// Segments whose token and head strides are 0 take them from the geometry's order
// (the dense NHD or HND block), which is what every older constructor builds.
//
// Thread safety: KVLayout is an immutable value after construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv {

enum class TokenOrder : uint8_t { kNHD = 0, kHND = 1 };

// Shape of a KV pool; no addresses.
struct KVGeometry {
  uint32_t num_layers = 0;
  uint32_t num_blocks = 0;
  uint32_t block_tokens = 0;  // tokens per block (page size)
  uint32_t kv_heads = 0;      // KV heads held by this pool (after any TP split)
  uint32_t head_dim = 0;
  uint32_t kv_parts = 2;      // 2: K and V; 1: a single latent cache (MLA)
  DType dtype = DType::kBF16;
  // Dense block order, and the strides of segments that give none. For a strided
  // layout it only names the nearer of the two (informational).
  TokenOrder order = TokenOrder::kNHD;

  // Bytes of one (layer, part) of one block: block_tokens*kv_heads*head_dim*dtype size.
  uint64_t block_half_bytes() const;
  // Bytes of one row: head_dim * dtype size (the contiguous unit of every layout).
  uint64_t row_bytes() const;
  uint32_t num_segments() const { return num_layers * kv_parts; }
  Status validate() const;
  bool operator==(const KVGeometry& o) const;
};

// One (layer, part) of the pool. Rows of one segment never overlap (KVLayout::make
// checks); rows of different segments may interleave (vLLM CPU's K and V).
struct KVSegment {
  static constexpr uint64_t kUnbound = ~0ull;
  uint64_t addr = 0;          // address of row (block 0, token 0, head 0) in the owner's address space
  uint64_t block_stride = 0;  // bytes between block b and block b+1
  uint64_t region_id = kUnbound;  // registered region holding the segment (set by Agent)
  uint64_t region_offset = 0;     // addr - region base
  uint64_t token_stride = 0;  // bytes between token slots t and t+1 of a block (0: from the geometry's order)
  uint64_t head_stride = 0;   // bytes between heads h and h+1 of a block (0: from the geometry's order)
};

// Geometry plus one segment per (layer, part), index layer * kv_parts + part.
class KVLayout {
 public:
  KVLayout() = default;
  // General form; validates that segments are consistent with the geometry: strides
  // that make no two rows of a segment overlap (InvalidArgument naming the two
  // dimensions), and a segment inside the address space (OutOfRange). Zero token and
  // head strides are filled in from geo.order.
  static Result<KVLayout> make(const KVGeometry& geo, std::vector<KVSegment> segments);
  // Per-layer K and V tensors, each [num_blocks, ...] with blocks contiguous.
  // k_addrs/v_addrs: [num_layers]; v_addrs must be empty when kv_parts == 1.
  static Result<KVLayout> per_layer(const KVGeometry& geo, const std::vector<uint64_t>& k_addrs,
                                    const std::vector<uint64_t>& v_addrs);
  // Bytes needed for a pool that `contiguous()` lays out.
  static uint64_t contiguous_bytes(const KVGeometry& geo);
  // One buffer at `base` holding every layer: [layers, num_blocks, parts, <block>] when
  // interleaved (K/V interleaved per block), else [layers, parts, num_blocks, <block>].
  static Result<KVLayout> contiguous(const KVGeometry& geo, uint64_t base, bool interleaved);

  const KVGeometry& geometry() const { return geo_; }
  const std::vector<KVSegment>& segments() const { return segs_; }
  std::vector<KVSegment>& mutable_segments() { return segs_; }
  const KVSegment& segment(uint32_t layer, uint32_t part) const {
    return segs_[static_cast<size_t>(layer) * geo_.kv_parts + part];
  }
  bool bound() const;  // every segment has a region_id
  // Lowest and one-past-highest byte address any block touches.
  uint64_t min_addr() const;
  uint64_t end_addr() const;
  // Bytes from a segment's addr to one past its last row (its last block's highest row).
  uint64_t segment_span(const KVSegment& s) const { return segment_span(geo_, s); }
  static uint64_t segment_span(const KVGeometry& geo, const KVSegment& s);
  // True when every block of `s` is one dense run of block_half_bytes from its row 0
  // in the geometry's NHD or HND order (the layouts the older constructors build).
  bool dense(const KVSegment& s) const;

 private:
  KVGeometry geo_;
  std::vector<KVSegment> segs_;
};

// One contiguous byte range on each side of a transfer.
struct Extent {
  uint64_t local_region = 0;
  uint64_t local_offset = 0;
  uint64_t remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t len = 0;
};

// Merges neighbours whose local and remote ranges both continue each other.
// Order is preserved; the result is equivalent byte for byte. O(n), in place.
void coalesce_extents(std::vector<Extent>& extents);

// Destination block ids must be distinct (a block filled twice in one transfer ends up
// holding whichever copy lands last). InvalidArgument naming `what` ("local"/"remote")
// and both positions of the first duplicate. O(n) for increasing ids, else O(n log n).
Status check_distinct_blocks(const std::vector<uint32_t>& ids, const std::string& what);

// Which tokens and heads to move when the two layouts' geometries differ. Leaving a
// field at 0 means "everything", and is only accepted when it is unambiguous: both
// block lists hold the same number of tokens, and both layouts the same kv heads.
struct PlanOptions {
  // Tokens to move, counted from the start of the first block; 0 = all of them (the
  // two block lists must then hold equally many tokens).
  uint64_t num_tokens = 0;
  // Heads to move and where they start on each side (tensor-parallel splits); 0 = all
  // heads (both layouts must then hold equally many).
  uint32_t num_heads = 0;
  uint32_t local_head_offset = 0;
  uint32_t remote_head_offset = 0;
  // Layers to move: [first_layer, first_layer + num_layers); num_layers 0 = every layer
  // from first_layer on. Layer-wise streaming plans one ready range at a time.
  uint32_t first_layer = 0;
  uint32_t num_layers = 0;

  // Every value is valid on its own; the layouts a plan joins decide what fits
  // (plan_blocks' errors).
  Status validate() const { return Status::Ok(); }
};

// Extents that move blocks `local_ids` of `local` to or from blocks `remote_ids` of
// `remote`, in (layer, part, block) order, coalesced. Offsets are relative to each
// segment's region; for an unbound layout the region is KVSegment::kUnbound and the
// offset is the absolute address.
// With identical geometry and in-block strides (and default options) each block maps
// to one block and consecutive ids on both sides coalesce into one extent per (layer,
// part) (per layer when K and V interleave inside a block on both sides, as vLLM
// CPU's); otherwise the bytes are cut into the longest runs contiguous on both sides
// (whole token rows of the moved heads, a head's tokens, or single rows), computed per
// block pair rather than per row, and coalesced. This is the direct plan: the agent may
// stage a fragmented host-memory transfer through a local buffer instead (core/relayout.h). A plan never silently moves part of the data: when
// the block lists hold different numbers of tokens, or the layouts different numbers
// of kv heads, the caller must say what to move (num_tokens / num_heads).
// Errors: InvalidArgument (mismatched dtype/head_dim/layers/parts; token counts or
// kv heads that differ without num_tokens/num_heads; the message names both geometries),
// OutOfRange (block id >= num_blocks, tokens, heads or layers beyond a side).
Result<std::vector<Extent>> plan_blocks(const KVLayout& local, const std::vector<uint32_t>& local_ids,
                                        const KVLayout& remote, const std::vector<uint32_t>& remote_ids,
                                        const PlanOptions& opts = {});

}  // namespace pdkv
