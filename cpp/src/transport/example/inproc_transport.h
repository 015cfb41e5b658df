// InprocTransport: the C++ example transport, `inproc`. It moves bytes with memcpy
// between agents of one process, on a copy thread of its own, so it needs no network
// and no library and shows every duty of a native transport in a few pages:
// capabilities, what it publishes in metadata, which peers it reaches, preparing once
// and posting many times, completing a transfer asynchronously (part, deadline,
// cancel), proving the peer's secret, checking every inbound access against what the
// target exports now (RegionTable::pin, which also makes the target's deregistration
// wait for the copy), delivering notifications after the data, failing transfers to
// a dead or dropped peer, and failing what is queued at shutdown.
//
// It has the shape of every transport folder (docs/architecture.md, "One shape per
// transport folder"), less what a transport with connections needs:
//   inproc_transport.h   this class, the prepared transfer and a queued post
//   inproc_transport.cc  start/shutdown, metadata, prepare, post, notify, drop_peer,
//                        and the registration (factory + options type)
//   progress.cc          the copy thread: one queued post at a time, into or out of
//                        the target agent's memory
//   options.h/.cc        InprocOptions and its validate()
// (no conn/handshake/wire: the peers are objects of this process, found by instance
// id in a table of the live ones; the Python example beside it is `loopback`,
// python/pdkv/backends/example.py). Registered with priority 0: only agents that
// name it use it (transports=["inproc"]). The conformance suite
// (tests/test_conformance.py) runs against it like against tcp and shm, and
// docs/writing-a-transport.md uses it as the worked example.
//
// Thread safety: the Transport methods as pdkv/spi/transport.h says. mu_ guards the
// queue; each agent's LiveAgent::mu serializes the copies into or out of its memory
// with its shutdown.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pdkv/spi/auth.h"
#include "pdkv/spi/transport.h"
#include "transport/example/options.h"

namespace pdkv::inproc {

// One live agent's transport as its peers see it. Listed (by instance id) from start()
// to shutdown(); `hooks` may be used only with `mu` held and `live` true.
struct LiveAgent {
  std::mutex mu;
  bool live = true;
  AgentHooks* hooks = nullptr;
};

// The live transport of agent instance `instance`, or null (never started, or closed).
std::shared_ptr<LiveAgent> find_live(uint64_t instance);

// What prepare() built once and every post() reuses: the peer, the direction, the
// extents as the agent resolved and checked them against the peer's metadata, and the
// key of the secret we hold for the peer (the target checks it on every post).
struct InprocPrepared final : PreparedOps {
  std::string peer;
  uint64_t instance = 0;
  OpKind op = OpKind::kWrite;
  std::vector<ResolvedExtent> extents;
  uint64_t bytes = 0;
  auth::Key key;
};

// A post waiting for the copy thread.
struct Job {
  std::shared_ptr<const InprocPrepared> prep;
  std::shared_ptr<Transfer> xfer;
  std::string notif;
};

class InprocTransport final : public Transport {
 public:
  explicit InprocTransport(InprocOptions opts) : opts_(std::move(opts)) {}
  ~InprocTransport() override { shutdown(); }

  std::string_view name() const override { return "inproc"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.cross_host = false;
    c.local_mem_kinds = mem_kind_bit(MemKind::kHost);
    c.remote_mem_kinds = mem_kind_bit(MemKind::kHost);
    c.direct_small_extents = true;  // a memcpy per extent: no need to stage small ones
    return c;
  }
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override { return {}; }
  std::string metadata_extra() const override;
  bool can_reach(const AgentMetadata& peer) const override;
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override;
  void drop_peer(const std::string& name) override;

 private:
  // progress.cc: the copy thread, and one post's copies.
  void copy_loop();
  Status run(const Job& job);

  const InprocOptions opts_;
  AgentHooks* hooks_ = nullptr;
  std::shared_ptr<LiveAgent> self_;  // what peers find in the table of live endpoints
  std::thread th_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;      // guarded by mu_
  std::deque<Job> queue_;  // guarded by mu_
};

}  // namespace pdkv::inproc
