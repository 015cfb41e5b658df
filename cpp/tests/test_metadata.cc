// decode_metadata: string fields must be what every consumer (Python included) can
// decode, and counts are checked against the bytes that remain before anything is
// allocated.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "pdkv/metadata.h"

namespace pdkv {
namespace {

AgentMetadata sample() {
  AgentMetadata md;
  md.name = "decode";
  md.instance_id = 0x1234;
  md.host_id = "boot-id";
  md.pid = 42;
  md.endpoints.push_back({"tcp", "127.0.0.1:5555"});
  return md;
}

Status decode_status(const AgentMetadata& md) {
  auto r = decode_metadata(encode_metadata(md));
  return r.ok() ? Status::Ok() : r.status();
}

TEST(MetadataText, ValidUtf8IsAccepted) {
  AgentMetadata md = sample();
  md.host_id = "h\xc3\xa9te-\xe2\x82\xac-\xf0\x9f\x98\x80";  // é, €, an emoji
  auto r = decode_metadata(encode_metadata(md));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->host_id, md.host_id);
}

TEST(MetadataText, InvalidUtf8InHostIdOrAddressIsAProtocolError) {
  const char* bad[] = {"\xff", "ab\xc3", "\xc0\xaf" /* overlong '/' */, "\xed\xa0\x80" /* surrogate */,
                       "\xf4\x90\x80\x80" /* > U+10FFFF */, "\xe2\x82" /* truncated */};
  for (const char* b : bad) {
    AgentMetadata md = sample();
    md.host_id = b;
    Status st = decode_status(md);
    EXPECT_EQ(st.code(), StatusCode::kProtocolError) << b;
    EXPECT_NE(st.message().find("host id"), std::string::npos) << st.message();
    md = sample();
    md.endpoints[0].address = std::string("127.0.0.1:") + b;
    st = decode_status(md);
    EXPECT_EQ(st.code(), StatusCode::kProtocolError);
    EXPECT_NE(st.message().find("endpoint address"), std::string::npos) << st.message();
  }
}

TEST(MetadataText, TransportAndExtraNamesMustBePrintableAscii) {
  AgentMetadata md = sample();
  md.endpoints[0].transport = "t\xffp";
  EXPECT_EQ(decode_status(md).code(), StatusCode::kProtocolError);
  md = sample();
  md.extras.push_back({"ni xl", "blob"});
  EXPECT_EQ(decode_status(md).code(), StatusCode::kProtocolError);
}

TEST(MetadataCounts, ACountLargerThanTheRemainingBytesIsRejectedBeforeAllocating) {
  std::string blob = encode_metadata(sample());
  // The endpoint count follows magic(8) + version(2) + body length(4) + name + instance +
  // host id + pid: find it by its value (1) right after the pid (42).
  const uint32_t pid = 42;
  size_t at = blob.find(std::string(reinterpret_cast<const char*>(&pid), 4));
  ASSERT_NE(at, std::string::npos);
  at += 4;
  const uint32_t huge = 0x7fffffff;
  std::memcpy(&blob[at], &huge, 4);
  auto r = decode_metadata(blob);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(r.status().message().find("endpoint count"), std::string::npos) << r.status().message();
}

// ---- layouts: version 2 carries token and head strides; version 1 still decodes

// One region and a vLLM-CPU-style layout (K and V interleaved per head) inside it.
AgentMetadata with_strided_layout() {
  AgentMetadata md = sample();
  md.regions.push_back(RegionDesc{7, 1 << 20, 1 << 16, MemKind::kHost, -1, true});
  KVGeometry g;
  g.num_layers = 1;
  g.num_blocks = 4;
  g.block_tokens = 4;
  g.kv_heads = 2;
  g.head_dim = 8;
  g.dtype = DType::kF16;  // 16-byte rows
  std::vector<KVSegment> segs(2);
  for (uint32_t p = 0; p < 2; ++p) {
    segs[p].addr = (1 << 20) + p * 16;
    segs[p].block_stride = 256;
    segs[p].token_stride = 32;
    segs[p].head_stride = 128;
    segs[p].region_id = 7;
    segs[p].region_offset = p * 16;
  }
  auto l = KVLayout::make(g, std::move(segs));
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  md.layouts.emplace_back("kv", std::move(l).value());
  return md;
}

void set_version(std::string& blob, uint16_t v) { std::memcpy(&blob[8], &v, 2); }

TEST(MetadataLayouts, StridesRoundTrip) {
  AgentMetadata md = with_strided_layout();
  auto r = decode_metadata(encode_metadata(md));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const KVLayout* l = r->find_layout("kv");
  ASSERT_NE(l, nullptr);
  for (size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(l->segments()[p].token_stride, 32u);
    EXPECT_EQ(l->segments()[p].head_stride, 128u);
    EXPECT_EQ(l->segments()[p].addr, md.layouts[0].second.segments()[p].addr);
  }
  EXPECT_EQ(encode_metadata(*r), encode_metadata(md));
}

TEST(MetadataLayouts, AOneBlockLayoutKeepsItsBlockStride) {
  // Found by the fuzzer: a block stride is meaningless with one block, and any value
  // (0 included) must round-trip unchanged (one encoding per value).
  AgentMetadata md = with_strided_layout();
  KVGeometry g = md.layouts[0].second.geometry();
  g.num_blocks = 1;
  std::vector<KVSegment> segs = md.layouts[0].second.segments();
  for (auto& s : segs) s.block_stride = 0;
  auto l = KVLayout::make(g, segs);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->segments()[0].block_stride, 0u);
  md.layouts[0].second = *l;
  const std::string blob = encode_metadata(md);
  auto r = decode_metadata(blob);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(encode_metadata(*r), blob);
}

TEST(MetadataLayouts, AVersionOneBlobStillDecodesWithTheOrdersStrides) {
  // Version 1: the same layout record without the two stride fields per segment.
  AgentMetadata md = sample();
  md.regions.push_back(RegionDesc{7, 1 << 20, 1 << 16, MemKind::kHost, -1, true});
  KVGeometry g;
  g.num_layers = 1;
  g.num_blocks = 4;
  g.block_tokens = 4;
  g.kv_heads = 2;
  g.head_dim = 8;
  g.dtype = DType::kF16;
  g.order = TokenOrder::kHND;
  auto l = KVLayout::per_layer(g, {1 << 20}, {(1 << 20) + 4096});
  ASSERT_TRUE(l.ok());
  for (auto& s : l->mutable_segments()) {
    s.region_id = 7;
    s.region_offset = s.addr - (1 << 20);
  }
  md.layouts.emplace_back("kv", *l);
  std::string v2 = encode_metadata(md);
  // Rebuild as version 1: drop the last 16 bytes of each 48-byte segment record.
  const size_t extras = 4;  // the (empty) extras count ends the body
  const size_t segs_end = v2.size() - extras, segs_begin = segs_end - 2 * 48;
  std::string v1 = v2.substr(0, segs_begin);
  for (size_t i = 0; i < 2; ++i) v1 += v2.substr(segs_begin + i * 48, 32);
  v1 += v2.substr(segs_end);
  set_version(v1, 1);
  const uint32_t body = static_cast<uint32_t>(v1.size() - 14);
  std::memcpy(&v1[10], &body, 4);
  auto r = decode_metadata(v1);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const KVSegment& k = r->find_layout("kv")->segments()[0];
  EXPECT_EQ(k.token_stride, 16u);      // HND: tokens one row apart
  EXPECT_EQ(k.head_stride, 4u * 16u);  // heads one block_tokens x row apart
  EXPECT_EQ(encode_metadata(*r), v2);  // re-encodes as the current version
}

TEST(MetadataLayouts, ANewerVersionIsAVersionMismatch) {
  std::string blob = encode_metadata(with_strided_layout());
  set_version(blob, kMetadataVersion + 1);
  auto r = decode_metadata(blob);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kVersionMismatch);
  set_version(blob, 0);
  EXPECT_EQ(decode_metadata(blob).status().code(), StatusCode::kVersionMismatch);
}

TEST(MetadataLayouts, OverlappingOrOutOfRegionStridesAreProtocolErrors) {
  AgentMetadata md = with_strided_layout();
  md.layouts[0].second.mutable_segments()[0].head_stride = 8;  // heads overlap rows
  Status st = decode_status(md);
  EXPECT_EQ(st.code(), StatusCode::kProtocolError);
  EXPECT_NE(st.message().find("head stride"), std::string::npos) << st.message();
  md = with_strided_layout();
  md.layouts[0].second.mutable_segments()[1].head_stride = 1 << 16;  // the last head past the region
  st = decode_status(md);
  EXPECT_EQ(st.code(), StatusCode::kProtocolError);
  EXPECT_NE(st.message().find("past the end of region"), std::string::npos) << st.message();
  md = with_strided_layout();
  md.layouts[0].second.mutable_segments()[1].token_stride = 0;
  md.layouts[0].second.mutable_segments()[1].head_stride = 0;
  st = decode_status(md);
  EXPECT_EQ(st.code(), StatusCode::kProtocolError);
  EXPECT_NE(st.message().find("without token and head strides"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace pdkv
