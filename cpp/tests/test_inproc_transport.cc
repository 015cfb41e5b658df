// The inproc example transport (cpp/src/transport/example) from C++: registered with
// its options type, bytes moved both ways bit-exact on its copy thread, its options
// reaching it through AgentConfig::options (and refused when out of range), a wrong
// secret and a closed peer failing the transfer. tests/test_conformance.py runs the
// common contract against it from Python.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pdkv/agent.h"
#include "pdkv/config.h"
#include "pdkv/spi/registry.h"
#include "transport/example/options.h"

namespace pdkv {
namespace {

using inproc::InprocOptions;

std::unique_ptr<Agent> make(const std::string& name, const std::string& secret = "inproc-secret",
                            uint64_t max_extents = 0) {
  AgentConfig c;
  c.name = name;
  c.secret = secret;
  c.transports = {"inproc"};
  if (max_extents) c.options.edit<InprocOptions>().max_extents = max_extents;
  auto a = Agent::create(c);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return a.ok() ? std::move(a).value() : nullptr;
}

struct Pool {
  explicit Pool(Agent& a, size_t n, bool remote, uint8_t seed) : bytes(n) {
    for (size_t i = 0; i < n; ++i) bytes[i] = seed ? static_cast<uint8_t>(i * 37 + seed + (i >> 11)) : 0;
    auto r = a.register_memory(reinterpret_cast<uint64_t>(bytes.data()), n, MemKind::kHost, -1, remote);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    id = r.ok() ? r->id : 0;
  }
  std::vector<uint8_t> bytes;
  uint64_t id = 0;
};

TEST(InprocTransport, IsRegisteredWithItsOptionsTypeAndOnlyWhenNamed) {
  auto f = find_transport("inproc");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->priority, 0);
  ASSERT_TRUE(f->default_options);
  EXPECT_EQ(f->default_options()->transport(), "inproc");
  for (const auto& t : default_transports()) EXPECT_NE(t, "inproc");
}

TEST(InprocTransport, WritesAndReadsBitExactWithANotificationAfterTheData) {
  auto a = make("a"), b = make("b");
  ASSERT_TRUE(a && b);
  constexpr size_t kN = 1 << 20;
  Pool src(*a, kN, false, 7), back(*a, kN, false, 0), dst(*b, kN, true, 0);
  auto peer = a->add_peer(b->metadata(), "inproc-secret", "inproc");
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto w = a->prepare_extents(*peer, OpKind::kWrite,
                              {Extent{src.id, 0, dst.id, 4096, 65536}, Extent{src.id, 500000, dst.id, 0, 7}}, {});
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  auto x = a->post(**w, "landed", 20);
  ASSERT_TRUE(x.ok());
  ASSERT_EQ((*x)->wait(20), XferState::kDone) << (*x)->error().to_string();
  EXPECT_EQ((*x)->bytes_done(), 65536u + 7u);
  EXPECT_TRUE(std::equal(src.bytes.begin(), src.bytes.begin() + 65536, dst.bytes.begin() + 4096));
  EXPECT_TRUE(std::equal(src.bytes.begin() + 500000, src.bytes.begin() + 500007, dst.bytes.begin()));
  EXPECT_EQ(dst.bytes[7], 0);  // nothing else touched
  auto n = b->notifications().wait(10);
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].peer, "a");
  EXPECT_EQ(n[0].data, "landed");

  auto r = a->prepare_extents(*peer, OpKind::kRead, {Extent{back.id, 0, dst.id, 0, kN}}, {});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto y = a->post(**r, "", 20);
  ASSERT_TRUE(y.ok());
  ASSERT_EQ((*y)->wait(20), XferState::kDone) << (*y)->error().to_string();
  EXPECT_EQ(back.bytes, dst.bytes);
}

TEST(InprocTransport, ItsOptionsReachItAndAreValidated) {
  auto a = make("a", "inproc-secret", /*max_extents=*/2), b = make("b");
  ASSERT_TRUE(a && b);
  Pool src(*a, 4096, false, 1), dst(*b, 4096, true, 0);
  auto peer = a->add_peer(b->metadata(), "inproc-secret", "inproc");
  ASSERT_TRUE(peer.ok());
  std::vector<Extent> three = {Extent{src.id, 0, dst.id, 0, 8}, Extent{src.id, 16, dst.id, 32, 8},
                               Extent{src.id, 64, dst.id, 128, 8}};
  auto refused = a->prepare_extents(*peer, OpKind::kWrite, three, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("inproc.max_extents"), std::string::npos) << refused.status().message();
  three.pop_back();
  EXPECT_TRUE(a->prepare_extents(*peer, OpKind::kWrite, three, {}).ok());

  AgentConfig c;
  c.name = "bad";
  c.transports = {"inproc"};
  c.options.edit<InprocOptions>().max_queued = 0;
  auto bad = Agent::create(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("inproc.max_queued"), std::string::npos) << bad.status().message();
}

TEST(InprocTransport, AWrongSecretOrAClosedPeerFailsTheTransfer) {
  auto a = make("a"), b = make("b", "another-secret");
  ASSERT_TRUE(a && b);
  Pool src(*a, 4096, false, 3), dst(*b, 4096, true, 0);
  auto peer = a->add_peer(b->metadata(), "inproc-secret", "inproc");
  ASSERT_TRUE(peer.ok());
  auto w = a->prepare_extents(*peer, OpKind::kWrite, {Extent{src.id, 0, dst.id, 0, 4096}}, {});
  ASSERT_TRUE(w.ok());
  auto x = a->post(**w, "", 20);
  ASSERT_TRUE(x.ok());
  EXPECT_EQ((*x)->wait(20), XferState::kFailed);
  EXPECT_EQ((*x)->error().code(), StatusCode::kAuthFailed) << (*x)->error().to_string();
  EXPECT_EQ(dst.bytes, std::vector<uint8_t>(4096, 0));

  b.reset();  // the peer's agent closes
  auto y = a->post(**w, "", 20);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ((*y)->wait(20), XferState::kFailed);
  EXPECT_EQ((*y)->error().code(), StatusCode::kConnectionError) << (*y)->error().to_string();
}

}  // namespace
}  // namespace pdkv
