// libFuzzer target: the metadata blob decoder (pdkv/metadata.h), which parses
// whatever a peer or a caller hands to Agent.add_peer().
//
// Properties checked on every input, beyond "no crash, no leak, no UB":
//   * what decodes is consistent: every layout segment lies inside the region it
//     names (checked here with overflow-safe arithmetic, independently of the decoder);
//   * round trip: encode(decode(x)) decodes again to the same metadata, and is x
//     itself when x is of the current version (the format has exactly one encoding
//     per value: no padding, no slack; an older version re-encodes as the current).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "pdkv/metadata.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "metadata_fuzz: property violated: %s\n", what);
  std::abort();
}

bool same_region(const pdkv::RegionDesc& a, const pdkv::RegionDesc& b) {
  return a.id == b.id && a.addr == b.addr && a.len == b.len && a.kind == b.kind && a.device == b.device &&
         a.remote_access == b.remote_access && a.shareable == b.shareable;
}

bool same_segment(const pdkv::KVSegment& a, const pdkv::KVSegment& b) {
  return a.addr == b.addr && a.block_stride == b.block_stride && a.region_id == b.region_id &&
         a.region_offset == b.region_offset && a.token_stride == b.token_stride && a.head_stride == b.head_stride;
}

bool same(const pdkv::AgentMetadata& a, const pdkv::AgentMetadata& b) {
  if (a.name != b.name || a.instance_id != b.instance_id || a.host_id != b.host_id || a.pid != b.pid) return false;
  if (a.endpoints.size() != b.endpoints.size() || a.regions.size() != b.regions.size() ||
      a.layouts.size() != b.layouts.size() || a.extras != b.extras)
    return false;
  for (size_t i = 0; i < a.endpoints.size(); ++i)
    if (a.endpoints[i].transport != b.endpoints[i].transport || a.endpoints[i].address != b.endpoints[i].address)
      return false;
  for (size_t i = 0; i < a.regions.size(); ++i)
    if (!same_region(a.regions[i], b.regions[i])) return false;
  for (size_t i = 0; i < a.layouts.size(); ++i) {
    const auto& [na, la] = a.layouts[i];
    const auto& [nb, lb] = b.layouts[i];
    if (na != nb || !(la.geometry() == lb.geometry()) || la.segments().size() != lb.segments().size()) return false;
    for (size_t s = 0; s < la.segments().size(); ++s)
      if (!same_segment(la.segments()[s], lb.segments()[s])) return false;
  }
  return true;
}

// Every row of every segment inside its region:
// offset + (blocks-1)*block_stride + (tokens-1)*token_stride + (heads-1)*head_stride + row <= len.
void check_layouts_inside_regions(const pdkv::AgentMetadata& md) {
  for (const auto& [name, layout] : md.layouts) {
    const pdkv::KVGeometry& g = layout.geometry();
    if (g.num_blocks == 0) fail("a layout with zero blocks decoded");
    for (const auto& s : layout.segments()) {
      const pdkv::RegionDesc* r = md.find_region(s.region_id);
      if (!r) fail("a layout segment names a region the blob does not hold");
      uint64_t b = 0, t = 0, h = 0, end = 0, last = 0;
      if (__builtin_mul_overflow(uint64_t(g.num_blocks - 1), s.block_stride, &b) ||
          __builtin_mul_overflow(uint64_t(g.block_tokens - 1), s.token_stride, &t) ||
          __builtin_mul_overflow(uint64_t(g.kv_heads - 1), s.head_stride, &h) ||
          __builtin_add_overflow(b, t, &end) || __builtin_add_overflow(end, h, &end) ||
          __builtin_add_overflow(end, uint64_t(g.head_dim) * pdkv::dtype_size(g.dtype), &end) ||
          __builtin_add_overflow(end, s.region_offset, &last) || last > r->len)
        fail("a layout segment reaches past the end of its region");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  auto md = pdkv::decode_metadata(in);
  if (!md.ok()) {
    if (md.status().message().empty()) fail("an error without a message");
    return 0;
  }
  check_layouts_inside_regions(md.value());
  const std::string again = pdkv::encode_metadata(md.value());
  auto md2 = pdkv::decode_metadata(again);
  if (!md2.ok()) fail("re-encoded metadata does not decode");
  if (!same(md.value(), md2.value())) fail("decode(encode(decode(x))) != decode(x)");
  uint16_t version = 0;
  std::memcpy(&version, in.data() + 8, sizeof version);  // after the magic; decoded, so present
  if (version == pdkv::kMetadataVersion && again != in) fail("encode(decode(x)) != x: the blob has a second encoding");
  return 0;
}
