#include "pdkv/kv_layout.h"

#include <algorithm>
#include <string>

namespace pdkv {
namespace {

constexpr uint64_t kMaxU64 = ~0ull;

bool mul_overflows(uint64_t a, uint64_t b) { return a != 0 && b > kMaxU64 / a; }

std::string geo_str(const KVGeometry& g) {
  return "layers=" + std::to_string(g.num_layers) + " blocks=" + std::to_string(g.num_blocks) +
         " block_tokens=" + std::to_string(g.block_tokens) + " kv_heads=" + std::to_string(g.kv_heads) +
         " head_dim=" + std::to_string(g.head_dim) + " parts=" + std::to_string(g.kv_parts) + " dtype=" +
         std::string(dtype_name(g.dtype)) + (g.order == TokenOrder::kNHD ? " NHD" : " HND");
}

// Appends [lo, ro, len) or extends the last extent when both sides continue it.
inline void push_extent(std::vector<Extent>& out, uint64_t lreg, uint64_t lo, uint64_t rreg, uint64_t ro,
                        uint64_t len) {
  if (!out.empty()) {
    Extent& b = out.back();
    if (b.local_region == lreg && b.remote_region == rreg && b.local_offset + b.len == lo &&
        b.remote_offset + b.len == ro) {
      b.len += len;
      return;
    }
  }
  out.push_back(Extent{lreg, lo, rreg, ro, len});
}

// Offset of block 0 within its region, or its address when the layout is unbound.
inline uint64_t seg_base(const KVSegment& s) {
  return s.region_id == KVSegment::kUnbound ? s.addr : s.region_offset;
}

}  // namespace

uint64_t KVGeometry::block_half_bytes() const {
  return static_cast<uint64_t>(block_tokens) * kv_heads * head_dim * dtype_size(dtype);
}

bool KVGeometry::operator==(const KVGeometry& o) const {
  return num_layers == o.num_layers && num_blocks == o.num_blocks && block_tokens == o.block_tokens &&
         kv_heads == o.kv_heads && head_dim == o.head_dim && kv_parts == o.kv_parts && dtype == o.dtype &&
         order == o.order;
}

Status KVGeometry::validate() const {
  if (num_layers == 0 || num_blocks == 0 || block_tokens == 0 || kv_heads == 0 || head_dim == 0)
    return InvalidArgument("KV geometry has a zero dimension (" + geo_str(*this) + ")");
  if (kv_parts != 1 && kv_parts != 2)
    return InvalidArgument("kv_parts must be 1 (latent cache) or 2 (K and V), got " + std::to_string(kv_parts));
  if (dtype_size(dtype) == 0) return InvalidArgument("unknown dtype in KV geometry");
  if (num_layers > (1u << 16) || block_tokens > (1u << 20) || kv_heads > (1u << 16) || head_dim > (1u << 16))
    return InvalidArgument("KV geometry dimension implausibly large (" + geo_str(*this) + ")");
  if (order != TokenOrder::kNHD && order != TokenOrder::kHND) return InvalidArgument("unknown token order");
  return Status::Ok();
}

Result<KVLayout> KVLayout::make(const KVGeometry& geo, std::vector<KVSegment> segments) {
  PDKV_RETURN_IF_ERROR(geo.validate());
  if (segments.size() != geo.num_segments())
    return InvalidArgument("layout needs " + std::to_string(geo.num_segments()) + " segments (layers x parts), got " +
                           std::to_string(segments.size()));
  const uint64_t half = geo.block_half_bytes();
  for (size_t i = 0; i < segments.size(); ++i) {
    const KVSegment& s = segments[i];
    if (geo.num_blocks > 1 && s.block_stride < half)
      return InvalidArgument("segment " + std::to_string(i) + ": block stride " + std::to_string(s.block_stride) +
                             " is smaller than one block (" + std::to_string(half) + " bytes)");
    const uint64_t last = static_cast<uint64_t>(geo.num_blocks - 1);
    if (mul_overflows(last, s.block_stride) || last * s.block_stride > kMaxU64 - half ||
        s.addr > kMaxU64 - (last * s.block_stride + half))
      return OutOfRange("segment " + std::to_string(i) + " overflows the address space");
  }
  KVLayout l;
  l.geo_ = geo;
  l.segs_ = std::move(segments);
  return l;
}

Result<KVLayout> KVLayout::per_layer(const KVGeometry& geo, const std::vector<uint64_t>& k_addrs,
                                     const std::vector<uint64_t>& v_addrs) {
  PDKV_RETURN_IF_ERROR(geo.validate());
  if (k_addrs.size() != geo.num_layers)
    return InvalidArgument("expected " + std::to_string(geo.num_layers) + " K addresses, got " +
                           std::to_string(k_addrs.size()));
  if (geo.kv_parts == 2 && v_addrs.size() != geo.num_layers)
    return InvalidArgument("expected " + std::to_string(geo.num_layers) + " V addresses, got " +
                           std::to_string(v_addrs.size()));
  if (geo.kv_parts == 1 && !v_addrs.empty()) return InvalidArgument("a 1-part (latent) layout takes no V addresses");
  std::vector<KVSegment> segs;
  segs.reserve(geo.num_segments());
  const uint64_t half = geo.block_half_bytes();
  for (uint32_t l = 0; l < geo.num_layers; ++l) {
    segs.push_back(KVSegment{k_addrs[l], half});
    if (geo.kv_parts == 2) segs.push_back(KVSegment{v_addrs[l], half});
  }
  return make(geo, std::move(segs));
}

uint64_t KVLayout::contiguous_bytes(const KVGeometry& geo) {
  return geo.block_half_bytes() * geo.num_blocks * geo.kv_parts * geo.num_layers;
}

Result<KVLayout> KVLayout::contiguous(const KVGeometry& geo, uint64_t base, bool interleaved) {
  PDKV_RETURN_IF_ERROR(geo.validate());
  const uint64_t half = geo.block_half_bytes();
  const uint64_t layer_bytes = half * geo.num_blocks * geo.kv_parts;
  std::vector<KVSegment> segs;
  segs.reserve(geo.num_segments());
  for (uint32_t l = 0; l < geo.num_layers; ++l) {
    for (uint32_t p = 0; p < geo.kv_parts; ++p) {
      if (interleaved)
        segs.push_back(KVSegment{base + l * layer_bytes + p * half, half * geo.kv_parts});
      else
        segs.push_back(KVSegment{base + l * layer_bytes + p * half * geo.num_blocks, half});
    }
  }
  return make(geo, std::move(segs));
}

bool KVLayout::bound() const {
  if (segs_.empty()) return false;
  return std::all_of(segs_.begin(), segs_.end(), [](const KVSegment& s) { return s.region_id != KVSegment::kUnbound; });
}

uint64_t KVLayout::min_addr() const {
  uint64_t m = kMaxU64;
  for (const auto& s : segs_) m = std::min(m, s.addr);
  return segs_.empty() ? 0 : m;
}

uint64_t KVLayout::end_addr() const {
  uint64_t e = 0;
  const uint64_t half = geo_.block_half_bytes();
  for (const auto& s : segs_) e = std::max(e, s.addr + static_cast<uint64_t>(geo_.num_blocks - 1) * s.block_stride + half);
  return e;
}

Status check_distinct_blocks(const std::vector<uint32_t>& ids, const std::string& what) {
  // Usually sorted already (one pass); otherwise sort a copy.
  bool sorted = true;
  for (size_t i = 1; i < ids.size() && sorted; ++i) sorted = ids[i - 1] < ids[i];
  if (sorted) return Status::Ok();
  std::vector<uint32_t> v(ids);
  std::sort(v.begin(), v.end());
  auto dup = std::adjacent_find(v.begin(), v.end());
  if (dup == v.end()) return Status::Ok();
  size_t first = 0, second = 0;
  for (size_t i = 0, seen = 0; i < ids.size(); ++i)
    if (ids[i] == *dup) (seen++ == 0 ? first : second) = i;
  return InvalidArgument(what + " block " + std::to_string(*dup) + " appears twice (positions " +
                         std::to_string(first) + " and " + std::to_string(second) +
                         "): two sources would race to fill it");
}

void coalesce_extents(std::vector<Extent>& ex) {
  if (ex.empty()) return;
  size_t w = 0;
  for (size_t r = 1; r < ex.size(); ++r) {
    Extent& b = ex[w];
    const Extent& e = ex[r];
    if (b.local_region == e.local_region && b.remote_region == e.remote_region &&
        b.local_offset + b.len == e.local_offset && b.remote_offset + b.len == e.remote_offset) {
      b.len += e.len;
    } else {
      ex[++w] = e;
    }
  }
  ex.resize(w + 1);
}

Result<std::vector<Extent>> plan_blocks(const KVLayout& local, const std::vector<uint32_t>& lids,
                                        const KVLayout& remote, const std::vector<uint32_t>& rids,
                                        const PlanOptions& opts) {
  const KVGeometry& lg = local.geometry();
  const KVGeometry& rg = remote.geometry();
  if (lg.num_layers != rg.num_layers || lg.kv_parts != rg.kv_parts || lg.head_dim != rg.head_dim ||
      lg.dtype != rg.dtype)
    return InvalidArgument("layouts cannot exchange blocks: layers, parts, head_dim and dtype must match (local " +
                           geo_str(lg) + "; remote " + geo_str(rg) + ")");
  for (size_t i = 0; i < lids.size(); ++i)
    if (lids[i] >= lg.num_blocks)
      return OutOfRange("local block id " + std::to_string(lids[i]) + " at position " + std::to_string(i) +
                        " is beyond the pool (" + std::to_string(lg.num_blocks) + " blocks)");
  for (size_t i = 0; i < rids.size(); ++i)
    if (rids[i] >= rg.num_blocks)
      return OutOfRange("remote block id " + std::to_string(rids[i]) + " at position " + std::to_string(i) +
                        " is beyond the peer's pool (" + std::to_string(rg.num_blocks) + " blocks)");

  if (opts.first_layer >= lg.num_layers || uint64_t(opts.first_layer) + opts.num_layers > lg.num_layers)
    return OutOfRange("layers [" + std::to_string(opts.first_layer) + ", " +
                      std::to_string(uint64_t(opts.first_layer) + (opts.num_layers ? opts.num_layers : 1)) +
                      ") exceed the " + std::to_string(lg.num_layers) + " layers");
  // Segments are (layer, part) in layer order: the requested layers are one index range.
  const size_t seg_begin = size_t(opts.first_layer) * lg.kv_parts;
  const size_t seg_end = opts.num_layers ? seg_begin + size_t(opts.num_layers) * lg.kv_parts
                                         : size_t(lg.num_layers) * lg.kv_parts;

  // A plan that leaves out tokens or heads must be asked for: defaults never drop data.
  const uint64_t lcap = uint64_t(lids.size()) * lg.block_tokens;
  const uint64_t rcap = uint64_t(rids.size()) * rg.block_tokens;
  if (lg.kv_heads != rg.kv_heads && opts.num_heads == 0)
    return InvalidArgument("layouts hold different numbers of kv heads (local " + geo_str(lg) + "; remote " +
                           geo_str(rg) + "): pass num_heads and head offsets to move a head range");
  if (lcap != rcap && opts.num_tokens == 0 && lg.block_tokens == rg.block_tokens)
    return InvalidArgument("local and remote block lists differ in length (" + std::to_string(lids.size()) + " vs " +
                           std::to_string(rids.size()) + "; local " + geo_str(lg) + "; remote " + geo_str(rg) +
                           "): pass num_tokens to move a token range");
  if (lcap != rcap && opts.num_tokens == 0)
    return InvalidArgument("the local blocks hold " + std::to_string(lcap) + " tokens (" + std::to_string(lids.size()) +
                           " x " + std::to_string(lg.block_tokens) + ") but the remote blocks " + std::to_string(rcap) +
                           " (" + std::to_string(rids.size()) + " x " + std::to_string(rg.block_tokens) +
                           ") (local " + geo_str(lg) + "; remote " + geo_str(rg) +
                           "): pass num_tokens to move a token range");

  const bool same_shape = lg.block_tokens == rg.block_tokens && lg.kv_heads == rg.kv_heads && lg.order == rg.order &&
                          opts.num_heads == 0 && opts.local_head_offset == 0 && opts.remote_head_offset == 0 &&
                          lids.size() == rids.size() && (opts.num_tokens == 0 || opts.num_tokens == lcap);
  std::vector<Extent> out;
  if (same_shape) {
    const uint64_t half = lg.block_half_bytes();
    out.reserve(lids.size() * (seg_end - seg_begin));  // upper bound: nothing coalesces
    const auto& ls = local.segments();
    const auto& rs = remote.segments();
    for (size_t s = seg_begin; s < seg_end; ++s) {
      const KVSegment& L = ls[s];
      const KVSegment& R = rs[s];
      const uint64_t lbase = seg_base(L), rbase = seg_base(R);
      for (size_t i = 0; i < lids.size(); ++i)
        push_extent(out, L.region_id, lbase + lids[i] * L.block_stride, R.region_id, rbase + rids[i] * R.block_stride,
                    half);
    }
    return out;
  }

  // General path: map token by token and head by head.
  const uint64_t ntok = opts.num_tokens ? opts.num_tokens : lcap;
  if (ntok > lcap || ntok > rcap)
    return OutOfRange(std::to_string(ntok) + " tokens requested but the local blocks hold " + std::to_string(lcap) +
                      " and the remote blocks " + std::to_string(rcap));
  const uint32_t nh = opts.num_heads ? opts.num_heads : lg.kv_heads;
  if (uint64_t(opts.local_head_offset) + nh > lg.kv_heads)
    return OutOfRange("heads [" + std::to_string(opts.local_head_offset) + ", " +
                      std::to_string(opts.local_head_offset + nh) + ") exceed the local " +
                      std::to_string(lg.kv_heads) + " kv heads");
  if (uint64_t(opts.remote_head_offset) + nh > rg.kv_heads)
    return OutOfRange("heads [" + std::to_string(opts.remote_head_offset) + ", " +
                      std::to_string(opts.remote_head_offset + nh) + ") exceed the remote " +
                      std::to_string(rg.kv_heads) + " kv heads");
  const uint64_t row = uint64_t(lg.head_dim) * dtype_size(lg.dtype);
  auto in_block = [row](const KVGeometry& g, uint64_t slot, uint64_t h) -> uint64_t {
    return g.order == TokenOrder::kNHD ? (slot * g.kv_heads + h) * row : (h * g.block_tokens + slot) * row;
  };
  const bool head_major = lg.order == TokenOrder::kHND && rg.order == TokenOrder::kHND;
  const auto& ls = local.segments();
  const auto& rs = remote.segments();
  for (size_t s = seg_begin; s < seg_end; ++s) {
    const KVSegment& L = ls[s];
    const KVSegment& R = rs[s];
    const uint64_t lbase = seg_base(L), rbase = seg_base(R);
    auto emit = [&](uint64_t t, uint64_t h) {
      const uint64_t lb = lids[t / lg.block_tokens], ls_ = t % lg.block_tokens;
      const uint64_t rb = rids[t / rg.block_tokens], rs_ = t % rg.block_tokens;
      push_extent(out, L.region_id, lbase + lb * L.block_stride + in_block(lg, ls_, opts.local_head_offset + h),
                  R.region_id, rbase + rb * R.block_stride + in_block(rg, rs_, opts.remote_head_offset + h), row);
    };
    if (head_major) {
      // Walk each block's head rows so contiguous [tokens, dim] runs merge.
      for (uint64_t h = 0; h < nh; ++h)
        for (uint64_t t = 0; t < ntok; ++t) emit(t, h);
    } else {
      for (uint64_t t = 0; t < ntok; ++t)
        for (uint64_t h = 0; h < nh; ++h) emit(t, h);
    }
  }
  return out;
}

}  // namespace pdkv
