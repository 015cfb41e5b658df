// pdkv/metadata.h: the self-describing blob an agent exports so peers can reach it.
//
// Format (version 2, little endian, every length checked before use):
//   magic "PDKVMETA" (8 bytes) | u16 version | u32 body length | body
//   body: name, instance id, host id, pid, endpoints, regions, layouts, extras
// Strings are u32 length + bytes; counts are u32. A layout is its name, geometry
// (u32 layers, blocks, block_tokens, kv_heads, head_dim; u8 parts, dtype, order) and
// u32 segment count + per segment u64 addr, block_stride, region_id, region_offset,
// token_stride, head_stride (version 1 had no token/head strides: they follow from
// the order; version 1 blobs still decode). Nothing is pickled, nothing executes.
// decode_metadata() rejects truncated or inconsistent input with ProtocolError
// naming the field, and a version outside [oldest, current] with VersionMismatch.
//
// The blob carries no secret: anyone may read it; writing needs the secret.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pdkv/kv_layout.h"
#include "pdkv/region.h"
#include "pdkv/status.h"

namespace pdkv {

inline constexpr uint16_t kMetadataVersion = 2;        // what encode_metadata() writes
inline constexpr uint16_t kMetadataOldestVersion = 1;  // the oldest decode_metadata() reads

struct Endpoint {
  std::string transport;  // registry name, e.g. "tcp"
  std::string address;    // transport-specific, e.g. "127.0.0.1:5555"
};

struct AgentMetadata {
  std::string name;
  uint64_t instance_id = 0;   // random per Agent object; changes on restart
  std::string host_id;        // equal on two agents iff they share a kernel (boot id)
  uint32_t pid = 0;
  std::vector<Endpoint> endpoints;
  std::vector<RegionDesc> regions;  // exported regions only
  std::vector<std::pair<std::string, KVLayout>> layouts;
  std::vector<std::pair<std::string, std::string>> extras;  // transport name -> opaque blob

  const RegionDesc* find_region(uint64_t id) const;
  const KVLayout* find_layout(std::string_view name) const;
  const Endpoint* find_endpoint(std::string_view transport) const;
};

// A known peer: its metadata and the secret to prove knowledge of to it.
struct Peer {
  AgentMetadata md;
  std::string secret;  // never sent: handshakes prove it (pdkv/spi/auth.h derive_key)
};

std::string encode_metadata(const AgentMetadata& md);
Result<AgentMetadata> decode_metadata(std::string_view blob);

// Names must be 1..128 printable ASCII characters without spaces.
Status validate_name(std::string_view what, std::string_view name);

}  // namespace pdkv
