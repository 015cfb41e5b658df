// Several tcp progress threads and connections at once, for ThreadSanitizer: a target
// with 4 progress threads serves three initiators (4 connections each) writing and
// reading back concurrently; every byte is checked. (Issue 11, item 8: the accepting
// thread used to read TcpConn::authed while the owner thread wrote it.)
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "pdkv/agent.h"
#include "pdkv/options/tcp.h"

namespace pdkv {
namespace {

constexpr char kSecret[] = "tsan-secret";
constexpr uint64_t kBytes = 1u << 20;

std::unique_ptr<Agent> make_agent(const std::string& name, uint32_t threads, uint32_t conns) {
  AgentConfig cfg;
  cfg.name = name;
  cfg.secret = kSecret;
  cfg.transports = {"tcp"};
  cfg.options.edit<TcpOptions>().progress_threads = threads;
  cfg.options.edit<TcpOptions>().conns_per_peer = conns;
  cfg.options.edit<TcpOptions>().batch_bytes = 64 << 10;  // many batches, spread over the connections
  auto a = Agent::create(cfg);
  EXPECT_TRUE(a.ok()) << a.status().to_string();
  return a.ok() ? std::move(a).value() : nullptr;
}

TEST(TcpThreads, ConcurrentInitiatorsOnSeveralProgressThreads) {
  auto target = make_agent("target", 4, 1);
  ASSERT_TRUE(target);
  const std::string address = target->endpoints().at(0).address;
  constexpr int kInitiators = 3;
  std::vector<std::vector<uint8_t>> dst(kInitiators, std::vector<uint8_t>(kBytes));
  std::vector<uint64_t> dst_ids;
  for (auto& d : dst) {
    auto r = target->register_memory(reinterpret_cast<uint64_t>(d.data()), d.size(), MemKind::kHost, -1, true);
    ASSERT_TRUE(r.ok());
    dst_ids.push_back(r->id);
  }
  std::vector<std::thread> workers;
  std::vector<int> ok(kInitiators, 0);
  for (int i = 0; i < kInitiators; ++i) {
    workers.emplace_back([&, i] {
      auto a = make_agent("init" + std::to_string(i), 2, 4);
      if (!a) return;
      std::vector<uint8_t> src(kBytes), back(kBytes);
      for (uint64_t k = 0; k < kBytes; ++k) src[k] = static_cast<uint8_t>(k * 31 + i);
      auto rs = a->register_memory(reinterpret_cast<uint64_t>(src.data()), kBytes, MemKind::kHost, -1, false);
      auto rb = a->register_memory(reinterpret_cast<uint64_t>(back.data()), kBytes, MemKind::kHost, -1, false);
      auto blob = a->fetch_metadata(address, kSecret, 10);
      if (!rs.ok() || !rb.ok() || !blob.ok()) return;
      auto peer = a->add_peer(*blob, kSecret, "");
      if (!peer.ok() || !a->connect(*peer, 10).ok()) return;
      for (int round = 0; round < 3; ++round) {
        auto w = a->prepare_extents(*peer, OpKind::kWrite, {Extent{rs->id, 0, dst_ids[i], 0, kBytes}}, {});
        if (!w.ok()) return;
        auto x = a->post(**w, "", 30);
        if (!x.ok() || (*x)->wait(30) != XferState::kDone) return;
        auto r = a->prepare_extents(*peer, OpKind::kRead, {Extent{rb->id, 0, dst_ids[i], 0, kBytes}}, {});
        if (!r.ok()) return;
        auto y = a->post(**r, "", 30);
        if (!y.ok() || (*y)->wait(30) != XferState::kDone) return;
        if (back != src) return;
      }
      ok[i] = 1;
    });
  }
  for (auto& w : workers) w.join();
  for (int i = 0; i < kInitiators; ++i) EXPECT_EQ(ok[i], 1) << "initiator " << i;
}

}  // namespace
}  // namespace pdkv
