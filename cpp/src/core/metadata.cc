#include "pdkv/metadata.h"

#include <cstring>
#include <set>

#include "util/bytes.h"

namespace pdkv {
namespace {

constexpr char kMagic[8] = {'P', 'D', 'K', 'V', 'M', 'E', 'T', 'A'};
constexpr uint32_t kMaxStr = 4096;
constexpr uint32_t kMaxItems = 1u << 20;

// Length of the well-formed UTF-8 sequence at s[i] (1-4), or 0: the rules of
// Python's strict decoder (no overlong forms, no surrogates, nothing past U+10FFFF).
size_t utf8_seq(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if ((c == 0xE0 && b(1) < 0xA0) || (c == 0xED && b(1) > 0x9F)) return 0;  // overlong / surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if ((c == 0xF0 && b(1) < 0x90) || (c == 0xF4 && b(1) > 0x8F)) return 0;  // overlong / > U+10FFFF
    return 4;
  }
  return 0;
}

// A string field every consumer (Python included) decodes as UTF-8 text.
Status check_utf8(std::string_view s, const char* field) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_seq(s, i);
    if (n == 0)
      return ProtocolError(std::string(field) + " is not valid UTF-8 (byte " + std::to_string(i) + " of " +
                           std::to_string(s.size()) + ")");
    i += n;
  }
  return Status::Ok();
}

// A name field (transport, layout): what validate_name() accepts, else ProtocolError.
Status check_name(std::string_view s, const char* field) {
  Status st = validate_name(field, s);
  return st.ok() ? st : ProtocolError("metadata: " + st.message());
}

}  // namespace

const RegionDesc* AgentMetadata::find_region(uint64_t id) const {
  for (const auto& r : regions)
    if (r.id == id) return &r;
  return nullptr;
}

const KVLayout* AgentMetadata::find_layout(std::string_view n) const {
  for (const auto& [name, l] : layouts)
    if (name == n) return &l;
  return nullptr;
}

const Endpoint* AgentMetadata::find_endpoint(std::string_view t) const {
  for (const auto& e : endpoints)
    if (e.transport == t) return &e;
  return nullptr;
}

Status validate_name(std::string_view what, std::string_view name) {
  if (name.empty() || name.size() > 128)
    return InvalidArgument(std::string(what) + " must be 1 to 128 characters, got " + std::to_string(name.size()));
  for (char c : name)
    if (c <= ' ' || c > '~') {
      std::string shown;
      for (char d : name) {
        if (d > ' ' && d <= '~') {
          shown += d;
        } else {
          char esc[8];
          snprintf(esc, sizeof esc, "\\x%02x", static_cast<unsigned char>(d));
          shown += esc;
        }
      }
      return InvalidArgument(std::string(what) + " '" + shown + "' may contain only printable ASCII without spaces");
    }
  return Status::Ok();
}

std::string encode_metadata(const AgentMetadata& md) {
  util::ByteWriter body;
  body.put_str(md.name);
  body.put<uint64_t>(md.instance_id);
  body.put_str(md.host_id);
  body.put<uint32_t>(md.pid);
  body.put<uint32_t>(static_cast<uint32_t>(md.endpoints.size()));
  for (const auto& e : md.endpoints) {
    body.put_str(e.transport);
    body.put_str(e.address);
  }
  body.put<uint32_t>(static_cast<uint32_t>(md.regions.size()));
  for (const auto& r : md.regions) {
    body.put<uint64_t>(r.id);
    body.put<uint64_t>(r.addr);
    body.put<uint64_t>(r.len);
    body.put<uint8_t>(static_cast<uint8_t>(r.kind));
    body.put<int32_t>(r.device);
    body.put<uint8_t>(r.shareable ? 1 : 0);
  }
  body.put<uint32_t>(static_cast<uint32_t>(md.layouts.size()));
  for (const auto& [name, l] : md.layouts) {
    const KVGeometry& g = l.geometry();
    body.put_str(name);
    body.put<uint32_t>(g.num_layers);
    body.put<uint32_t>(g.num_blocks);
    body.put<uint32_t>(g.block_tokens);
    body.put<uint32_t>(g.kv_heads);
    body.put<uint32_t>(g.head_dim);
    body.put<uint8_t>(static_cast<uint8_t>(g.kv_parts));
    body.put<uint8_t>(static_cast<uint8_t>(g.dtype));
    body.put<uint8_t>(static_cast<uint8_t>(g.order));
    body.put<uint32_t>(static_cast<uint32_t>(l.segments().size()));
    for (const auto& s : l.segments()) {
      body.put<uint64_t>(s.addr);
      body.put<uint64_t>(s.block_stride);
      body.put<uint64_t>(s.region_id);
      body.put<uint64_t>(s.region_offset);
      body.put<uint64_t>(s.token_stride);
      body.put<uint64_t>(s.head_stride);
    }
  }
  body.put<uint32_t>(static_cast<uint32_t>(md.extras.size()));
  for (const auto& [t, blob] : md.extras) {
    body.put_str(t);
    body.put_str(blob);
  }
  util::ByteWriter out;
  out.put_raw(kMagic, sizeof kMagic);
  out.put<uint16_t>(kMetadataVersion);
  out.put<uint32_t>(static_cast<uint32_t>(body.str().size()));
  out.put_raw(body.str().data(), body.str().size());
  return out.take();
}

Result<AgentMetadata> decode_metadata(std::string_view blob) {
  if (blob.size() < sizeof kMagic || std::memcmp(blob.data(), kMagic, sizeof kMagic) != 0)
    return ProtocolError("not a pdkv metadata blob (bad magic; expected it to start with 'PDKVMETA', got " +
                         std::to_string(blob.size()) + " bytes)");
  util::ByteReader hdr(blob.substr(sizeof kMagic));
  uint16_t version = 0;
  uint32_t body_len = 0;
  PDKV_RETURN_IF_ERROR(hdr.get(&version, "metadata version"));
  if (version < kMetadataOldestVersion || version > kMetadataVersion)
    return VersionMismatch("metadata version " + std::to_string(version) + " is not supported (this pdkv reads versions " +
                           std::to_string(kMetadataOldestVersion) + " to " + std::to_string(kMetadataVersion) +
                           "); upgrade the older side");
  // Version 1 segments carry no token/head strides: the geometry's order gives them.
  const bool strided_segments = version >= 2;
  PDKV_RETURN_IF_ERROR(hdr.get(&body_len, "metadata body length"));
  if (body_len != hdr.remaining())
    return ProtocolError("metadata body length says " + std::to_string(body_len) + " bytes but " +
                         std::to_string(hdr.remaining()) + " follow");
  util::ByteReader r(blob.substr(sizeof kMagic + 6));
  AgentMetadata md;
  PDKV_RETURN_IF_ERROR(r.get_str(&md.name, "agent name", 128));
  PDKV_RETURN_IF_ERROR(validate_name("agent name", md.name).with_context("metadata"));
  PDKV_RETURN_IF_ERROR(r.get(&md.instance_id, "instance id"));
  PDKV_RETURN_IF_ERROR(r.get_str(&md.host_id, "host id", kMaxStr));
  PDKV_RETURN_IF_ERROR(check_utf8(md.host_id, "host id"));
  PDKV_RETURN_IF_ERROR(r.get(&md.pid, "pid"));
  uint32_t n = 0;
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "endpoint count", 8, 64));
  for (uint32_t i = 0; i < n; ++i) {
    Endpoint e;
    PDKV_RETURN_IF_ERROR(r.get_str(&e.transport, "endpoint transport", 64));
    PDKV_RETURN_IF_ERROR(r.get_str(&e.address, "endpoint address", kMaxStr));
    PDKV_RETURN_IF_ERROR(check_name(e.transport, "endpoint transport"));
    PDKV_RETURN_IF_ERROR(check_utf8(e.address, "endpoint address"));
    md.endpoints.push_back(std::move(e));
  }
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "region count", 30, kMaxItems));
  std::set<uint64_t> ids;
  for (uint32_t i = 0; i < n; ++i) {
    RegionDesc d;
    uint8_t kind = 0;
    PDKV_RETURN_IF_ERROR(r.get(&d.id, "region id"));
    PDKV_RETURN_IF_ERROR(r.get(&d.addr, "region addr"));
    PDKV_RETURN_IF_ERROR(r.get(&d.len, "region len"));
    PDKV_RETURN_IF_ERROR(r.get(&kind, "region kind"));
    PDKV_RETURN_IF_ERROR(r.get(&d.device, "region device"));
    uint8_t flags = 0;
    PDKV_RETURN_IF_ERROR(r.get(&flags, "region flags"));
    if (flags > 1) return ProtocolError("region " + std::to_string(d.id) + " has unknown flags " + std::to_string(flags));
    d.shareable = flags & 1;
    if (kind > static_cast<uint8_t>(MemKind::kCuda))
      return ProtocolError("region " + std::to_string(d.id) + " has unknown memory kind " + std::to_string(kind));
    if (d.len == 0 || d.addr > ~0ull - d.len)
      return ProtocolError("region " + std::to_string(d.id) + " has an invalid range");
    if (!ids.insert(d.id).second) return ProtocolError("region id " + std::to_string(d.id) + " appears twice");
    d.kind = static_cast<MemKind>(kind);
    d.remote_access = true;
    md.regions.push_back(d);
  }
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "layout count", 28, 4096));
  for (uint32_t i = 0; i < n; ++i) {
    std::string name;
    KVGeometry g;
    uint8_t parts = 0, dt = 0, order = 0;
    uint32_t nseg = 0;
    PDKV_RETURN_IF_ERROR(r.get_str(&name, "layout name", 128));
    PDKV_RETURN_IF_ERROR(check_name(name, "layout name"));
    PDKV_RETURN_IF_ERROR(r.get(&g.num_layers, "layout layers"));
    PDKV_RETURN_IF_ERROR(r.get(&g.num_blocks, "layout blocks"));
    PDKV_RETURN_IF_ERROR(r.get(&g.block_tokens, "layout block_tokens"));
    PDKV_RETURN_IF_ERROR(r.get(&g.kv_heads, "layout kv_heads"));
    PDKV_RETURN_IF_ERROR(r.get(&g.head_dim, "layout head_dim"));
    PDKV_RETURN_IF_ERROR(r.get(&parts, "layout parts"));
    PDKV_RETURN_IF_ERROR(r.get(&dt, "layout dtype"));
    PDKV_RETURN_IF_ERROR(r.get(&order, "layout order"));
    if (dt > static_cast<uint8_t>(DType::kI64)) return ProtocolError("layout '" + name + "' has unknown dtype");
    if (order > 1) return ProtocolError("layout '" + name + "' has unknown token order");
    g.kv_parts = parts;
    g.dtype = static_cast<DType>(dt);
    g.order = static_cast<TokenOrder>(order);
    PDKV_RETURN_IF_ERROR(r.get_count(&nseg, "layout segment count", strided_segments ? 48 : 32, kMaxItems));
    std::vector<KVSegment> segs(nseg);
    for (auto& s : segs) {
      PDKV_RETURN_IF_ERROR(r.get(&s.addr, "segment addr"));
      PDKV_RETURN_IF_ERROR(r.get(&s.block_stride, "segment stride"));
      PDKV_RETURN_IF_ERROR(r.get(&s.region_id, "segment region"));
      PDKV_RETURN_IF_ERROR(r.get(&s.region_offset, "segment offset"));
      if (strided_segments) {
        PDKV_RETURN_IF_ERROR(r.get(&s.token_stride, "segment token stride"));
        PDKV_RETURN_IF_ERROR(r.get(&s.head_stride, "segment head stride"));
        // The encoder always writes both (0/0 would mean "from the order" in memory).
        if (s.token_stride == 0 && s.head_stride == 0)
          return ProtocolError("layout '" + name + "' has a segment without token and head strides");
      }
    }
    auto layout = KVLayout::make(g, std::move(segs));
    if (!layout.ok()) return ProtocolError("layout '" + name + "': " + layout.status().message());
    // Every segment must lie inside the region it names.
    for (const auto& s : layout->segments()) {
      const RegionDesc* d = md.find_region(s.region_id);
      if (!d) return ProtocolError("layout '" + name + "' names unknown region " + std::to_string(s.region_id));
      if (s.region_offset > d->len || layout->segment_span(s) > d->len - s.region_offset)
        return ProtocolError("layout '" + name + "' reaches past the end of region " + std::to_string(s.region_id));
    }
    md.layouts.emplace_back(std::move(name), std::move(layout).value());
  }
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "extras count", 8, 64));
  for (uint32_t i = 0; i < n; ++i) {
    std::string t, b;
    PDKV_RETURN_IF_ERROR(r.get_str(&t, "extra transport", 64));
    PDKV_RETURN_IF_ERROR(check_name(t, "extra transport"));
    PDKV_RETURN_IF_ERROR(r.get_str(&b, "extra blob", 16u << 20));
    md.extras.emplace_back(std::move(t), std::move(b));
  }
  if (r.remaining() != 0)
    return ProtocolError("metadata has " + std::to_string(r.remaining()) + " unexpected trailing bytes");
  return md;
}

}  // namespace pdkv
