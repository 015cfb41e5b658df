// GenerationTable (pdkv/generations.h): check + pin, bump waits for pins, timeout,
// and the claim codec.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "pdkv/spi/generations.h"
#include "transport/shm/wire.h"
#include "transport/tcp/wire.h"

namespace pdkv {
namespace {

using namespace std::chrono_literals;

GenClaim claim(std::vector<uint32_t> blocks, std::vector<uint32_t> gens, std::string layout = "kv") {
  return GenClaim{std::move(layout), std::move(blocks), std::move(gens)};
}

TEST(Generations, StartAtOneAndBumpReturnsNewValues) {
  GenerationTable t;
  ASSERT_TRUE(t.add_layout("kv", 4).ok());
  EXPECT_EQ(t.get("kv", {0, 3}).value(), (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(t.bump("kv", {3}, 1.0).value(), (std::vector<uint32_t>{2}));
  EXPECT_EQ(t.get("kv", {0, 3}).value(), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(t.add_layout("kv", 4).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(t.get("kv", {4}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(t.get("nope", {0}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.bump("kv", {1, 1}, 1.0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.get("kv", {1}).value(), (std::vector<uint32_t>{1}));  // a refused bump changes nothing
}

// The published table (shared with same-host readers): sealed, exactly the block
// count, bumps stored into it, all 0 once the layout is removed.
TEST(Generations, SharedTableMirrorsBumpsAndIsZeroedOnRemoval) {
  GenerationTable t;
  ASSERT_TRUE(t.add_layout("kv", 4).ok());
  uint32_t n = 0;
  auto fd = t.dup_shared_fd("kv", &n);
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  EXPECT_EQ(n, 4u);
  struct stat st {};
  ASSERT_EQ(::fstat(*fd, &st), 0);
  EXPECT_EQ(st.st_size, 16);
  const int seals = ::fcntl(*fd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_NE(::ftruncate(*fd, 4), 0);  // a reader's mapping can never be cut short
  // Read-only, and sealed against writes: the values are the owner's word only.
  EXPECT_TRUE(seals & F_SEAL_FUTURE_WRITE);
  EXPECT_EQ(::fcntl(*fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_LT(::pwrite(*fd, "x", 1, 0), 0);
  EXPECT_EQ(::mmap(nullptr, 16, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0), MAP_FAILED);
  void* p = ::mmap(nullptr, 16, PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  const auto* g = static_cast<const uint32_t*>(p);
  EXPECT_EQ((std::vector<uint32_t>(g, g + 4)), (std::vector<uint32_t>{1, 1, 1, 1}));
  ASSERT_TRUE(t.bump("kv", {2}, 1.0).ok());
  EXPECT_EQ((std::vector<uint32_t>(g, g + 4)), (std::vector<uint32_t>{1, 1, 2, 1}));
  t.remove_layout("kv");
  EXPECT_EQ((std::vector<uint32_t>(g, g + 4)), (std::vector<uint32_t>{0, 0, 0, 0}));
  EXPECT_EQ(t.dup_shared_fd("kv", &n).status().code(), StatusCode::kNotFound);
  ::munmap(p, 16);
  ::close(*fd);
}

TEST(Generations, CheckPinsAndStaleClaimsNameTheBlock) {
  GenerationTable t;
  ASSERT_TRUE(t.add_layout("kv", 8).ok());
  auto pin = t.check_and_pin(claim({2, 5}, {1, 1}));
  ASSERT_TRUE(pin.ok());
  EXPECT_TRUE(pin->held());
  pin->reset();
  ASSERT_TRUE(t.bump("kv", {5}, 1.0).ok());
  auto stale = t.check_and_pin(claim({2, 5}, {1, 1}));
  ASSERT_EQ(stale.status().code(), StatusCode::kStaleBlock);
  const std::string& m = stale.status().message();
  EXPECT_NE(m.find("layout 'kv' block 5"), std::string::npos) << m;
  EXPECT_NE(m.find("expects generation 1"), std::string::npos) << m;
  EXPECT_NE(m.find("at generation 2"), std::string::npos) << m;
  // A failed check pins nothing: a bump of block 2 returns at once.
  EXPECT_TRUE(t.bump("kv", {2}, 0.0).ok());
  EXPECT_EQ(t.check_and_pin(claim({9}, {1})).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(t.check_and_pin(claim({1}, {1}, "other")).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.check_and_pin(claim({1}, {1, 1})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.check_and_pin(claim({1}, {0})).status().code(), StatusCode::kInvalidArgument);
}

TEST(Generations, BumpWaitsForPinsAndTimesOutWithTheBumpInForce) {
  GenerationTable t;
  ASSERT_TRUE(t.add_layout("kv", 4).ok());
  auto pin = t.check_and_pin(claim({1, 1, 2}, {1, 1, 1}));  // duplicates pin twice
  ASSERT_TRUE(pin.ok());
  auto timed_out = t.bump("kv", {1}, 0.05);
  ASSERT_EQ(timed_out.status().code(), StatusCode::kTimeout);
  EXPECT_NE(timed_out.status().message().find("block 1"), std::string::npos);
  EXPECT_EQ(t.get("kv", {1}).value(), (std::vector<uint32_t>{2}));                          // in force
  EXPECT_EQ(t.check_and_pin(claim({1}, {1})).status().code(), StatusCode::kStaleBlock);  // new checks fail
  EXPECT_TRUE(t.bump("kv", {3}, 0.0).ok());  // other blocks are not held up

  std::atomic<bool> returned{false};
  std::thread bumper([&] {
    auto r = t.bump("kv", {1, 2}, 10.0);
    EXPECT_TRUE(r.ok());
    EXPECT_EQ(r.value(), (std::vector<uint32_t>{3, 2}));
    returned = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(returned.load()) << "bump returned while a transfer accepted under the old generation held the blocks";
  GenPin moved = std::move(pin).value();  // moving keeps the pin
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(returned.load());
  moved.reset();
  bumper.join();
  EXPECT_TRUE(returned.load());
}

TEST(Generations, PinsOutliveARemovedLayoutAndReAddingStartsAbove) {
  GenerationTable t;
  ASSERT_TRUE(t.add_layout("kv", 4).ok());
  ASSERT_TRUE(t.bump("kv", {0}, 0.0).ok());
  ASSERT_TRUE(t.bump("kv", {0}, 0.0).ok());
  auto pin = t.check_and_pin(claim({1}, {1}));
  ASSERT_TRUE(pin.ok());
  t.remove_layout("kv");
  pin->reset();  // no crash: the pin holds its layout's state
  ASSERT_TRUE(t.add_layout("kv", 2).ok());
  EXPECT_EQ(t.get("kv", {0, 1}).value(), (std::vector<uint32_t>{4, 4}));
  EXPECT_EQ(t.check_and_pin(claim({0}, {3})).status().code(), StatusCode::kStaleBlock);
}

TEST(Generations, ClaimCodecRoundTripsAndRejectsMalformedInput) {
  GenClaim c = claim({7, 0, 7}, {3, 1, 3});
  auto d = decode_claim(encode_claim(c));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->layout, "kv");
  EXPECT_EQ(d->blocks, c.blocks);
  EXPECT_EQ(d->gens, c.gens);
  const std::string good = encode_claim(c);
  EXPECT_EQ(decode_claim(good + "x").status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(decode_claim(good.substr(0, good.size() - 1)).status().code(), StatusCode::kProtocolError);
  // A count the input cannot hold is refused before anything is allocated.
  std::string huge = good.substr(0, 4 + 2);
  huge += std::string("\xff\xff\xff\x7f", 4);
  EXPECT_EQ(decode_claim(huge).status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(decode_claim(encode_claim(claim({1}, {0}))).status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(decode_claim(encode_claim(claim({}, {}))).status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(decode_claim(std::string(kMaxClaimBytes + 1, '\0')).status().code(), StatusCode::kProtocolError);
}

TEST(Generations, TcpFramesCarryTheClaimBeforeTheNotification) {
  using namespace tcp;
  const std::string wire = encode_claim(claim({3}, {2}));
  const std::string aux = encode_claim_aux(wire) + "notif";
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(FrameType::kWrite);
  h.count = 1;
  h.payload = 8;
  h.flags = kFlagGens | kFlagNotif;
  h.aux_len = static_cast<uint32_t>(aux.size());
  const ConnState open{ConnRole::kInbound, ConnPhase::kOpen};
  ASSERT_TRUE(check_header(h, open, FrameLimits{}).ok());
  auto parts = split_data_aux(h, aux);
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(parts->claim, wire);
  EXPECT_EQ(parts->notif, "notif");
  h.flags = kFlagGens;  // bytes after the claim without a notification flag
  EXPECT_EQ(split_data_aux(h, aux).status().code(), StatusCode::kProtocolError);
  EXPECT_EQ(split_data_aux(h, std::string("\xff\xff\xff\x00", 4)).status().code(), StatusCode::kProtocolError);
  // Limits before allocation: a read request's aux is bounded by the claim section.
  h.type = static_cast<uint16_t>(FrameType::kReadReq);
  h.payload = 0;
  h.aux_len = kMaxClaimAux + 1;
  EXPECT_EQ(check_header(h, open, FrameLimits{}).code(), StatusCode::kProtocolError);
  h.flags = 0;
  h.aux_len = 4;
  EXPECT_EQ(check_header(h, open, FrameLimits{}).code(), StatusCode::kProtocolError);
  h.flags = kFlagNotif;  // no notification on a read request
  EXPECT_EQ(check_header(h, open, FrameLimits{}).code(), StatusCode::kProtocolError);
  // A failed ack may carry its message; a successful one nothing.
  FrameHeader a{};
  a.magic = kFrameMagic;
  a.type = static_cast<uint16_t>(FrameType::kAck);
  a.aux_len = 10;
  const ConnState out{ConnRole::kOutbound, ConnPhase::kOpen};
  EXPECT_EQ(check_header(a, out, FrameLimits{}).code(), StatusCode::kProtocolError);
  a.status = static_cast<uint32_t>(StatusCode::kStaleBlock);
  EXPECT_TRUE(check_header(a, out, FrameLimits{}).ok());
}

TEST(Generations, ShmLeaseRequestsAreBounded) {
  using namespace shm;
  LeaseReq r{5000, claim({1, 2}, {1, 1})};
  auto d = parse_lease_req(encode_lease_req(r));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->hold_ms, 5000u);
  EXPECT_EQ(d->claim.blocks, r.claim.blocks);
  r.hold_ms = 0;
  EXPECT_EQ(parse_lease_req(encode_lease_req(r)).status().code(), StatusCode::kProtocolError);
  r.hold_ms = kMaxLeaseHoldMs + 1;
  EXPECT_EQ(parse_lease_req(encode_lease_req(r)).status().code(), StatusCode::kProtocolError);
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(Ctl::kLeaseReq), 0, 1, kMaxLeaseReqAux + 1, 0};
  EXPECT_EQ(check_ctl_header(h, CtlSide::kTarget, 1024).code(), StatusCode::kProtocolError);
  EXPECT_EQ(check_ctl_header(h, CtlSide::kTargetPreHello, 1024).code(), StatusCode::kProtocolError);
  h.aux_len = 64;
  EXPECT_TRUE(check_ctl_header(h, CtlSide::kTarget, 1024).ok());
  CtlHdr resp{kCtlMagic, static_cast<uint16_t>(Ctl::kLeaseResp), 0, 1, 0, 15};
  EXPECT_TRUE(check_ctl_header(resp, CtlSide::kInitiator, 1024).ok());
  EXPECT_EQ(check_ctl_header(resp, CtlSide::kTarget, 1024).code(), StatusCode::kProtocolError);
}

}  // namespace
}  // namespace pdkv
