// The tcp frame rules (transport/tcp/wire.h) and the listener guards (guard.h).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "transport/tcp/compress.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/guard.h"

namespace pdkv::tcp {
namespace {

constexpr ConnState kInHs{ConnRole::kInbound, ConnPhase::kHandshake};
constexpr ConnState kInOpen{ConnRole::kInbound, ConnPhase::kOpen};
constexpr ConnState kInProof{ConnRole::kInbound, ConnPhase::kProofWait};
constexpr ConnState kOutHs{ConnRole::kOutbound, ConnPhase::kHandshake};
constexpr ConnState kOutOpen{ConnRole::kOutbound, ConnPhase::kOpen};
constexpr ConnState kOutMeta{ConnRole::kOutbound, ConnPhase::kMetaWait};
const FrameLimits kLim{1u << 20};

FrameHeader hdr(FrameType t, uint32_t count = 0, uint32_t aux = 0, uint64_t payload = 0) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(t);
  h.count = count;
  h.aux_len = aux;
  h.payload = payload;
  return h;
}

// A frame that is valid in `s`, for every type.
FrameHeader valid(FrameType t) {
  switch (t) {
    case FrameType::kHello: return hdr(t, 0, 100);
    case FrameType::kHelloAck: return hdr(t, 0, 32);
    case FrameType::kChallenge: return hdr(t, 0, 80);
    case FrameType::kProof: return hdr(t, 0, 32);
    case FrameType::kWrite: return hdr(t, 1, 0, 16);
    case FrameType::kReadReq: return hdr(t, 1);
    case FrameType::kReadResp: return hdr(t, 0, 0, 16);
    case FrameType::kReadRespZ: return hdr(t, 0, 0, 64);
    case FrameType::kMetaResp: return hdr(t, 0, 1000);
    default: return hdr(t);
  }
}

struct Where {
  FrameType type;
  ConnState ok_in;
};

const std::vector<Where> kWhere = {
    {FrameType::kHello, kInHs},      {FrameType::kHelloAck, kOutHs}, {FrameType::kMetaReq, kInOpen},
    {FrameType::kMetaResp, kOutMeta}, {FrameType::kWrite, kInOpen},   {FrameType::kReadReq, kInOpen},
    {FrameType::kReadResp, kOutOpen}, {FrameType::kAck, kOutOpen},    {FrameType::kNotify, kInOpen},
    {FrameType::kError, kOutOpen},    {FrameType::kReadRespZ, kOutOpen}, {FrameType::kChallenge, kOutHs},
    {FrameType::kProof, kInProof},
};
const std::vector<ConnState> kAllStates = {kInHs, kInProof, kInOpen, kOutHs, kOutOpen, kOutMeta};

bool same(ConnState a, ConnState b) { return a.role == b.role && a.phase == b.phase; }

TEST(TcpFrame, EachTypeIsValidOnlyWhereItBelongs) {
  for (const auto& w : kWhere) {
    const FrameHeader h = valid(w.type);
    EXPECT_TRUE(check_header(h, w.ok_in, kLim).ok()) << frame_type_name(h.type);
    for (ConnState s : kAllStates) {
      const bool error_ok = w.type == FrameType::kError && !same(s, kInHs) && !same(s, kInProof);
      if (same(s, w.ok_in) || error_ok) continue;
      Status st = check_header(h, s, kLim);
      EXPECT_EQ(st.code(), StatusCode::kProtocolError) << frame_type_name(h.type) << " accepted in a wrong state";
    }
  }
}

TEST(TcpFrame, InboundHandshakeNamesTheMissingHello) {
  Status st = check_header(hdr(FrameType::kWrite, 1, 0, 16), kInHs, kLim);
  EXPECT_NE(st.message().find("must be a hello"), std::string::npos) << st.message();
}

TEST(TcpFrame, HugeCountsAuxAndPayloadAreRejectedForEveryType) {
  for (const auto& w : kWhere) {
    for (int field = 0; field < 3; ++field) {
      FrameHeader h = valid(w.type);
      if (field == 0) h.count = 0xFFFFFFFFu;
      if (field == 1) h.aux_len = 0xFFFFFFFFu;
      if (field == 2) h.payload = ~0ull;
      Status st = check_header(h, w.ok_in, kLim);
      EXPECT_EQ(st.code(), StatusCode::kProtocolError) << frame_type_name(h.type) << " field " << field;
    }
  }
}

TEST(TcpFrame, ControlBytesAreBoundedWhenValid) {
  // The largest legal control buffer: a write with every extent and a notification.
  FrameHeader h = hdr(FrameType::kWrite, kMaxExtentsPerFrame, kLim.max_notif_bytes, 1);
  h.flags = kFlagNotif;
  ASSERT_TRUE(check_header(h, kInOpen, kLim).ok());
  EXPECT_EQ(control_bytes(h), uint64_t(kMaxExtentsPerFrame) * 24 + kLim.max_notif_bytes);
  // An error frame may carry no extents at all (the crash of issue 11, item 1).
  FrameHeader e = hdr(FrameType::kError, 1u << 24, 10);
  EXPECT_EQ(check_header(e, kOutOpen, kLim).code(), StatusCode::kProtocolError);
  // Notifications are capped on the wire whatever the configuration says.
  FrameHeader n = hdr(FrameType::kNotify, 0, kMaxNotifWireBytes + 1);
  EXPECT_FALSE(check_header(n, kInOpen, FrameLimits{0xFFFFFFFFu}).ok());
}

TEST(TcpFrame, FlagsStatusAndMagic) {
  FrameHeader h = valid(FrameType::kWrite);
  h.flags = 2;
  EXPECT_FALSE(check_header(h, kInOpen, kLim).ok());
  h = valid(FrameType::kWrite);
  h.aux_len = 8;  // aux without kFlagNotif
  EXPECT_NE(check_header(h, kInOpen, kLim).message().find("notification"), std::string::npos);
  h.flags = kFlagNotif;
  EXPECT_TRUE(check_header(h, kInOpen, kLim).ok());
  h = valid(FrameType::kReadReq);
  h.status = 3;
  EXPECT_FALSE(check_header(h, kInOpen, kLim).ok());
  h = valid(FrameType::kAck);
  h.status = 3;
  EXPECT_TRUE(check_header(h, kOutOpen, kLim).ok());
  h.magic = 0x12345678;
  EXPECT_NE(check_header(h, kOutOpen, kLim).message().find("magic"), std::string::npos);
  for (uint16_t t : {uint16_t(0), uint16_t(12), uint16_t(99), uint16_t(0xFFFF)}) {
    h = hdr(FrameType::kAck);
    h.type = t;
    EXPECT_FALSE(check_header(h, kOutOpen, kLim).ok()) << t;
    EXPECT_FALSE(check_header(h, kInOpen, kLim).ok()) << t;
  }
}

TEST(TcpFrame, ExtentsSumWithoutOverflow) {
  FrameHeader h = hdr(FrameType::kWrite, 2, 0, 30);
  WireExtent ok[2] = {{1, 0, 10}, {1, 100, 20}};
  auto sum = check_extents(ok, 2, h);
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, 30u);
  h.payload = 31;
  EXPECT_NE(check_extents(ok, 2, h).status().message().find("add up to 30"), std::string::npos);
  WireExtent zero[1] = {{1, 0, 0}};
  EXPECT_NE(check_extents(zero, 1, h).status().message().find("length 0"), std::string::npos);
  WireExtent wrap[2] = {{1, 0, ~0ull - 4}, {1, 0, 10}};  // sum wraps around u64
  EXPECT_FALSE(check_extents(wrap, 2, hdr(FrameType::kReadReq, 2)).ok());
  WireExtent big[2] = {{1, 0, kMaxPayloadPerFrame}, {1, 0, 1}};
  EXPECT_FALSE(check_extents(big, 2, hdr(FrameType::kReadReq, 2)).ok());
  EXPECT_TRUE(check_extents(big, 1, hdr(FrameType::kReadReq, 1)).ok());
}

// A compressed write decodes to at most one codec chunk (issue 26): its extents may
// add up to kMaxCompressedChunk, not more, however often they repeat one range.
TEST(TcpFrame, CompressedWriteExtentsAreBoundedBeforeDecoding) {
  std::vector<WireExtent> repeated(4096, WireExtent{1, 0, 16u << 10});  // 64 MiB over one 16 KiB range
  EXPECT_TRUE(check_extents(repeated.data(), 4096, hdr(FrameType::kWriteZ, 4096, 0, 2048)).ok());
  repeated.push_back(WireExtent{1, 0, 1});
  auto over = check_extents(repeated.data(), 4097, hdr(FrameType::kWriteZ, 4097, 0, 2048));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(over.status().message().find("more than a compressed frame may decode to"), std::string::npos);
  // A plain write or read of the same extents is not limited by it.
  EXPECT_TRUE(check_extents(repeated.data(), 4097, hdr(FrameType::kReadReq, 4097)).ok());
  FrameHeader sh = hdr(FrameType::kWriteZ, 1, 0, 2048);
  sh.flags = kFlagStrided;
  const WireStridedExtent big{1, 0, 4096, (64u << 20) / 4096 + 1, 4096};
  EXPECT_FALSE(check_strided_extents(&big, 1, sh).ok());
  const WireStridedExtent fits{1, 0, 4096, (64u << 20) / 4096, 4096};
  EXPECT_TRUE(check_strided_extents(&fits, 1, sh).ok());
}

// The largest frame a sender of gathered small extents makes (out_msg.h) passes the
// receiver's rules; one bad piece among many, or a count that does not add up, fails.
TEST(TcpFrame, AFrameOfManySmallPiecesIsCheckedPieceByPiece) {
  std::vector<WireExtent> pieces(kMaxGatherExtents);
  for (size_t i = 0; i < pieces.size(); ++i) pieces[i] = {1, i * 512, 256};
  FrameHeader h = hdr(FrameType::kWrite, kMaxGatherExtents, 0, uint64_t(kMaxGatherExtents) * 256);
  ASSERT_TRUE(check_header(h, kInOpen, kLim).ok());
  ASSERT_LE(kMaxGatherExtents, kMaxExtentsPerFrame);
  auto sum = check_extents(pieces.data(), kMaxGatherExtents, h);
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, uint64_t(kMaxGatherExtents) * 256);
  h.payload += 1;
  EXPECT_NE(check_extents(pieces.data(), kMaxGatherExtents, h).status().message().find("add up to"),
            std::string::npos);
  h.payload -= 1;
  pieces[9000].len = 0;
  EXPECT_NE(check_extents(pieces.data(), kMaxGatherExtents, h).status().message().find("extent 9000 has length 0"),
            std::string::npos);
  pieces[9000] = {1, 9000 * 512, ~0ull - 100};  // one huge piece among small ones
  EXPECT_FALSE(check_extents(pieces.data(), kMaxGatherExtents, h).ok());
}

TEST(TcpFrame, ExtentInRegionHandlesOverflow) {
  EXPECT_TRUE(extent_in_region(0, 4096, 4096));
  EXPECT_TRUE(extent_in_region(4095, 1, 4096));
  EXPECT_FALSE(extent_in_region(4000, 200, 4096));
  EXPECT_FALSE(extent_in_region(1ull << 63, 16, 4096));
  EXPECT_FALSE(extent_in_region(16, ~0ull - 8, 4096));  // offset + len wraps
  EXPECT_FALSE(extent_in_region(4097, 0, 4096));
}

TEST(TcpFrame, HelloRoundTripAndRejections) {
  HelloBody b{kWireVersion, 3, 42, "init", "target", {}, {}};
  b.nonce.fill(7);
  b.pub.fill(9);
  auto d = decode_hello(encode_hello(b));
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->slot, 3u);
  EXPECT_EQ(d->instance, 42u);
  EXPECT_EQ(d->from, "init");
  EXPECT_EQ(d->to, "target");
  EXPECT_EQ(d->nonce, b.nonce);
  EXPECT_EQ(d->pub, b.pub);

  b.version = 7;
  EXPECT_EQ(decode_hello(encode_hello(b)).status().code(), StatusCode::kVersionMismatch);
  b.version = kWireVersion;
  b.from = "bad name";
  EXPECT_EQ(decode_hello(encode_hello(b)).status().code(), StatusCode::kProtocolError);
  b.from = "init";
  const std::string good = encode_hello(b);
  EXPECT_FALSE(decode_hello(good + "x").ok());  // trailing bytes
  std::string reserved = good;
  reserved[2] = 0x40;  // found by tcp_hello_fuzz: the reserved u16 must be 0
  EXPECT_FALSE(decode_hello(reserved).ok());
  for (size_t cut = 0; cut < good.size(); ++cut) EXPECT_FALSE(decode_hello(good.substr(0, cut)).ok()) << cut;
  std::string huge_len = good.substr(0, 16) + std::string("\xff\xff\xff\xff", 4);
  EXPECT_FALSE(decode_hello(huge_len).ok());
}

TEST(TcpFrame, ChallengeAndMacRoundTripAndRejections) {
  ChallengeBody c{9, "target", {}, {}};
  c.nonce.fill(1);
  c.pub.fill(2);
  const std::string good = encode_challenge(c);
  auto d = decode_challenge(good);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->instance, 9u);
  EXPECT_EQ(d->name, "target");
  EXPECT_EQ(d->nonce, c.nonce);
  EXPECT_EQ(d->pub, c.pub);
  c.name = "";
  EXPECT_FALSE(decode_challenge(encode_challenge(c)).ok());
  EXPECT_FALSE(decode_challenge(good + "z").ok());
  for (size_t cut = 0; cut < good.size(); ++cut) EXPECT_FALSE(decode_challenge(good.substr(0, cut)).ok()) << cut;
  auth::Mac m{};
  m.fill(3);
  auto back = decode_mac(encode_mac(m), "proof");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, m);
  EXPECT_FALSE(decode_mac(std::string(31, 'x'), "proof").ok());
  EXPECT_FALSE(decode_mac(std::string(33, 'x'), "proof").ok());
}

TEST(TcpGuard, BackoffDoublesIsCappedAndClearsOnSuccess) {
  AuthBackoff b(0.1, 1.0, 8);
  const auto t0 = GuardClock::now();
  EXPECT_EQ(b.wait_s("1.2.3.4", t0), 0.0);
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.1);
  EXPECT_GT(b.wait_s("1.2.3.4", t0), 0.09);
  EXPECT_EQ(b.wait_s("5.6.7.8", t0), 0.0);  // other sources are unaffected
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.2);
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.4);
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.8);
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 1.0);
  for (int i = 0; i < 100; ++i) EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 1.0);
  EXPECT_EQ(b.wait_s("1.2.3.4", t0 + std::chrono::seconds(2)), 0.0);
  b.succeeded("1.2.3.4");
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.1);
}

TEST(TcpGuard, FirstFailuresCanBeFree) {
  AuthBackoff b(0.1, 1.0, 8, 1);
  const auto t0 = GuardClock::now();
  EXPECT_EQ(b.failed("1.2.3.4", t0), 0.0);  // a typo costs nothing
  EXPECT_EQ(b.wait_s("1.2.3.4", t0), 0.0);
  EXPECT_DOUBLE_EQ(b.failed("1.2.3.4", t0), 0.1);
  EXPECT_GT(b.wait_s("1.2.3.4", t0), 0.0);
}

TEST(TcpGuard, BackoffTableIsBounded) {
  AuthBackoff b(0.1, 1.0, 8);
  const auto t0 = GuardClock::now();
  for (int i = 0; i < 1000; ++i) b.failed("10.0.0." + std::to_string(i), t0 + std::chrono::milliseconds(i));
  EXPECT_LE(b.size(), 8u);
  EXPECT_GT(b.wait_s("10.0.0.999", t0 + std::chrono::milliseconds(999)), 0.0);  // the newest is kept
}

TEST(TcpGuard, LogLimiterCountsWhatItHoldsBack) {
  LogLimiter l(std::chrono::seconds(1));
  const auto t0 = GuardClock::now();
  uint64_t held = 99;
  EXPECT_TRUE(l.allow(t0, &held));
  EXPECT_EQ(held, 0u);
  for (int i = 0; i < 500; ++i) EXPECT_FALSE(l.allow(t0 + std::chrono::milliseconds(i), &held));
  EXPECT_TRUE(l.allow(t0 + std::chrono::milliseconds(1000), &held));
  EXPECT_EQ(held, 500u);
}

// A compressed read: kFlagZReply adds exactly one ReadZSpec to the read request's
// aux, after its block generation claim; the spec's fields are checked by decode_zspec.
TEST(TcpFrame, ReadRequestCarriesItsCompressionSpec) {
  ReadZSpec z = make_zspec(TcpCompression{}, CodecKind::kFp8);
  const std::string spec(reinterpret_cast<const char*>(&z), sizeof z);
  FrameHeader h = hdr(FrameType::kReadReq, 1, sizeof z);
  h.flags = kFlagZReply;
  ASSERT_TRUE(check_header(h, kInOpen, kLim).ok());
  auto parts = split_data_aux(h, spec);
  ASSERT_TRUE(parts.ok()) << parts.status().message();
  EXPECT_EQ(parts->zspec.size(), sizeof z);
  auto codec = decode_zspec(parts->zspec);
  ASSERT_TRUE(codec.ok()) << codec.status().message();
  EXPECT_EQ(codec->options.kind, CodecKind::kFp8);
  EXPECT_EQ(codec->dtype, DType::kBF16);
  // One byte short, or more aux than a spec: refused before anything is read.
  EXPECT_EQ(split_data_aux(h, spec.substr(1)).status().code(), StatusCode::kProtocolError);
  h.aux_len = sizeof z + 1;
  EXPECT_EQ(check_header(h, kInOpen, kLim).code(), StatusCode::kProtocolError);
  // Without the flag, a read request carries no aux beyond its claim.
  h.flags = 0;
  h.aux_len = sizeof z;
  EXPECT_EQ(check_header(h, kInOpen, kLim).code(), StatusCode::kProtocolError);
  // Bad fields name themselves.
  auto with = [&](auto mutate) {
    ReadZSpec b = z;
    mutate(b);
    return decode_zspec(std::string(reinterpret_cast<const char*>(&b), sizeof b)).status();
  };
  EXPECT_NE(with([](ReadZSpec& b) { b.codec = 0; }).message().find("codec"), std::string::npos);
  EXPECT_NE(with([](ReadZSpec& b) { b.dtype = 200; }).message().find("dtype"), std::string::npos);
  EXPECT_NE(with([](ReadZSpec& b) { b.heads = 0; }).message().find("heads"), std::string::npos);
  EXPECT_NE(with([](ReadZSpec& b) { b.rows_per_group = 1u << 30; }).message().find("rows_per_group"),
            std::string::npos);
  EXPECT_NE(with([](ReadZSpec& b) { b.level = 99; }).message().find("level"), std::string::npos);
  EXPECT_EQ(with([](ReadZSpec& b) { b.reserved2 = 1; }).code(), StatusCode::kProtocolError);
}

}  // namespace
}  // namespace pdkv::tcp
