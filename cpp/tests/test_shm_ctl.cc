// Unit tests for the shm and cuda_ipc control-frame decoders (pure functions).
#include <gtest/gtest.h>

#include <string>

#include "transport/cuda_ipc/wire.h"
#include "transport/shm/ctl_guard.h"
#include "transport/shm/wire.h"

namespace pdkv {
namespace {

shm::CtlHdr shm_hdr(shm::Ctl type, uint32_t aux_len, uint32_t status = 0) {
  return shm::CtlHdr{shm::kCtlMagic, static_cast<uint16_t>(type), 0, 7, aux_len, status};
}

TEST(ShmCtl, PreHelloAcceptsOnlyAHelloOfAtMost4KiB) {
  using shm::Ctl;
  using shm::CtlSide;
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kHello, 4096), CtlSide::kTargetPreHello, 1 << 20).ok());
  // The reported attack: a 2 MiB frame before the hello.
  Status big = check_ctl_header(shm_hdr(Ctl::kHello, 2u << 20), CtlSide::kTargetPreHello, 1 << 20);
  EXPECT_EQ(big.code(), StatusCode::kProtocolError);
  EXPECT_NE(big.message().find("limit 4096"), std::string::npos) << big.message();
  for (Ctl t : {Ctl::kNotify, Ctl::kRegionReq, Ctl::kRevokeAck, Ctl::kError}) {
    Status st = check_ctl_header(shm_hdr(t, 0), CtlSide::kTargetPreHello, 1 << 20);
    EXPECT_EQ(st.code(), StatusCode::kProtocolError);
    EXPECT_NE(st.message().find("first frame must be a hello"), std::string::npos) << st.message();
  }
}

TEST(ShmCtl, PerTypeLimitsAfterHello) {
  using shm::Ctl;
  using shm::CtlSide;
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kNotify, 1000), CtlSide::kTarget, 1000).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kNotify, 1001), CtlSide::kTarget, 1000).ok());
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kRegionReq, 0), CtlSide::kTarget, 1000).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kRegionReq, 1), CtlSide::kTarget, 1000).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kRevokeAck, 8), CtlSide::kTarget, 1000).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kHello, 10), CtlSide::kTarget, 1000).ok());  // only once
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kRevoke, 0), CtlSide::kTarget, 1000).ok());  // wrong direction
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kRevoke, 0), CtlSide::kInitiator, 0).ok());
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kRegionResp, 4096, 2), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kRegionResp, 4097), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kNotifyAck, 0, 3), CtlSide::kInitiator, 0).ok());  // stray status
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kNotify, 0), CtlSide::kInitiator, 0).ok());
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kHelloAck, 100), CtlSide::kInitiatorHello, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kHelloAck, 5000), CtlSide::kInitiatorHello, 0).ok());
  auto bad = shm_hdr(Ctl::kNotify, 0);
  bad.magic = 1;
  EXPECT_FALSE(check_ctl_header(bad, CtlSide::kTarget, 10).ok());
  bad = shm_hdr(Ctl::kNotify, 0);
  bad.flags = 1;
  EXPECT_FALSE(check_ctl_header(bad, CtlSide::kTarget, 10).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(static_cast<Ctl>(0), 0), CtlSide::kTarget, 10).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(static_cast<Ctl>(999), 0), CtlSide::kInitiator, 10).ok());
}

TEST(ShmCtl, GenerationTableFrames) {
  using shm::Ctl;
  using shm::CtlSide;
  // GenReq: initiator -> target, a layout name of at most 128 bytes.
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kGenReq, 128), CtlSide::kTarget, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenReq, 129), CtlSide::kTarget, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenReq, 2), CtlSide::kInitiator, 0).ok());     // wrong direction
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenReq, 2, 3), CtlSide::kTarget, 0).ok());     // stray status
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenReq, 2), CtlSide::kTargetPreHello, 0).ok());
  EXPECT_TRUE(validate_ctl_frame(shm_hdr(Ctl::kGenReq, 2), "kv", CtlSide::kTarget, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kGenReq, 0), "", CtlSide::kTarget, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kGenReq, 3), "k v", CtlSide::kTarget, 0).ok());
  // GenResp: target -> initiator; success is exactly a u32 block count, a failure a message.
  EXPECT_TRUE(check_ctl_header(shm_hdr(Ctl::kGenResp, 4096, 2), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenResp, 4097, 2), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(check_ctl_header(shm_hdr(Ctl::kGenResp, 4), CtlSide::kTarget, 0).ok());
  EXPECT_TRUE(validate_ctl_frame(shm_hdr(Ctl::kGenResp, 4), std::string(4, '\1'), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kGenResp, 3), std::string(3, '\1'), CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kGenResp, 8), std::string(8, '\1'), CtlSide::kInitiator, 0).ok());
  EXPECT_TRUE(validate_ctl_frame(shm_hdr(Ctl::kGenResp, 3, 2), "bad", CtlSide::kInitiator, 0).ok());
}

TEST(ShmCtl, HelloRoundTripAndRejections) {
  shm::Hello h{shm::kShmVersion, 42, "alice", "bob", {}, {}};
  h.nonce.fill(4);
  h.pub.fill(5);
  auto back = shm::parse_hello(shm::encode_hello(h));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->expect_instance, 42u);
  EXPECT_EQ(back->from, "alice");
  EXPECT_EQ(back->to, "bob");
  EXPECT_EQ(back->nonce, h.nonce);
  EXPECT_EQ(back->pub, h.pub);
  std::string enc = shm::encode_hello(h);
  for (size_t cut = 0; cut < enc.size(); ++cut)
    EXPECT_EQ(shm::parse_hello(enc.substr(0, cut)).status().code(), StatusCode::kProtocolError) << cut;
  EXPECT_EQ(shm::parse_hello(enc + "x").status().code(), StatusCode::kProtocolError);  // trailing byte
  h.version = 1;
  EXPECT_EQ(shm::parse_hello(shm::encode_hello(h)).status().code(), StatusCode::kVersionMismatch);
  h.version = shm::kShmVersion;
  h.from = std::string(200, 'a');
  EXPECT_EQ(shm::parse_hello(shm::encode_hello(h)).status().code(), StatusCode::kProtocolError);
  h.from = "bad\nname";
  EXPECT_FALSE(shm::parse_hello(shm::encode_hello(h)).ok());
  // A string length larger than the input is refused before anything is copied.
  std::string huge = enc.substr(0, 10) + std::string("\xff\xff\xff\x7f", 4);
  EXPECT_EQ(shm::parse_hello(huge).status().code(), StatusCode::kProtocolError);
}

TEST(ShmCtl, HelloAckAndRegionInfo) {
  auto ack = shm::parse_hello_ack(shm::encode_hello_ack({9, 1234, "bob"}));
  ASSERT_TRUE(ack.ok());
  EXPECT_EQ(ack->instance, 9u);
  EXPECT_EQ(ack->pid, 1234u);
  EXPECT_FALSE(shm::parse_hello_ack(shm::encode_hello_ack({9, 0, "bob"})).ok());
  // Bytes after the name are refused, as in a hello (same wording).
  auto trailing = shm::parse_hello_ack(shm::encode_hello_ack({9, 1234, "bob"}) + "xy");
  EXPECT_EQ(trailing.status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(trailing.status().message(), "hello-ack has 2 trailing bytes");
  EXPECT_EQ(shm::parse_hello(shm::encode_hello({shm::kShmVersion, 42, "a", "b", "s"}) + "xy").status().message(),
            "hello has 2 trailing bytes");
  shm::RegionInfo ri{0x1000, 65536, MemKind::kHost, true, 4096, 8192};
  auto back = shm::parse_region_info(shm::encode_region_info(ri));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->addr, 0x1000u);
  EXPECT_EQ(back->len, 65536u);
  EXPECT_TRUE(back->shareable);
  EXPECT_EQ(back->shared_offset, 4096u);
  EXPECT_EQ(back->shared_len, 8192u);
  // The window must lie inside the region, and a memfd comes exactly with a window.
  EXPECT_EQ(shm::parse_region_info(shm::encode_region_info({0x1000, 65536, MemKind::kHost, true, 61440, 8192}))
                .status().code(), StatusCode::kProtocolError);
  EXPECT_FALSE(shm::parse_region_info(shm::encode_region_info({0x1000, 65536, MemKind::kHost, true, 0, 0})).ok());
  EXPECT_FALSE(shm::parse_region_info(shm::encode_region_info({0x1000, 65536, MemKind::kHost, false, 0, 4096})).ok());
  EXPECT_FALSE(shm::parse_region_info(shm::encode_region_info(ri) + "x").ok());
  EXPECT_FALSE(shm::parse_region_info(shm::encode_region_info({0x1000, 0, MemKind::kHost, false})).ok());
  EXPECT_FALSE(shm::parse_region_info(shm::encode_region_info({~0ull - 10, 100, MemKind::kHost, false})).ok());
  std::string enc = shm::encode_region_info(ri);
  enc[16] = 7;  // kind
  EXPECT_FALSE(shm::parse_region_info(enc).ok());
}

TEST(ShmCtl, ValidateFrameChecksBodies) {
  using shm::Ctl;
  using shm::CtlSide;
  std::string info = shm::encode_region_info({0x1000, 64, MemKind::kHost, false});
  EXPECT_TRUE(validate_ctl_frame(shm_hdr(Ctl::kRegionResp, info.size()), info, CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kRegionResp, 3), "abc", CtlSide::kInitiator, 0).ok());
  EXPECT_TRUE(validate_ctl_frame(shm_hdr(Ctl::kRegionResp, 3, 2), "abc", CtlSide::kInitiator, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kHello, 3), "abc", CtlSide::kTargetPreHello, 0).ok());
  EXPECT_FALSE(validate_ctl_frame(shm_hdr(Ctl::kNotify, 5), "abc", CtlSide::kTarget, 100).ok());  // short aux
}

cuda_ipc::CtlHdr cuda_hdr(cuda_ipc::Ctl type, uint32_t aux_len, uint32_t status = 0) {
  return cuda_ipc::CtlHdr{cuda_ipc::kCtlMagic, static_cast<uint16_t>(type), 0, 3, aux_len, status};
}

TEST(CudaIpcCtl, PerStateLimits) {
  using cuda_ipc::Ctl;
  using cuda_ipc::CtlSide;
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kHello, 4096), CtlSide::kExporterPreHello).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kHello, 4097), CtlSide::kExporterPreHello).ok());
  Status st = check_ctl_header(cuda_hdr(Ctl::kRevoke, 0), CtlSide::kExporterPreHello);
  EXPECT_NE(st.message().find("first control frame must be a hello"), std::string::npos) << st.message();
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kRevokeAck, 0), CtlSide::kExporter).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kRevokeAck, 1), CtlSide::kExporter).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kHello, 10), CtlSide::kExporter).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kRevoke, 0), CtlSide::kImporter).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kError, 4096, 5), CtlSide::kImporter).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kRevoke, 0, 5), CtlSide::kImporter).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kHelloAck, 0), CtlSide::kImporterHello).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kHelloAck, 32), CtlSide::kImporterHello).ok());  // the exporter's MAC
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kHelloAck, 33), CtlSide::kImporterHello).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kChallenge, 80), CtlSide::kImporterHello).ok());
  EXPECT_TRUE(check_ctl_header(cuda_hdr(Ctl::kProof, 32), CtlSide::kExporterProof).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kProof, 32), CtlSide::kExporterPreHello).ok());
  EXPECT_FALSE(check_ctl_header(cuda_hdr(Ctl::kRevokeAck, 0), CtlSide::kExporterProof).ok());
}

TEST(CudaIpcCtl, HelloRoundTrip) {
  cuda_ipc::Hello h{cuda_ipc::kCtlVersion, 5, "imp", {}, {}};
  h.pub.fill(6);
  std::string enc = cuda_ipc::encode_hello(h);
  auto back = cuda_ipc::parse_hello(enc);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->from, "imp");
  EXPECT_EQ(back->pub, h.pub);
  for (size_t cut = 0; cut < enc.size(); ++cut) EXPECT_FALSE(cuda_ipc::parse_hello(enc.substr(0, cut)).ok());
  h.version = 9;
  EXPECT_EQ(cuda_ipc::parse_hello(cuda_ipc::encode_hello(h)).status().code(), StatusCode::kVersionMismatch);
}

TEST(CtlGuard, ThrottleDelaysOnlyAfterTheBurst) {
  using C = util::HandshakeThrottle::Clock;
  util::HandshakeThrottle t(3, 1, 1.0);
  const auto t0 = C::now();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t.on_failure(t0), C::duration::zero());
  EXPECT_GT(t.on_failure(t0), C::duration::zero());
  EXPECT_EQ(t.on_failure(t0 + std::chrono::seconds(2)), C::duration::zero());  // refilled
}

TEST(CtlGuard, LogLimiterCountsSuppressed) {
  using C = util::LogLimiter::Clock;
  util::LogLimiter l(1.0);
  const auto t0 = C::now();
  uint64_t n = 99;
  EXPECT_TRUE(l.allow(t0, &n));
  EXPECT_EQ(n, 0u);
  for (int i = 0; i < 500; ++i) EXPECT_FALSE(l.allow(t0 + std::chrono::milliseconds(i), &n));
  EXPECT_TRUE(l.allow(t0 + std::chrono::milliseconds(1001), &n));
  EXPECT_EQ(n, 500u);
}

}  // namespace
}  // namespace pdkv
