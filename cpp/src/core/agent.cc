// The public Agent API (each call forwards to Agent::Impl, core/agent_impl.h) and the
// Impl's lifetime, memory, layouts and peers; the transfer path is agent_transfer.cc.
#include "pdkv/agent.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>

#include "core/agent_impl.h"
#include "core/stream_pump.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/registry.h"
#include "pdkv/spi/transfer_control.h"
#include "pdkv/spi/transport.h"
#include "util/bench_switches.h"
#include "util/log.h"
#include "util/socket.h"

namespace pdkv {
namespace {

// The same transports at the same addresses, in the same order.
bool same_endpoints(const AgentMetadata& a, const AgentMetadata& b) {
  if (a.endpoints.size() != b.endpoints.size()) return false;
  for (size_t i = 0; i < a.endpoints.size(); ++i)
    if (a.endpoints[i].transport != b.endpoints[i].transport || a.endpoints[i].address != b.endpoints[i].address)
      return false;
  return true;
}

std::string random_hex(size_t bytes) {
  std::random_device rd;
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < bytes; ++i) {
    unsigned v = rd() & 0xff;
    s += hex[v >> 4];
    s += hex[v & 15];
  }
  return s;
}

uint64_t random_u64() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t(rd()) << 32) ^ rd();
  return v;
}

std::string read_host_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return std::string("host:") + host;
}

// Appends the transports that the listed ones exchange metadata through
// (TransportFactory::metadata_via) when they are not listed.
void add_metadata_channels(std::vector<std::string>& names) {
  for (size_t i = 0; i < names.size(); ++i) {
    std::optional<TransportFactory> f = find_transport(names[i]);
    if (!f || f->metadata_via.empty()) continue;
    if (std::find(names.begin(), names.end(), f->metadata_via) == names.end()) names.push_back(f->metadata_via);
  }
}

}  // namespace

// ---- Agent: the public API, forwarding to Impl ----

Agent::Agent(AgentConfig cfg) : impl_(std::make_unique<Impl>(std::move(cfg))) {}
Agent::~Agent() = default;

Status Blocks::validate() const {
  if (!generations.empty() && generations.size() != ids.size())
    return InvalidArgument("Blocks.generations has " + std::to_string(generations.size()) + " entries for " +
                           std::to_string(ids.size()) + " blocks (one per block)");
  return Status::Ok();
}

Result<std::unique_ptr<Agent>> Agent::create(AgentConfig cfg) {
  PDKV_RETURN_IF_ERROR(validate_name("agent name", cfg.name));
  PDKV_RETURN_IF_ERROR(cfg.validate());
  for (const TransportOptions* o : cfg.options.all()) {
    const std::string t(o->transport());
    std::optional<TransportFactory> f = find_transport(t);
    if (!f) return InvalidArgument("options for transport '" + t + "', which is not registered");
    if (!f->default_options) return InvalidArgument("transport '" + t + "' takes no options");
  }
  (void)util::bench_switch_values();  // read once, here, never on a transfer's path
  if (cfg.secret.empty()) cfg.secret = random_hex(16);
  std::unique_ptr<Agent> a(new Agent(std::move(cfg)));
  PDKV_RETURN_IF_ERROR(a->impl_->start());
  return a;
}

const std::string& Agent::name() const { return impl_->agent_name(); }
const std::string& Agent::secret() const { return impl_->agent_secret(); }
uint64_t Agent::instance_id() const { return impl_->instance_id(); }
const std::string& Agent::host_id() const { return impl_->host_id(); }
const AgentConfig& Agent::config() const { return impl_->config(); }
std::vector<std::string> Agent::transports() const { return impl_->transports(); }
std::vector<Endpoint> Agent::endpoints() const { return impl_->endpoints(); }

Result<RegionDesc> Agent::register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                          bool remote_access, int shm_fd) {
  return impl_->register_memory(addr, len, kind, device, remote_access, shm_fd);
}
Status Agent::deregister_memory(uint64_t id) { return impl_->deregister_memory(id); }
std::vector<RegionDesc> Agent::regions() const { return impl_->regions(); }

Status Agent::add_layout(const std::string& name, KVLayout layout) {
  return impl_->add_layout(name, std::move(layout));
}
Status Agent::remove_layout(const std::string& name) { return impl_->remove_layout(name); }
Result<KVLayout> Agent::layout(const std::string& name) const { return impl_->layout(name); }
std::vector<std::string> Agent::layout_names() const { return impl_->layout_names(); }

Result<std::vector<uint32_t>> Agent::generations(const std::string& layout, const std::vector<uint32_t>& ids) const {
  return impl_->gens().get(layout, ids);
}
Result<std::vector<uint32_t>> Agent::bump_generations(const std::string& layout, const std::vector<uint32_t>& ids,
                                                      double timeout_s) {
  return impl_->gens().bump(layout, ids, timeout_s);
}

std::string Agent::metadata() { return impl_->metadata(); }
Result<std::string> Agent::add_peer(std::string_view blob, std::string secret, std::string transport,
                                    std::string via_host) {
  return impl_->add_peer(blob, std::move(secret), std::move(transport), std::move(via_host));
}
Status Agent::remove_peer(const std::string& name) { return impl_->remove_peer(name); }
std::vector<std::string> Agent::peer_names() const { return impl_->peer_names(); }
Result<std::shared_ptr<const Peer>> Agent::peer(const std::string& name) const { return impl_->peer(name); }
Result<std::string> Agent::peer_transport(const std::string& name) const { return impl_->peer_transport(name); }
Result<std::string> Agent::fetch_metadata(const std::string& address, std::string secret, double timeout_s) {
  return impl_->fetch_metadata(address, std::move(secret), timeout_s);
}
Status Agent::connect(const std::string& name, double timeout_s) { return impl_->connect(name, timeout_s); }

Result<std::shared_ptr<PreparedTransfer>> Agent::prepare_blocks(const std::string& peer, OpKind op,
                                                                const Blocks& local, const Blocks& remote,
                                                                const PlanOptions& plan, const XferOptions& opts) {
  return impl_->prepare_blocks(peer, op, local, remote, plan, opts);
}
Result<std::shared_ptr<PreparedTransfer>> Agent::prepare_extents(const std::string& peer, OpKind op,
                                                                 const std::vector<Extent>& extents,
                                                                 const XferOptions& opts) {
  return impl_->prepare_extents(peer, op, extents, opts);
}
Result<std::shared_ptr<Transfer>> Agent::post(const PreparedTransfer& prep, std::string notif, double timeout_s) {
  return impl_->post(prep, std::move(notif), timeout_s);
}
Result<std::shared_ptr<Transfer>> Agent::send_notification(const std::string& peer, std::string notif,
                                                           double timeout_s) {
  return impl_->send_notification(peer, std::move(notif), timeout_s);
}

Result<std::shared_ptr<StreamingWrite>> Agent::open_stream(const std::string& peer, const Blocks& local,
                                                           const Blocks& remote, const PlanOptions& plan,
                                                           const XferOptions& opts, std::string notif, double timeout_s,
                                                           const StreamOptions& stream_opts) {
  StreamSpec spec{peer, local, remote, plan, opts, std::move(notif), timeout_s, stream_opts};
  return open_streaming_write(*this, impl_->stream_pump(this), impl_->next_transfer_id(), std::move(spec));
}

NotifQueue& Agent::notifications() { return impl_->notifications(); }
uint64_t Agent::notifications_unacknowledged() const { return impl_->notifications_unacknowledged(); }

// ---- Agent::Impl ----

Status Agent::Impl::start() {
  instance_id_ = random_u64();
  host_id_ = read_host_id();
  add_metadata_channels(cfg_.transports);
  for (const auto& tname : cfg_.transports) {
    std::optional<TransportFactory> f = find_transport(tname);
    if (!f) {
      std::string known;
      for (auto& n : registered_transports()) known += (known.empty() ? "" : ", ") + n;
      return NotFound("unknown transport '" + tname + "' (registered: " + known + ")");
    }
    if (Status v = f->viable(); !v.ok())
      return NotSupported("transport '" + tname + "' (" + f->description + ") cannot run on this host: " + v.message());
    if (transport_by_name(tname)) return InvalidArgument("transport '" + tname + "' listed twice");
    // Its own options (the config's, else its defaults); no other transport's.
    const TransportOptions* opts = cfg_.options.find(tname);
    std::unique_ptr<TransportOptions> defaults;
    if (opts == nullptr && f->default_options) {
      defaults = f->default_options();
      opts = defaults.get();
    }
    PDKV_ASSIGN_OR_RETURN(auto t, f->create(cfg_, opts));
    transports_.push_back(std::move(t));
  }
  // Started only once the list is complete: a started transport's threads may answer a
  // peer at once (a metadata request reads endpoints() and metadata()), and those read
  // only the transports started so far, never a vector still growing.
  for (auto& t : transports_) {
    PDKV_RETURN_IF_ERROR(t->start(this).with_context("starting transport '" + std::string(t->name()) + "'"));
    started_.fetch_add(1, std::memory_order_acq_rel);
  }
  PDKV_LOG_INFO("agent '%s' started (transports: %zu)", cfg_.name.c_str(), transports_.size());
  return Status::Ok();
}

Agent::Impl::~Impl() {
  notifs_.close();
  std::shared_ptr<StreamPump> pump;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pump = pump_;
  }
  // Streams fail and stop calling the agent before the transports go.
  if (pump) pump->detach_agent(ConnectionError("agent '" + cfg_.name + "' is shutting down"));
  // Only started transports are shut down; the rest were never running.
  const size_t started = started_.load(std::memory_order_acquire);
  for (size_t i = 0; i < started; ++i) transports_[i]->shutdown();
  transports_.clear();
  if (pump) pump->join();  // every batch is terminal now: settle the streams, end the thread
}

std::shared_ptr<StreamPump> Agent::Impl::stream_pump(Agent* self) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!pump_) pump_ = std::make_shared<StreamPump>(self);
  return pump_;
}

std::vector<std::string> Agent::Impl::transports() const {
  std::vector<std::string> out;
  for (auto& t : transports_) out.emplace_back(t->name());
  return out;
}

std::vector<Endpoint> Agent::Impl::endpoints() const {
  std::vector<Endpoint> out;
  const size_t started = started_.load(std::memory_order_acquire);
  for (size_t i = 0; i < started; ++i)
    for (auto& e : transports_[i]->endpoints()) out.push_back(e);
  return out;
}

Transport* Agent::Impl::transport_by_name(std::string_view name) const {
  for (auto& t : transports_)
    if (t->name() == name) return t.get();
  return nullptr;
}

Result<Agent::Impl::PeerEntry> Agent::Impl::route(const std::string& peer_name, const XferOptions& opts) const {
  PeerEntry e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(peer_name);
    if (it == peers_.end()) return NotFound("no peer named '" + peer_name + "'; add it with add_peer() first");
    e = it->second;
  }
  if (!opts.transport.empty()) {
    e.transport = transport_by_name(opts.transport);
    if (!e.transport) return NotFound("transport '" + opts.transport + "' is not enabled on this agent");
    if (!e.transport->can_reach(e.peer->md))
      return NotSupported("transport '" + opts.transport + "' cannot reach peer '" + peer_name + "'");
  }
  return e;
}

Result<RegionDesc> Agent::Impl::register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                          bool remote_access, int shm_fd) {
  // Engine pages become shareable only when a transport can use that.
  uint64_t share_min = 0;
  for (const auto& t : transports_)
    if (const uint64_t m = t->share_pages_min_bytes(); m > 0) share_min = share_min == 0 ? m : std::min(share_min, m);
  PDKV_ASSIGN_OR_RETURN(RegionDesc d, regions_.add(addr, len, kind, device, remote_access, shm_fd, share_min));
  for (size_t i = 0; i < transports_.size(); ++i) {
    Status st = transports_[i]->region_added(d);
    if (st.ok()) continue;
    for (size_t j = 0; j < i; ++j) transports_[j]->region_removed(d);
    (void)regions_.take(d.id);
    return st.with_context("registering memory with transport '" + std::string(transports_[i]->name()) + "'");
  }
  return d;
}

Status Agent::Impl::deregister_memory(uint64_t id) {
  PDKV_ASSIGN_OR_RETURN(RegionDesc d, regions_.get(id));
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = layouts_.begin(); it != layouts_.end();) {
      bool uses = std::any_of(it->second.segments().begin(), it->second.segments().end(),
                              [id](const KVSegment& s) { return s.region_id == id; });
      if (uses) gens_.remove_layout(it->first);
      it = uses ? layouts_.erase(it) : std::next(it);
    }
  }
  PDKV_ASSIGN_OR_RETURN(auto entry, regions_.take(id));
  // Peers with direct access (shm mappings, cross-memory attach) stop using it, and
  // transports that registered it with their library (region_added) release it.
  for (auto& t : transports_) t->region_removed(d);
  RegionTable::wait_unpinned(entry);
  // Only now (no transfer writes it any more) can shared engine pages go back private.
  return entry->unshare_pages();
}

Status Agent::Impl::add_layout(const std::string& name, KVLayout layout) {
  PDKV_RETURN_IF_ERROR(validate_name("layout name", name));
  const KVGeometry& g = layout.geometry();
  PDKV_RETURN_IF_ERROR(g.validate());
  auto& segs = layout.mutable_segments();
  for (size_t i = 0; i < segs.size(); ++i) {
    auto& s = segs[i];
    auto r = regions_.find(s.addr, layout.segment_span(s));
    if (!r.ok())
      return NotFound("layout '" + name + "' segment " + std::to_string(i) + " (layer " +
                      std::to_string(i / g.kv_parts) + (g.kv_parts == 2 ? (i % 2 ? ", V" : ", K") : "") +
                      ") is not inside registered memory: " + r.status().message() + "; register the pool first");
    s.region_id = r->id;
    s.region_offset = s.addr - r->addr;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (layouts_.count(name)) return AlreadyExists("a layout named '" + name + "' already exists");
  PDKV_RETURN_IF_ERROR(gens_.add_layout(name, g.num_blocks));
  layouts_.emplace(name, std::move(layout));
  return Status::Ok();
}

Status Agent::Impl::remove_layout(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layouts_.erase(name) == 0) return NotFound("no layout named '" + name + "'");
  gens_.remove_layout(name);
  return Status::Ok();
}

Result<KVLayout> Agent::Impl::layout(const std::string& name) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = layouts_.find(name);
  if (it == layouts_.end()) return NotFound("no local layout named '" + name + "'");
  return it->second;
}

std::vector<std::string> Agent::Impl::layout_names() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::string> out;
  for (auto& [n, l] : layouts_) out.push_back(n);
  return out;
}

std::string Agent::Impl::metadata() {
  AgentMetadata md;
  md.name = cfg_.name;
  md.instance_id = instance_id_;
  md.host_id = host_id_;
  md.pid = static_cast<uint32_t>(getpid());
  md.endpoints = endpoints();
  for (const auto& r : regions_.list())
    if (r.remote_access) md.regions.push_back(r);
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [n, l] : layouts_) {
      bool exported = std::all_of(l.segments().begin(), l.segments().end(), [&](const KVSegment& s) {
        return md.find_region(s.region_id) != nullptr;
      });
      if (exported) md.layouts.emplace_back(n, l);
    }
  }
  const size_t started = started_.load(std::memory_order_acquire);
  for (size_t i = 0; i < started; ++i) {
    std::string extra = transports_[i]->metadata_extra();
    if (!extra.empty()) md.extras.emplace_back(std::string(transports_[i]->name()), std::move(extra));
  }
  return encode_metadata(md);
}

Result<std::string> Agent::Impl::add_peer(std::string_view blob, std::string secret, std::string transport,
                                    std::string via_host) {
  PDKV_ASSIGN_OR_RETURN(AgentMetadata md, decode_metadata(blob));
  if (!via_host.empty()) {
    // Every network endpoint ("host:port", whichever transport publishes it); other
    // addresses (socket paths, host ids) never parse as one.
    for (auto& e : md.endpoints) {
      auto hp = util::parse_host_port(e.address);
      if (!hp.ok()) continue;
      const std::string& h = hp->host;
      const bool unusable = h == "0.0.0.0" || h == "::" ||
                            ((h.rfind("127.", 0) == 0 || h == "::1" || h == "localhost") &&
                             via_host.rfind("127.", 0) != 0 && via_host != "::1" && via_host != "localhost");
      if (unusable) e.address = util::HostPort{via_host, hp->port}.str();
    }
  }
  auto peer = std::make_shared<Peer>();
  peer->md = std::move(md);
  peer->secret = secret.empty() ? cfg_.secret : std::move(secret);
  Transport* chosen = nullptr;
  if (!transport.empty()) {
    chosen = transport_by_name(transport);
    if (!chosen) return NotFound("transport '" + transport + "' is not enabled on agent '" + cfg_.name + "'");
    if (!chosen->can_reach(peer->md))
      return NotSupported("transport '" + transport + "' cannot reach peer '" + peer->md.name + "'");
  } else {
    for (auto& t : transports_)
      if (t->can_reach(peer->md)) {
        chosen = t.get();
        break;
      }
    if (!chosen)
      return NotSupported("no enabled transport of agent '" + cfg_.name + "' can reach peer '" + peer->md.name + "'");
  }
  const std::string name = peer->md.name;
  Transport* old_transport = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    // Another instance, another transport, or the same instance at other addresses (its
    // metadata added again with another via_host): the old transport forgets the peer,
    // connections to the old addresses included, and the next transfer connects anew.
    if (it != peers_.end() && (it->second.peer->md.instance_id != peer->md.instance_id ||
                               it->second.transport != chosen || !same_endpoints(it->second.peer->md, peer->md)))
      old_transport = it->second.transport;
    peers_[name] = PeerEntry{peer, chosen};
  }
  if (old_transport) old_transport->drop_peer(name);
  PDKV_LOG_INFO("agent '%s': peer '%s' uses transport %s", cfg_.name.c_str(), name.c_str(),
                std::string(chosen->name()).c_str());
  return name;
}

Status Agent::Impl::remove_peer(const std::string& name) {
  Transport* t = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return NotFound("no peer named '" + name + "'");
    t = it->second.transport;
    peers_.erase(it);
  }
  t->drop_peer(name);
  return Status::Ok();
}

std::vector<std::string> Agent::Impl::peer_names() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::string> out;
  for (auto& [n, p] : peers_) out.push_back(n);
  return out;
}

Result<std::shared_ptr<const Peer>> Agent::Impl::peer(const std::string& name) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(name);
  if (it == peers_.end()) return NotFound("no peer named '" + name + "'; add it with add_peer() first");
  return it->second.peer;
}

Result<std::string> Agent::Impl::peer_transport(const std::string& name) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(name);
  if (it == peers_.end()) return NotFound("no peer named '" + name + "'");
  return std::string(it->second.transport->name());
}

Result<std::string> Agent::Impl::fetch_metadata(const std::string& address, std::string secret, double timeout_s) {
  for (auto& t : transports_)
    if (t->caps().serves_metadata) return t->fetch_metadata(address, secret.empty() ? cfg_.secret : secret, timeout_s);
  return NotSupported("fetching metadata by address needs a transport that serves metadata (tcp); agent '" +
                      cfg_.name + "' has none enabled");
}

Status Agent::Impl::connect(const std::string& name, double timeout_s) {
  PeerEntry e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return NotFound("no peer named '" + name + "'");
    e = it->second;
  }
  return e.transport->connect(e.peer, timeout_s);
}

}  // namespace pdkv
