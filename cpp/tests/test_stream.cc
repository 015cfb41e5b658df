// Layer-wise streaming writes (pdkv/stream.h) between two tcp agents in one process:
// bytes bit-exact when the notification arrives, batching, each-layer-once rules,
// cancel, the stream's deadline, and a stream that outlives its agent. Also run under
// the sanitizers (the pump thread, completion callbacks and callers race by design).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pdkv/agent.h"

namespace pdkv {
namespace {

constexpr char kSecret[] = "stream-secret";

KVGeometry geometry() {
  KVGeometry g;
  g.num_layers = 6;
  g.num_blocks = 8;
  g.block_tokens = 4;
  g.kv_heads = 2;
  g.head_dim = 16;
  g.dtype = DType::kF32;
  return g;
}

// An agent with one contiguous pool "kv" (filled with `seed`-derived bytes, or zeros).
struct Side {
  std::unique_ptr<Agent> agent;
  std::vector<uint8_t> pool;

  Side(const std::string& name, int seed) : pool(KVLayout::contiguous_bytes(geometry())) {
    AgentConfig cfg;
    cfg.name = name;
    cfg.secret = kSecret;
    cfg.transports = {"tcp"};
    auto a = Agent::create(cfg);
    EXPECT_TRUE(a.ok()) << a.status().to_string();
    agent = std::move(a).value();
    for (size_t i = 0; i < pool.size(); ++i) pool[i] = seed ? static_cast<uint8_t>(i * 131 + seed) : 0;
    auto r = agent->register_memory(reinterpret_cast<uint64_t>(pool.data()), pool.size(), MemKind::kHost, -1, true);
    EXPECT_TRUE(r.ok());
    auto l = KVLayout::contiguous(geometry(), reinterpret_cast<uint64_t>(pool.data()), false);
    EXPECT_TRUE(l.ok());
    EXPECT_TRUE(agent->add_layout("kv", *l).ok());
  }

  // Bytes of block `id`, layer `layer`, both parts.
  std::vector<uint8_t> block(uint32_t layer, uint32_t id) const {
    const KVGeometry g = geometry();
    const uint64_t half = g.block_half_bytes();
    std::vector<uint8_t> out;
    for (uint32_t part = 0; part < 2; ++part) {
      const uint64_t off = ((uint64_t(layer) * 2 + part) * g.num_blocks + id) * half;
      out.insert(out.end(), pool.begin() + off, pool.begin() + off + half);
    }
    return out;
  }
};

const std::vector<uint32_t> kSrc = {0, 1, 5};
const std::vector<uint32_t> kDst = {7, 2, 3};

bool landed(const Side& a, const Side& b, uint32_t layer) {
  for (size_t i = 0; i < kSrc.size(); ++i)
    if (a.block(layer, kSrc[i]) != b.block(layer, kDst[i])) return false;
  return true;
}

class StreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a = std::make_unique<Side>("a", 3);
    b = std::make_unique<Side>("b", 0);
    auto p = a->agent->add_peer(b->agent->metadata(), kSecret, "");
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    peer = *p;
  }
  std::shared_ptr<StreamingWrite> open(std::string notif, double timeout_s = 20, StreamOptions so = {}) {
    auto s = a->agent->open_stream(peer, {"kv", kSrc}, {"kv", kDst}, {}, {}, std::move(notif), timeout_s, so);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? *s : nullptr;
  }
  std::unique_ptr<Side> a, b;
  std::string peer;
};

TEST_F(StreamTest, OutOfOrderLayersLandBeforeTheNotification) {
  auto s = open("done");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->num_layers(), 6u);
  EXPECT_EQ(s->transfer()->bytes_total(), s->layer_bytes() * 6);
  for (uint32_t l : {3u, 0u, 5u, 1u, 4u, 2u}) ASSERT_TRUE(s->post_layers(l, 1).ok());
  ASSERT_TRUE(s->close().ok());
  auto n = b->agent->notifications().wait(20, 1);
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].data, "done");
  for (uint32_t l = 0; l < 6; ++l) EXPECT_TRUE(landed(*a, *b, l)) << "layer " << l;
  EXPECT_EQ(s->transfer()->wait(20), XferState::kDone);
  EXPECT_EQ(s->transfer()->bytes_done(), s->transfer()->bytes_total());
}

TEST_F(StreamTest, MinBatchBytesGroupsAdjacentLayers) {
  auto probe = open("");
  ASSERT_TRUE(probe);
  StreamOptions so;
  so.min_batch_bytes = 3 * probe->layer_bytes();
  probe->cancel();
  auto s = open("grouped", 20, so);
  ASSERT_TRUE(s);
  for (uint32_t l = 0; l < 6; ++l) ASSERT_TRUE(s->post_layers(l, 1).ok());
  ASSERT_TRUE(s->close().ok());
  EXPECT_EQ(s->transfer()->wait(20), XferState::kDone);
  EXPECT_EQ(s->batches_posted(), 2u);
  for (uint32_t l = 0; l < 6; ++l) EXPECT_TRUE(landed(*a, *b, l));
}

TEST_F(StreamTest, EachLayerExactlyOnce) {
  auto s = open("once");
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->post_layers(1, 2).ok());
  EXPECT_EQ(s->post_layers(2, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->post_layers(0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->post_layers(5, 2).code(), StatusCode::kOutOfRange);
  Status missing = s->close();
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("layers 0, 3-5"), std::string::npos) << missing.message();
  ASSERT_TRUE(s->post_layers(0, 1).ok());
  ASSERT_TRUE(s->post_layers(3, 3).ok());
  ASSERT_TRUE(s->close().ok());
  EXPECT_EQ(s->close().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->transfer()->wait(20), XferState::kDone);
}

TEST_F(StreamTest, CancelFailsLaterCallsAndSendsNothing) {
  auto s = open("never");
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->post_layers(0, 2).ok());
  s->cancel();
  EXPECT_EQ(s->transfer()->wait(20), XferState::kCancelled);
  EXPECT_EQ(s->post_layers(2, 1).code(), StatusCode::kCancelled);
  EXPECT_EQ(s->close().code(), StatusCode::kCancelled);
  auto after = a->agent->send_notification(peer, "after", 20);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)->wait(20), XferState::kDone);
  auto n = b->agent->notifications().wait(20, 1);
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].data, "after");
}

TEST_F(StreamTest, OneDeadlineForTheWholeStream) {
  auto s = open("late", 0.3);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->post_layers(0, 1).ok());
  EXPECT_EQ(s->transfer()->wait(20), XferState::kFailed);
  EXPECT_EQ(s->transfer()->error().code(), StatusCode::kTimeout);
  EXPECT_EQ(s->post_layers(1, 1).code(), StatusCode::kTimeout);
}

TEST_F(StreamTest, AStreamOutlivingItsAgentFailsWithoutTouchingIt) {
  auto s = open("orphan");
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->post_layers(0, 1).ok());
  std::shared_ptr<Transfer> x = s->transfer();
  a->agent.reset();
  EXPECT_NE(x->wait(20), XferState::kPending);
  EXPECT_FALSE(s->post_layers(1, 1).ok());
  EXPECT_FALSE(s->close().ok());
}

TEST_F(StreamTest, ConcurrentPostersAndCancel) {
  for (int round = 0; round < 20; ++round) {
    auto s = open("r");
    ASSERT_TRUE(s);
    std::thread t1([&] { for (uint32_t l = 0; l < 6; l += 2) (void)s->post_layers(l, 1); });
    std::thread t2([&] { for (uint32_t l = 1; l < 6; l += 2) (void)s->post_layers(l, 1); });
    if (round % 2) s->cancel();
    t1.join();
    t2.join();
    (void)s->close();
    const XferState st = s->transfer()->wait(20);
    EXPECT_TRUE(st == XferState::kDone || st == XferState::kCancelled);
  }
}

// The block-selection struct: the remote side's generations are checked at every post
// (a bumped block fails the transfer with StaleBlock and nothing lands); generations on
// the local side, or not one per block, and a stream that may never send are refused.
TEST_F(StreamTest, BlocksCarryTheRemoteGenerationsAndOptionsValidate) {
  auto gens = b->agent->generations("kv", kDst);
  ASSERT_TRUE(gens.ok());
  auto fresh = a->agent->prepare_blocks(peer, OpKind::kWrite, {"kv", kSrc}, {"kv", kDst, *gens});
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  EXPECT_TRUE((*fresh)->checked);
  auto x = a->agent->post(**fresh, "", 20);
  ASSERT_TRUE(x.ok());
  EXPECT_EQ((*x)->wait(20), XferState::kDone);
  for (uint32_t l = 0; l < 6; ++l) EXPECT_TRUE(landed(*a, *b, l));

  ASSERT_TRUE(b->agent->bump_generations("kv", {kDst[1]}, 5).ok());
  std::fill(b->pool.begin(), b->pool.end(), 0);
  auto stale = a->agent->post(**fresh, "never", 20);
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ((*stale)->wait(20), XferState::kFailed);
  EXPECT_EQ((*stale)->error().code(), StatusCode::kStaleBlock);
  EXPECT_TRUE(std::all_of(b->pool.begin(), b->pool.end(), [](uint8_t v) { return v == 0; }));

  auto local_gens = a->agent->prepare_blocks(peer, OpKind::kWrite, {"kv", kSrc, {1, 1, 1}}, {"kv", kDst});
  EXPECT_EQ(local_gens.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(local_gens.status().message().find("remote blocks"), std::string::npos);
  auto short_gens = a->agent->prepare_blocks(peer, OpKind::kWrite, {"kv", kSrc}, {"kv", kDst, {1, 1}});
  EXPECT_EQ(short_gens.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_gens.status().message().find("2 entries for 3 blocks"), std::string::npos);

  StreamOptions none_inflight;
  none_inflight.max_inflight_batches = 0;
  EXPECT_EQ(none_inflight.validate().code(), StatusCode::kInvalidArgument);
  auto s = a->agent->open_stream(peer, {"kv", kSrc}, {"kv", kDst}, {}, {}, "", 20, none_inflight);
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("max_inflight_batches"), std::string::npos);
}

}  // namespace
}  // namespace pdkv
