#include "pdkv/kv_layout.h"

#include <algorithm>
#include <string>

#include "core/plan_runs.h"
#include "util/bench_switches.h"

namespace pdkv {
namespace {

using planner::PlanScope;
using planner::RowRange;
using planner::walk_segment_runs;

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

// One dimension of a segment's rows: `count` positions `stride` bytes apart.
struct Dim {
  const char* name;
  uint64_t stride;
  uint64_t count;
};

// The dimensions that actually vary (count > 1), innermost (smallest stride) first.
std::vector<Dim> varying_dims(std::initializer_list<Dim> dims) {
  std::vector<Dim> v;
  for (const Dim& d : dims)
    if (d.count > 1) v.push_back(d);
  std::stable_sort(v.begin(), v.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  return v;
}

// Rows of `row` bytes laid out by `dims` never overlap when each dimension's stride
// clears everything the smaller ones span (the nesting of every real KV layout).
// Returns the name of the first dimension that does not, with what it should clear.
Status check_nested(const std::vector<Dim>& dims, uint64_t row, const std::string& where) {
  uint64_t inner = row;  // bytes spanned by one position of the next dimension
  const char* below = "head_dim elements of a row";
  for (const Dim& d : dims) {
    if (d.stride < inner)
      return InvalidArgument(where + ": " + d.name + " stride " + std::to_string(d.stride) +
                             " bytes is smaller than the " + std::to_string(inner) + " bytes spanned by the " + below +
                             " inside it, so two (block, token, head) rows overlap");
    if (mul_overflows(d.stride, d.count - 1) || d.stride * (d.count - 1) > kMaxU64 - inner)
      return OutOfRange(where + " overflows the address space");
    inner += d.stride * (d.count - 1);
    below = d.name == std::string("block") ? "blocks" : d.name == std::string("token") ? "tokens" : "heads";
  }
  return Status::Ok();
}

// True when `dims` pack rows of `row` bytes densely: each stride is exactly the
// bytes of everything inside it.
bool packs_densely(const std::vector<Dim>& dims, uint64_t row) {
  uint64_t inner = row;
  for (const Dim& d : dims) {
    if (d.stride != inner) return false;
    inner *= d.count;
  }
  return true;
}

std::string segment_name(const KVGeometry& g, size_t i) {
  return "segment " + std::to_string(i) + " (layer " + std::to_string(i / g.kv_parts) +
         (g.kv_parts == 2 ? (i % 2 ? ", V)" : ", K)") : ")");
}

}  // namespace

uint64_t KVGeometry::block_half_bytes() const {
  return static_cast<uint64_t>(block_tokens) * kv_heads * head_dim * dtype_size(dtype);
}

uint64_t KVGeometry::row_bytes() const { return static_cast<uint64_t>(head_dim) * dtype_size(dtype); }

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
  const uint64_t row = geo.row_bytes();
  for (size_t i = 0; i < segments.size(); ++i) {
    KVSegment& s = segments[i];
    if (s.token_stride == 0 && s.head_stride == 0) {
      const bool nhd = geo.order == TokenOrder::kNHD;
      s.token_stride = nhd ? row * geo.kv_heads : row;
      s.head_stride = nhd ? row : row * geo.block_tokens;
    }
    const std::string where = segment_name(geo, i);
    PDKV_RETURN_IF_ERROR(check_nested(varying_dims({{"block", s.block_stride, geo.num_blocks},
                                                    {"token", s.token_stride, geo.block_tokens},
                                                    {"head", s.head_stride, geo.kv_heads}}),
                                      row, where));
    if (s.addr > kMaxU64 - segment_span(geo, s)) return OutOfRange(where + " overflows the address space");
  }
  KVLayout l;
  l.geo_ = geo;
  l.segs_ = std::move(segments);
  return l;
}

uint64_t KVLayout::segment_span(const KVGeometry& g, const KVSegment& s) {
  return uint64_t(g.num_blocks - 1) * s.block_stride + uint64_t(g.block_tokens - 1) * s.token_stride +
         uint64_t(g.kv_heads - 1) * s.head_stride + g.row_bytes();
}

bool KVLayout::dense(const KVSegment& s) const {
  return packs_densely(varying_dims({{"token", s.token_stride, geo_.block_tokens}, {"head", s.head_stride, geo_.kv_heads}}),
                       geo_.row_bytes());
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
  for (const auto& s : segs_) e = std::max(e, s.addr + segment_span(s));
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

namespace {

// Equal geometries whose rows sit at the same offsets inside a block on both sides.
bool same_block_bytes(const KVGeometry& g, const KVSegment& x, const KVSegment& y) {
  return (g.block_tokens == 1 || x.token_stride == y.token_stride) && (g.kv_heads == 1 || x.head_stride == y.head_stride);
}

// Bytes of one block of a whole layer whose K and V rows interleave densely (K first),
// or 0 when they do not.
uint64_t interleaved_layer_block(const KVLayout& l, const KVSegment& k, const KVSegment& v) {
  const KVGeometry& g = l.geometry();
  if (g.kv_parts != 2 || v.addr <= k.addr || v.block_stride != k.block_stride || v.region_id != k.region_id ||
      v.token_stride != k.token_stride || v.head_stride != k.head_stride)
    return 0;
  auto dims = varying_dims({{"token", k.token_stride, g.block_tokens}, {"head", k.head_stride, g.kv_heads},
                            {"part", v.addr - k.addr, 2}});
  return packs_densely(dims, g.row_bytes()) ? 2 * g.block_half_bytes() : 0;
}

// Both sides' blocks are one dense run each, with the same bytes in the same place:
// one extent per block pair of each (layer, part), or per layer when K and V
// interleave inside each block on both sides (vLLM CPU: [H, T, 2*D] blocks).
// Returns false (and emits nothing) when the in-block arrangements differ.
bool plan_whole_blocks(const KVLayout& local, const std::vector<uint32_t>& lids, const KVLayout& remote,
                       const std::vector<uint32_t>& rids, size_t seg_begin, size_t seg_end, std::vector<Extent>& out) {
  const auto& ls = local.segments();
  const auto& rs = remote.segments();
  for (size_t s = seg_begin; s < seg_end; ++s)
    if (!same_block_bytes(local.geometry(), ls[s], rs[s])) return false;
  const bool per_segment_dense = std::all_of(ls.begin() + seg_begin, ls.begin() + seg_end,
                                             [&](const KVSegment& x) { return local.dense(x); }) &&
                                 std::all_of(rs.begin() + seg_begin, rs.begin() + seg_end,
                                             [&](const KVSegment& x) { return remote.dense(x); });
  auto emit_blocks = [&](const KVSegment& L, const KVSegment& R, uint64_t len) {
    const uint64_t lbase = seg_base(L), rbase = seg_base(R);
    for (size_t i = 0; i < lids.size(); ++i)
      push_extent(out, L.region_id, lbase + lids[i] * L.block_stride, R.region_id, rbase + rids[i] * R.block_stride,
                  len);
  };
  if (per_segment_dense) {
    out.reserve(lids.size() * (seg_end - seg_begin));  // upper bound: nothing coalesces
    for (size_t s = seg_begin; s < seg_end; ++s) emit_blocks(ls[s], rs[s], local.geometry().block_half_bytes());
    return true;
  }
  if (local.geometry().kv_parts != 2) return false;
  for (size_t s = seg_begin; s < seg_end; s += 2) {
    const uint64_t len = interleaved_layer_block(local, ls[s], ls[s + 1]);
    if (len == 0 || len != interleaved_layer_block(remote, rs[s], rs[s + 1]) ||
        ls[s + 1].addr - ls[s].addr != rs[s + 1].addr - rs[s].addr)
      return false;
  }
  out.reserve(lids.size() * (seg_end - seg_begin) / 2);
  for (size_t s = seg_begin; s < seg_end; s += 2) emit_blocks(ls[s], rs[s], 2 * local.geometry().block_half_bytes());
  return true;
}

// Emits the coalesced runs of one (layer, part) pair, relative to `lbase`/`rbase`.
void plan_segment_runs(const KVLayout& local, const KVSegment& L, uint64_t lreg, uint64_t lbase,
                       const std::vector<uint32_t>& lids, const KVLayout& remote, const KVSegment& R, uint64_t rreg,
                       uint64_t rbase, const std::vector<uint32_t>& rids, const RowRange& rr, std::vector<Extent>& out) {
  walk_segment_runs(local.geometry().block_tokens, L, lbase, lids, remote.geometry().block_tokens, R, rbase, rids,
                    local.geometry().row_bytes(), rr,
                    [&](uint64_t lo, uint64_t ro, uint64_t len) { push_extent(out, lreg, lo, rreg, ro, len); });
}

bool same_strides(const KVSegment& a, const KVSegment& b) {
  return a.block_stride == b.block_stride && a.token_stride == b.token_stride && a.head_stride == b.head_stride;
}

// Every (layer, part) pair in [seg_begin, seg_end). Segments usually share their
// strides, so their runs differ only by the two bases: the runs are computed once,
// relative to base 0, and replayed per segment.
void plan_runs(const KVLayout& local, const std::vector<uint32_t>& lids, const KVLayout& remote,
               const std::vector<uint32_t>& rids, const RowRange& rr, size_t seg_begin, size_t seg_end,
               std::vector<Extent>& out) {
  const auto& ls = local.segments();
  const auto& rs = remote.segments();
  const KVSegment& L0 = ls[seg_begin];
  const KVSegment& R0 = rs[seg_begin];
  std::vector<Extent> tmpl;
  plan_segment_runs(local, L0, 0, 0, lids, remote, R0, 0, 0, rids, rr, tmpl);
  out.reserve(out.size() + tmpl.size() * (seg_end - seg_begin));
  for (size_t s = seg_begin; s < seg_end; ++s) {
    const KVSegment& L = ls[s];
    const KVSegment& R = rs[s];
    if (!same_strides(L, L0) || !same_strides(R, R0)) {
      plan_segment_runs(local, L, L.region_id, seg_base(L), lids, remote, R, R.region_id, seg_base(R), rids, rr, out);
      continue;
    }
    const uint64_t lb = seg_base(L), rb = seg_base(R);
    if (tmpl.empty()) continue;
    // The first run may continue the previous segment's last one; the rest cannot
    // continue each other (the template is coalesced).
    push_extent(out, L.region_id, lb + tmpl[0].local_offset, R.region_id, rb + tmpl[0].remote_offset, tmpl[0].len);
    for (size_t i = 1; i < tmpl.size(); ++i)
      out.push_back(Extent{L.region_id, lb + tmpl[i].local_offset, R.region_id, rb + tmpl[i].remote_offset, tmpl[i].len});
  }
}

}  // namespace

namespace planner {

Result<PlanScope> plan_scope(const KVLayout& local, const std::vector<uint32_t>& lids, const KVLayout& remote,
                             const std::vector<uint32_t>& rids, const PlanOptions& opts) {
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

  PlanScope scope;
  scope.seg_begin = seg_begin;
  scope.seg_end = seg_end;
  scope.whole_blocks = lg.block_tokens == rg.block_tokens && lg.kv_heads == rg.kv_heads && opts.num_heads == 0 &&
                       opts.local_head_offset == 0 && opts.remote_head_offset == 0 && lids.size() == rids.size() &&
                       (opts.num_tokens == 0 || opts.num_tokens == lcap);
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
  scope.rows = RowRange{ntok, nh, opts.local_head_offset, opts.remote_head_offset};
  return scope;
}

uint64_t count_segment_runs(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                            const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr) {
  uint64_t n = 0, lend = ~0ull, rend = ~0ull;
  walk_segment_runs(LT, L, 0, lids, RT, R, 0, rids, row, rr, [&](uint64_t lo, uint64_t ro, uint64_t len) {
    n += !(lo == lend && ro == rend);
    lend = lo + len;
    rend = ro + len;
  });
  return n;
}

uint64_t strided_segment_cost(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                              const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr) {
  std::vector<StridedExtent> runs;
  walk_segment_strided(LT, L, 0, lids, RT, R, 0, rids, row, rr,
                       [&](uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t ls, uint64_t rs) {
                         push_strided(runs, StridedExtent{0, lo, 0, ro, len, n, ls, rs});
                       });
  uint64_t cost = runs.size();
  for (const StridedExtent& r : runs)
    if (r.count > 1 && r.local_stride != r.len) cost += r.count;
  return cost;
}

namespace {

// False under the benchmark switch BenchSwitch::kPerSegmentRuns=1 (read once per
// process; docs/benchmarks.md): two-level runs stay inside one (layer, part), as
// before plan_across_segments(), to compare both in one build.
bool across_segments_allowed() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kPerSegmentRuns, "1");
  return on;
}

void plan_segment_strided(const KVLayout& local, const KVSegment& L, uint64_t lreg, uint64_t lbase,
                          const std::vector<uint32_t>& lids, const KVLayout& remote, const KVSegment& R, uint64_t rreg,
                          uint64_t rbase, const std::vector<uint32_t>& rids, const RowRange& rr, bool two_level,
                          uint64_t head_pass_bytes, std::vector<StridedExtent>& out) {
  if (two_level) {
    walk_segment_two_level(local.geometry().block_tokens, L, lbase, lids, remote.geometry().block_tokens, R, rbase,
                           rids, local.geometry().row_bytes(), rr, head_pass_bytes, [&](StridedExtent x) {
                             x.local_region = lreg;
                             x.remote_region = rreg;
                             push_strided(out, x);
                           });
    return;
  }
  walk_segment_strided(local.geometry().block_tokens, L, lbase, lids, remote.geometry().block_tokens, R, rbase, rids,
                       local.geometry().row_bytes(), rr,
                       [&](uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t ls, uint64_t rs) {
                         push_strided(out, StridedExtent{lreg, lo, rreg, ro, len, n, ls, rs});
                       });
}

// The distance between the bases of segments first, first + step, ... (n of them)
// when they share the first one's region and strides and follow each other at one
// positive distance (overflow-safe); 0 otherwise.
uint64_t even_spacing(const std::vector<KVSegment>& segs, size_t first, size_t step, size_t n) {
  if (n < 2) return 0;
  const KVSegment& s0 = segs[first];
  const uint64_t b0 = seg_base(s0), b1 = seg_base(segs[first + step]);
  if (b1 <= b0) return 0;
  const uint64_t d = b1 - b0;
  for (size_t k = 1; k < n; ++k) {
    const KVSegment& s = segs[first + k * step];
    uint64_t at = 0;
    if (s.region_id != s0.region_id || !same_strides(s, s0) || __builtin_mul_overflow(uint64_t(k), d, &at) ||
        __builtin_add_overflow(at, b0, &at) || seg_base(s) != at)
      return 0;
  }
  return d;
}

// True where both sides cut the rows by token and head (NHD <-> HND with several heads
// moved): a segment's one-level runs are then one per (block, head), side by side.
// Repeated per segment, each such run walks every segment before the next head comes
// back to the same block, whose lines have left the cache in between: both ends touch
// each line once per head. Kept per segment instead (walk_segment_two_level: a
// block's heads in one run, or passes of kHeadPassBytes), while that plan is at most
// kCheapPerSegmentRuns runs (its prepare well under a millisecond, ~0.15 us a run);
// longer plans still go across segments, and their per-segment plans keep O(heads)
// runs (no pass limit), for their prepare time.
constexpr uint64_t kCheapPerSegmentRuns = 4096;

bool cuts_token_and_head(const KVSegment& L, const KVSegment& R, uint64_t row, uint64_t heads) {
  return heads > 1 && !(L.head_stride == row && R.head_stride == row) &&
         !(L.token_stride == row && R.token_stride == row);
}

// Two-level runs across segments, for a transport that takes them: where the segments
// of the plan (all of them, or each part's) share their strides and follow each other
// at one distance on both sides (a contiguous pool), a one-level run of the first
// segment repeats in every other at that distance, so it becomes one two-level run
// (its pieces, repeated per segment). With scattered block ids that is O(blocks) runs
// per request instead of O(blocks x layers x parts) (each one checked and bound whole,
// the pieces walked only while copying). Appends to `out` and returns true only when
// it gives fewer runs than `per_segment` per segment (the usual plan's count), every
// run nests in the segment distance and, where both sides cut tokens and heads, the
// per-segment plan is over kCheapPerSegmentRuns runs (cuts_token_and_head); else
// leaves `out` alone.
bool plan_across_segments(const KVLayout& local, const std::vector<uint32_t>& lids, const KVLayout& remote,
                          const std::vector<uint32_t>& rids, const PlanScope& scope, uint64_t per_segment,
                          std::vector<StridedExtent>& out) {
  const auto& ls = local.segments();
  const auto& rs = remote.segments();
  const size_t nseg = scope.seg_end - scope.seg_begin;
  // Groups of evenly spaced segments: every segment in one, or one group per part
  // (K/V interleaved per block: parts sit a half block apart, layers a layer apart).
  size_t groups = 1, step = 1;
  uint64_t dl = even_spacing(ls, scope.seg_begin, 1, nseg), dr = even_spacing(rs, scope.seg_begin, 1, nseg);
  if (dl == 0 || dr == 0) {
    groups = local.geometry().kv_parts;
    step = groups;
    dl = dr = 0;
  }
  const size_t per_group = nseg / groups;
  if (per_group < 2) return false;
  std::vector<uint64_t> gl(groups), gr(groups);
  for (size_t g = 0; g < groups; ++g) {
    gl[g] = even_spacing(ls, scope.seg_begin + g, step, per_group);
    gr[g] = even_spacing(rs, scope.seg_begin + g, step, per_group);
    if (gl[g] == 0 || gr[g] == 0 || !same_strides(ls[scope.seg_begin + g], ls[scope.seg_begin]) ||
        !same_strides(rs[scope.seg_begin + g], rs[scope.seg_begin]))
      return false;
  }
  // The first segment's one-level runs, relative to base 0; given up on as soon as they
  // are too many to gain (consecutive ids: the usual plan is a few runs per segment).
  const uint64_t limit = per_segment * nseg / groups;
  std::vector<StridedExtent> one;
  bool over = false;
  walk_segment_strided(local.geometry().block_tokens, ls[scope.seg_begin], 0, lids, remote.geometry().block_tokens,
                       rs[scope.seg_begin], 0, rids, local.geometry().row_bytes(), scope.rows,
                       [&](uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t lst, uint64_t rst) {
                         if (over) return;
                         push_strided(one, StridedExtent{0, lo, 0, ro, len, n, lst, rst});
                         over = one.size() > limit;
                       });
  if (over || one.empty() || one.size() * groups >= per_segment * nseg) return false;
  if (per_segment * nseg <= kCheapPerSegmentRuns &&
      cuts_token_and_head(ls[scope.seg_begin], rs[scope.seg_begin], local.geometry().row_bytes(), scope.rows.num_heads))
    return false;
  for (const StridedExtent& x : one)
    for (size_t g = 0; g < groups; ++g)
      if (!nested_disjoint(x.len, x.count, x.local_stride, per_group, gl[g]) ||
          !nested_disjoint(x.len, x.count, x.remote_stride, per_group, gr[g]))
        return false;
  out.reserve(out.size() + one.size() * groups);
  for (size_t g = 0; g < groups; ++g) {
    const KVSegment& L = ls[scope.seg_begin + g];
    const KVSegment& R = rs[scope.seg_begin + g];
    const uint64_t lb = seg_base(L), rb = seg_base(R);
    for (const StridedExtent& x : one) {
      StridedExtent y = two_level_run(lb + x.local_offset, rb + x.remote_offset, x.len, x.count, x.local_stride,
                                      x.remote_stride, per_group, gl[g], gr[g]);
      y.local_region = L.region_id;
      y.remote_region = R.region_id;
      out.push_back(y);
    }
  }
  return true;
}

}  // namespace

Result<std::vector<StridedExtent>> plan_strided(const KVLayout& local, const std::vector<uint32_t>& lids,
                                                const KVLayout& remote, const std::vector<uint32_t>& rids,
                                                const PlanOptions& opts, bool two_level) {
  std::vector<StridedExtent> out;
  PDKV_RETURN_IF_ERROR(plan_strided_into(out, local, lids, remote, rids, opts, two_level));
  return out;
}

Status plan_strided_into(std::vector<StridedExtent>& out, const KVLayout& local, const std::vector<uint32_t>& lids,
                         const KVLayout& remote, const std::vector<uint32_t>& rids, const PlanOptions& opts,
                         bool two_level) {
  out.clear();
  PDKV_ASSIGN_OR_RETURN(PlanScope scope, plan_scope(local, lids, remote, rids, opts));
  if (scope.whole_blocks) {
    std::vector<Extent> whole;
    if (plan_whole_blocks(local, lids, remote, rids, scope.seg_begin, scope.seg_end, whole)) {
      out.reserve(whole.size());
      for (const Extent& e : whole)
        out.push_back(StridedExtent{e.local_region, e.local_offset, e.remote_region, e.remote_offset, e.len});
      return Status::Ok();
    }
  }
  // As plan_runs(): the runs of the first (layer, part) pair, relative to base 0,
  // replayed for every pair with the same strides.
  const auto& ls = local.segments();
  const auto& rs = remote.segments();
  const KVSegment& L0 = ls[scope.seg_begin];
  const KVSegment& R0 = rs[scope.seg_begin];
  std::vector<StridedExtent> tmpl;
  uint64_t head_pass = kHeadPassBytes;
  plan_segment_strided(local, L0, 0, 0, lids, remote, R0, 0, 0, rids, scope.rows, two_level, head_pass, tmpl);
  if (two_level && tmpl.size() * (scope.seg_end - scope.seg_begin) > kCheapPerSegmentRuns) {
    // A long plan keeps O(heads) runs per (layer, part) for its prepare time: heads
    // walk the whole group (walk_segment_two_level without the pass limit).
    head_pass = UINT64_MAX;
    tmpl.clear();
    plan_segment_strided(local, L0, 0, 0, lids, remote, R0, 0, 0, rids, scope.rows, two_level, head_pass, tmpl);
  }
  if (two_level && across_segments_allowed() && plan_across_segments(local, lids, remote, rids, scope, tmpl.size(), out))
    return Status::Ok();
  out.reserve(tmpl.size() * (scope.seg_end - scope.seg_begin));
  for (size_t s = scope.seg_begin; s < scope.seg_end; ++s) {
    const KVSegment& L = ls[s];
    const KVSegment& R = rs[s];
    if (!same_strides(L, L0) || !same_strides(R, R0)) {
      plan_segment_strided(local, L, L.region_id, seg_base(L), lids, remote, R, R.region_id, seg_base(R), rids,
                           scope.rows, two_level, head_pass, out);
      continue;
    }
    const uint64_t lb = seg_base(L), rb = seg_base(R);
    for (size_t i = 0; i < tmpl.size(); ++i) {
      StridedExtent x = tmpl[i];
      x.local_region = L.region_id;
      x.local_offset += lb;
      x.remote_region = R.region_id;
      x.remote_offset += rb;
      if (i == 0) {
        push_strided(out, x);  // may continue the previous pair's last run
      } else {
        out.push_back(x);
      }
    }
  }
  return Status::Ok();
}

}  // namespace planner

Result<std::vector<Extent>> plan_blocks(const KVLayout& local, const std::vector<uint32_t>& lids,
                                        const KVLayout& remote, const std::vector<uint32_t>& rids,
                                        const PlanOptions& opts) {
  PDKV_ASSIGN_OR_RETURN(PlanScope scope, planner::plan_scope(local, lids, remote, rids, opts));
  std::vector<Extent> out;
  if (scope.whole_blocks && plan_whole_blocks(local, lids, remote, rids, scope.seg_begin, scope.seg_end, out))
    return out;
  plan_runs(local, lids, remote, rids, scope.rows, scope.seg_begin, scope.seg_end, out);
  return out;
}

}  // namespace pdkv
