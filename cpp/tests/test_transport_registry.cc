// The transport registry and the agent's side of the transport interface, with a mock
// transport registered at run time (one registration, as any transport): priorities
// and the default order, metadata_via, region_added/region_removed, and metadata
// fetched through a transport that serves it.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pdkv/agent.h"
#include "pdkv/spi/registry.h"

namespace pdkv {
namespace {

struct MockCounters {
  std::atomic<int> added{0};
  std::atomic<int> removed{0};
  std::atomic<bool> refuse_regions{false};
};
MockCounters& counters() {
  static MockCounters c;
  return c;
}

// Reaches nobody; records the region hooks.
class MockTransport final : public Transport {
 public:
  std::string_view name() const override { return "mock"; }
  TransportCaps caps() const override { return TransportCaps{}; }
  Status start(AgentHooks*) override { return Status::Ok(); }
  void shutdown() override {}
  std::vector<Endpoint> endpoints() const override { return {}; }
  bool can_reach(const AgentMetadata&) const override { return false; }
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer>, OpKind,
                                                     std::vector<ResolvedExtent>) override {
    return NotSupported("mock moves nothing");
  }
  void post(const std::shared_ptr<const PreparedOps>&, const std::shared_ptr<Transfer>& x, std::string) override {
    spi::TransferControl(x).fail_now(NotSupported("mock moves nothing"));
  }
  void notify(std::shared_ptr<const Peer>, const std::shared_ptr<Transfer>& x, std::string) override {
    spi::TransferControl(x).resolve_part(0, NotSupported("mock moves nothing"));
  }
  void drop_peer(const std::string&) override {}
  Status region_added(const RegionDesc&) override {
    if (counters().refuse_regions) return ResourceExhausted("mock cannot register memory");
    ++counters().added;
    return Status::Ok();
  }
  void region_removed(const RegionDesc&) override { ++counters().removed; }
};

void register_mock_once() {
  static bool done = register_transport(TransportFactory{
      "mock", "test double", [] { return Status::Ok(); },
      [](const AgentConfig&, const TransportOptions*) -> Result<std::unique_ptr<Transport>> {
        return std::unique_ptr<Transport>(std::make_unique<MockTransport>());
      },
      /*priority=*/0, /*host_priority=*/nullptr, /*metadata_via=*/"tcp"});
  ASSERT_TRUE(done);
}

std::unique_ptr<Agent> agent(std::vector<std::string> transports) {
  AgentConfig cfg;
  cfg.name = "a";
  cfg.transports = std::move(transports);
  auto r = Agent::create(cfg);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

TEST(Registry, DefaultOrderIsViableTransportsByPriority) {
  register_mock_once();
  const auto order = default_transports();
  std::vector<std::string> native;
  for (const auto& t : order)
    if (t == "shm" || t == "tcp" || t == "cuda_ipc") native.push_back(t);
  std::vector<std::string> expect;
  for (const char* t : {"cuda_ipc", "shm", "tcp"})
    for (const auto& a : available_transports())
      if (a == t) expect.push_back(t);
  EXPECT_EQ(native, expect);
  for (const auto& t : order) EXPECT_NE(t, "mock");  // priority 0: only when named
  EXPECT_FALSE(register_transport(TransportFactory{"mock", "again", nullptr, nullptr}));  // first one stays
}

TEST(Registry, HostPriorityReplacesThePriority) {
  static std::atomic<int> priority{0};
  ASSERT_TRUE(register_transport(TransportFactory{
      "mock-host", "test double", [] { return Status::Ok(); }, nullptr, 0, [] { return priority.load(); }}));
  auto has = [] {
    for (const auto& t : default_transports())
      if (t == "mock-host") return true;
    return false;
  };
  EXPECT_FALSE(has());
  priority = 1000;
  ASSERT_TRUE(has());
  EXPECT_EQ(default_transports().front(), "mock-host");
  priority = 0;
}

TEST(AgentTransports, MetadataViaBringsItsTransportAndServesFetches) {
  register_mock_once();
  auto a = agent({"mock"});
  ASSERT_TRUE(a);
  EXPECT_EQ(a->transports(), (std::vector<std::string>{"mock", "tcp"}));
  // Fetched through tcp (serves_metadata), the only one that can.
  auto b = agent({"tcp"});
  ASSERT_TRUE(b);
  std::string address;
  for (auto& e : b->endpoints())
    if (e.transport == "tcp") address = e.address;
  auto blob = a->fetch_metadata(address, b->secret(), 5.0);
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto shm_only = Agent::create([] {
    AgentConfig c;
    c.name = "s";
    c.transports = {"shm"};
    return c;
  }());
  if (shm_only.ok()) {  // (shm is viable on Linux; no tcp is added for native-only lists)
    EXPECT_EQ((*shm_only)->transports(), std::vector<std::string>{"shm"});
    EXPECT_EQ((*shm_only)->fetch_metadata(address, "", 1.0).status().code(), StatusCode::kNotSupported);
  }
}

TEST(AgentTransports, RegionHooksSeeEveryRegionAndARefusalUndoesIt) {
  register_mock_once();
  auto a = agent({"mock"});
  ASSERT_TRUE(a);
  std::vector<char> mem(4096);
  const int added = counters().added, removed = counters().removed;
  auto local = a->register_memory(reinterpret_cast<uint64_t>(mem.data()), 1024, MemKind::kHost, -1, false);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(counters().added, added + 1);
  ASSERT_TRUE(a->deregister_memory(local->id).ok());
  EXPECT_EQ(counters().removed, removed + 1);  // local-only regions too
  counters().refuse_regions = true;
  auto refused = a->register_memory(reinterpret_cast<uint64_t>(mem.data()), 1024, MemKind::kHost, -1, true);
  counters().refuse_regions = false;
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(a->regions().empty());  // undone: the same range registers again
  EXPECT_TRUE(a->register_memory(reinterpret_cast<uint64_t>(mem.data()), 1024, MemKind::kHost, -1, true).ok());
}

TEST(AgentTransports, ViaHostFixesEveryUnreachableNetworkEndpoint) {
  auto a = agent({"tcp"});
  ASSERT_TRUE(a);
  AgentMetadata md;
  md.name = "far";
  md.instance_id = 7;
  md.host_id = "other-host";
  md.endpoints = {Endpoint{"tcp", "0.0.0.0:1234"}, Endpoint{"mine", "127.0.0.1:99"}, Endpoint{"shm", "/tmp/x.sock"},
                  Endpoint{"tcp", "10.9.9.9:5"}};
  auto name = a->add_peer(encode_metadata(md), "", "", "10.1.2.3");
  ASSERT_TRUE(name.ok()) << name.status().to_string();
  auto p = a->peer(*name);
  ASSERT_TRUE(p.ok());
  std::vector<std::string> got;
  for (auto& e : (*p)->md.endpoints) got.push_back(e.address);
  EXPECT_EQ(got, (std::vector<std::string>{"10.1.2.3:1234", "10.1.2.3:99", "/tmp/x.sock", "10.9.9.9:5"}));
}

}  // namespace
}  // namespace pdkv
