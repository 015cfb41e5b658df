// The inproc example transport (inproc_transport.h says what it shows): start-up and
// shutdown, metadata and reach, prepare, post, notify, drop_peer, and its
// registration: one TransportFactory naming its options type.
#include "transport/example/inproc_transport.h"

#include <unistd.h>

#include <map>
#include <utility>

#include "pdkv/spi/registry.h"
#include "pdkv/spi/transfer_control.h"
#include "util/thread_name.h"

namespace pdkv::inproc {
namespace {

// The live transports of this process, by agent instance id: a peer that is not
// here is dead (its agent closed) or restarted (a new instance id).
std::mutex g_live_mu;
std::map<uint64_t, std::shared_ptr<LiveAgent>> g_live;

}  // namespace

std::shared_ptr<LiveAgent> find_live(uint64_t instance) {
  std::lock_guard<std::mutex> lk(g_live_mu);
  auto it = g_live.find(instance);
  return it == g_live.end() ? nullptr : it->second;
}

Status InprocTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  self_ = std::make_shared<LiveAgent>();
  self_->hooks = hooks;
  th_ = std::thread([this] { copy_loop(); });
  std::lock_guard<std::mutex> lk(g_live_mu);
  g_live[hooks->instance_id()] = self_;
  return Status::Ok();
}

void InprocTransport::shutdown() {
  if (!self_) return;  // never started, or shut down already
  {
    std::lock_guard<std::mutex> lk(g_live_mu);
    g_live.erase(hooks_->instance_id());
  }
  {
    // Waits for a peer's copy into or out of this agent's memory in progress; none
    // starts after (they check `live` under the same lock).
    std::lock_guard<std::mutex> lk(self_->mu);
    self_->live = false;
  }
  std::deque<Job> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  if (th_.joinable()) th_.join();
  for (Job& j : left) spi::TransferControl(j.xfer).resolve_part(0, ConnectionError("agent shutting down"));
  self_.reset();
}

// The process and host: a peer publishing the same is an agent of this process.
std::string InprocTransport::metadata_extra() const { return "pid=" + std::to_string(::getpid()); }

bool InprocTransport::can_reach(const AgentMetadata& peer) const {
  if (peer.host_id != hooks_->host_id()) return false;
  for (const auto& [name, blob] : peer.extras)
    if (name == "inproc") return blob == metadata_extra();
  return false;
}

Result<std::shared_ptr<const PreparedOps>> InprocTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                    std::vector<ResolvedExtent> extents) {
  // The agent has checked every extent against both regions (the peer's as its
  // metadata says); what is left is the transport's own limit.
  if (extents.size() > opts_.max_extents)
    return InvalidArgument("inproc: " + std::to_string(extents.size()) + " extents exceed inproc.max_extents (" +
                           std::to_string(opts_.max_extents) + ")");
  auto p = std::make_shared<InprocPrepared>();
  p->peer = peer->md.name;
  p->instance = peer->md.instance_id;
  p->op = op;
  for (const ResolvedExtent& e : extents) p->bytes += e.bytes();
  p->extents = std::move(extents);  // count == 1 each: caps() takes no strided runs
  p->key = auth::derive_key(peer->secret);  // cached per secret; the secret itself stays here
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

void InprocTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                           std::string notif) {
  spi::TransferControl ctl(xfer);
  ctl.set_parts(1);  // the whole post, notification included, is one part
  auto prep = std::static_pointer_cast<const InprocPrepared>(ops);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      ctl.resolve_part(0, ConnectionError("agent shutting down"));
      return;
    }
    if (queue_.size() >= opts_.max_queued) {
      ctl.resolve_part(0, ResourceExhausted("inproc: " + std::to_string(queue_.size()) +
                                            " posts queued (inproc.max_queued)"));
      return;
    }
    queue_.push_back(Job{std::move(prep), xfer, std::move(notif)});
  }
  cv_.notify_one();
}

void InprocTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer,
                             std::string notif) {
  // The agent declared the one part. Delivered here, in the caller's thread: there
  // is no data it must follow.
  std::shared_ptr<LiveAgent> target = find_live(peer->md.instance_id);
  Status st = target ? Status::Ok() : ConnectionError("peer '" + peer->md.name + "' is gone (its agent closed)");
  if (target) {
    std::lock_guard<std::mutex> lk(target->mu);
    if (!target->live) {
      st = ConnectionError("peer '" + peer->md.name + "' is gone (its agent closed)");
    } else {
      st = target->hooks->deliver_notification(Notification{hooks_->agent_name(), std::move(notif)});
    }
  }
  spi::TransferControl(xfer).resolve_part(0, st);
}

void InprocTransport::drop_peer(const std::string& name) {
  // Nothing is connected; posts to the peer still queued fail (a copy in progress ends).
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->prep->peer == name) {
        dropped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Job& j : dropped)
    spi::TransferControl(j.xfer).resolve_part(0, ConnectionError("peer '" + name + "' was removed"));
}

namespace {

// The registration: a name, what it is, whether it can run here, how to create one
// (create_with checks and validates the options the agent hands over), its priority
// (0: only when named) and its options type.
TransportFactory inproc_factory() {
  TransportFactory f;
  f.name = "inproc";
  f.description = "example: memcpy between agents of one process, on a copy thread (C++)";
  f.viable = [] { return Status::Ok(); };
  f.create = create_with<InprocOptions>(
      [](const AgentConfig&, const InprocOptions& opts) -> Result<std::unique_ptr<Transport>> {
        return std::unique_ptr<Transport>(std::make_unique<InprocTransport>(opts));
      });
  f.priority = 0;
  f.default_options = default_options_of<InprocOptions>;
  return f;
}

bool registered = register_transport(inproc_factory());

}  // namespace
}  // namespace pdkv::inproc
