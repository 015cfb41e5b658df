// Status, Result and the wire mapping of status codes (pdkv/status.h).
#include <set>

#include <gtest/gtest.h>

#include "pdkv/status.h"

namespace pdkv {
namespace {

TEST(Status, OkHasNoMessageAndContextKeepsItOk) {
  Status ok = Status::Ok();
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.to_string(), "OK");
  EXPECT_TRUE(ok.with_context("while connecting").ok());
}

TEST(Status, ToStringAndContextNameTheCode) {
  Status st = OutOfRange("bytes [0, 9) fall outside region 1");
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.to_string(), "OutOfRange: bytes [0, 9) fall outside region 1");
  Status ctx = st.with_context("peer 'b'");
  EXPECT_EQ(ctx.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ctx.message(), "peer 'b': bytes [0, 9) fall outside region 1");
  EXPECT_EQ(TimeoutError("x").code(), StatusCode::kTimeout);
  EXPECT_EQ(status_code_name(StatusCode::kTimeout), "Timeout");
}

TEST(Status, EveryCodeHasADistinctName) {
  std::set<std::string_view> names;
  for (uint32_t v = 0; v <= static_cast<uint32_t>(kLastStatusCode); ++v) {
    auto name = status_code_name(static_cast<StatusCode>(v));
    EXPECT_NE(name, "Unknown") << v;
    EXPECT_TRUE(names.insert(name).second) << name;
  }
}

TEST(Status, CodesFromThePeerAreValidated) {
  // OK where an error was announced, and unknown values, become ProtocolError.
  EXPECT_EQ(status_code_from_wire(0), StatusCode::kProtocolError);
  EXPECT_EQ(status_code_from_wire(static_cast<uint32_t>(kLastStatusCode) + 1), StatusCode::kProtocolError);
  EXPECT_EQ(status_code_from_wire(0xffffffffu), StatusCode::kProtocolError);
  for (uint32_t v = 1; v <= static_cast<uint32_t>(kLastStatusCode); ++v)
    EXPECT_EQ(status_code_from_wire(v), static_cast<StatusCode>(v));
}

Result<int> half(int v) {
  if (v % 2) return InvalidArgument(std::to_string(v) + " is odd");
  return v / 2;
}

Status quarter(int v, int* out) {
  PDKV_ASSIGN_OR_RETURN(int h, half(v));
  PDKV_ASSIGN_OR_RETURN(*out, half(h));
  return Status::Ok();
}

TEST(Result, HoldsAValueOrAnErrorAndTheMacrosPropagate) {
  Result<int> r = half(8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 4);
  EXPECT_TRUE(r.status().ok());
  int q = 0;
  EXPECT_TRUE(quarter(8, &q).ok());
  EXPECT_EQ(q, 2);
  Status st = quarter(6, &q);  // 6 -> 3 -> odd
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "3 is odd");
}

}  // namespace
}  // namespace pdkv
