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

}  // namespace
}  // namespace pdkv
