#include "pdkv/agent.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include "core/relayout.h"
#include "core/stream_pump.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/spi/registry.h"
#include "pdkv/spi/transfer_control.h"
#include "pdkv/spi/transport.h"
#include "util/bench_switches.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv {
namespace {

// False under the benchmark switch BenchSwitch::kFreshPlan=1 (read once per process;
// docs/benchmarks.md): every prepare plans into a fresh vector, as before, to compare
// both in one build.
bool reuse_plan_memory() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kFreshPlan, "1");
  return on;
}

// Plan vectors kept from one prepare to the next, so their pages stay mapped: a small
// pool shared by the threads that prepare. (Not thread_local: a thread_local with a
// destructor in this dlopen'ed library made ThreadSanitizer report glibc's reuse of a
// finished Python thread's TLS block as a race.)
class PlanPool {
 public:
  static constexpr size_t kKeep = 4;                     // vectors kept
  static constexpr size_t kKeepRuns = size_t(1) << 17;  // 11.5 MB each: a 4K-token 70B request's runs with room
  std::vector<planner::StridedExtent> take() {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.empty()) return {};
    auto v = std::move(free_.back());
    free_.pop_back();
    return v;
  }
  void give(std::vector<planner::StridedExtent> v) {
    if (v.capacity() > kKeepRuns || v.capacity() == 0) return;
    v.clear();
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.size() < kKeep) free_.push_back(std::move(v));
  }

 private:
  std::mutex mu_;
  std::vector<std::vector<planner::StridedExtent>> free_;
};

PlanPool& plan_pool() {
  static PlanPool* pool = new PlanPool;  // never destroyed: threads may prepare while the process exits
  return *pool;
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

// The agent's state, and what its transports may ask of it (AgentHooks). Every public
// Agent method forwards to the method of the same name here.
class Agent::Impl final : public AgentHooks {
 public:
  explicit Impl(AgentConfig cfg) : cfg_(std::move(cfg)) {
    secrets_.push_back(cfg_.secret);
    for (const std::string& s : cfg_.accepted_secrets)
      if (std::find(secrets_.begin(), secrets_.end(), s) == secrets_.end()) secrets_.push_back(s);
    for (const std::string& s : secrets_) keys_.push_back(auth::derive_key(s));
    notifs_.set_limits(cfg_.max_queued_notifs, cfg_.max_queued_notif_bytes);
  }
  ~Impl() override;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Creates the configured transports, then starts them.
  Status start();

  const AgentConfig& config() const { return cfg_; }
  std::vector<std::string> transports() const;
  std::vector<Endpoint> endpoints() const;
  uint64_t notifications_unacknowledged() const {
    uint64_t n = 0;
    for (const auto& t : transports_) n += t->notifications_unacknowledged();
    return n;
  }

  Result<RegionDesc> register_memory(uint64_t addr, uint64_t len, MemKind kind, int32_t device,
                                     bool remote_access, int shm_fd);
  Status deregister_memory(uint64_t id);
  std::vector<RegionDesc> regions() const { return regions_.list(); }

  Status add_layout(const std::string& name, KVLayout layout);
  Status remove_layout(const std::string& name);
  Result<KVLayout> layout(const std::string& name) const;
  std::vector<std::string> layout_names() const;
  GenerationTable& gens() { return gens_; }
  const GenerationTable& gens() const { return gens_; }

  std::string metadata();
  Result<std::string> add_peer(std::string_view blob, std::string secret, std::string transport,
                               std::string via_host);
  Status remove_peer(const std::string& name);
  std::vector<std::string> peer_names() const;
  Result<std::shared_ptr<const Peer>> peer(const std::string& name) const;
  Result<std::string> peer_transport(const std::string& name) const;
  Result<std::string> fetch_metadata(const std::string& address, std::string secret, double timeout_s);
  Status connect(const std::string& name, double timeout_s);

  Result<std::shared_ptr<PreparedTransfer>> prepare_blocks(const std::string& peer, OpKind op, const Blocks& local,
                                                           const Blocks& remote, const PlanOptions& plan,
                                                           const XferOptions& opts);
  Result<std::shared_ptr<PreparedTransfer>> prepare_extents(const std::string& peer, OpKind op,
                                                            const std::vector<Extent>& extents,
                                                            const XferOptions& opts);
  Result<std::shared_ptr<Transfer>> post(const PreparedTransfer& prep, std::string notif, double timeout_s);
  Result<std::shared_ptr<Transfer>> send_notification(const std::string& peer, std::string notif,
                                                      double timeout_s);
  NotifQueue& notifications() { return notifs_; }
  // The pump of this agent's streaming writes (stream_pump.h), created on first use.
  std::shared_ptr<StreamPump> stream_pump(Agent* self);
  uint64_t next_transfer_id() { return next_xfer_id_.fetch_add(1); }

  // ---- AgentHooks ----
  const std::string& agent_name() const override { return cfg_.name; }
  uint64_t instance_id() const override { return instance_id_; }
  const std::string& host_id() const override { return host_id_; }
  const std::vector<auth::Key>& accepted_keys() const override { return keys_; }
  const std::vector<std::string>& accepted_secrets() const override { return secrets_; }
  const std::string& agent_secret() const { return cfg_.secret; }
  const RegionTable& region_table() const override { return regions_; }
  Status deliver_notification(Notification n) override {
    Status st = notifs_.push(std::move(n));
    if (st.ok()) return st;
    return ResourceExhausted("agent '" + cfg_.name + "': " + st.message());
  }
  std::string metadata_blob() override { return metadata(); }
  uint32_t max_notif_bytes() const override { return cfg_.max_notif_bytes; }
  Result<GenPin> check_generations(const GenClaim& claim) override { return gens_.check_and_pin(claim); }
  Result<int> share_generations(const std::string& layout, uint32_t* num_blocks) override {
    return gens_.dup_shared_fd(layout, num_blocks);
  }
  void relay_notification(const std::shared_ptr<const Peer>& peer, const std::shared_ptr<Transfer>& xfer,
                          std::string notif, const Transport* from) override;
  Result<std::string> fetch_peer_metadata(const std::string& address, std::string_view secret,
                                          double timeout_s) override {
    return fetch_metadata(address, std::string(secret), timeout_s);
  }

 private:
  struct PeerEntry {
    std::shared_ptr<const Peer> peer;
    Transport* transport = nullptr;
  };

  Transport* transport_by_name(std::string_view name) const;
  // The peer `peer_name` and the transport a transfer to it uses: the peer's own, or the
  // one `opts.transport` names (which must reach it). NotFound / NotSupported otherwise.
  Result<PeerEntry> route(const std::string& peer_name, const XferOptions& opts) const;
  // Checks every run against its regions (the whole run: first and last piece) and
  // hands the transport the resolved runs: strided as planned when it takes them
  // (caps().strided_extents), piece by piece otherwise (expand_strided).
  Result<std::shared_ptr<PreparedTransfer>> prepare_resolved(const std::string& peer, OpKind op,
                                                             const std::vector<planner::StridedExtent>& extents,
                                                             const XferOptions& opts,
                                                             std::shared_ptr<const GenClaim> claim = nullptr);
  Result<std::shared_ptr<PreparedTransfer>> prepare_resolved(const std::string& peer, OpKind op,
                                                             const std::vector<Extent>& extents,
                                                             const XferOptions& opts,
                                                             std::shared_ptr<const GenClaim> claim = nullptr);
  // A transfer staged through a local buffer (core/relayout.h), or null when the
  // direct plan is as good.
  Result<std::shared_ptr<PreparedTransfer>> prepare_staged(
      const std::string& peer, OpKind op, const KVLayout& local, const std::vector<uint32_t>& local_ids, const KVLayout& remote,
      const std::vector<uint32_t>& remote_ids, const PlanOptions& plan, const XferOptions& opts,
      std::shared_ptr<const GenClaim> claim);
  std::shared_ptr<Transfer> post_staged_read(const PreparedTransfer& prep, const std::shared_ptr<Transfer>& xfer,
                                             std::string notif, Transport* t);
  // A registered staging buffer of at least `bytes` that no prepared transfer holds.
  Result<std::shared_ptr<StagingBuffer>> staging_buffer(uint64_t bytes);

  AgentConfig cfg_;
  std::vector<std::string> secrets_;  // cfg_.secret, then cfg_.accepted_secrets (deduplicated)
  std::vector<auth::Key> keys_;       // auth::derive_key of each of secrets_
  uint64_t instance_id_ = 0;
  std::string host_id_;
  RegionTable regions_;
  GenerationTable gens_;
  NotifQueue notifs_;
  // Created in full before any is started, never resized afterwards; the first
  // started_ of them are running (what inbound traffic may see while start() runs).
  std::vector<std::unique_ptr<Transport>> transports_;
  std::atomic<size_t> started_{0};
  std::atomic<uint64_t> next_xfer_id_{1};

  std::mutex staging_mu_;  // guards staging_
  std::vector<std::shared_ptr<StagingBuffer>> staging_;  // registered; reused once no prepared transfer holds one
  mutable std::mutex mu_;  // guards layouts_ and peers_
  std::map<std::string, KVLayout> layouts_;
  std::map<std::string, PeerEntry> peers_;
  std::shared_ptr<StreamPump> pump_;  // guarded by mu_
};

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
    if (it != peers_.end() && (it->second.peer->md.instance_id != peer->md.instance_id || it->second.transport != chosen))
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

Result<std::shared_ptr<PreparedTransfer>> Agent::Impl::prepare_blocks(const std::string& peer_name, OpKind op,
                                                                      const Blocks& local_blocks,
                                                                      const Blocks& remote_blocks,
                                                                      const PlanOptions& plan,
                                                                      const XferOptions& opts) {
  const std::string& remote_layout = remote_blocks.layout;
  const std::vector<uint32_t>& local_ids = local_blocks.ids;
  const std::vector<uint32_t>& remote_ids = remote_blocks.ids;
  if (!local_blocks.generations.empty())
    return InvalidArgument("local blocks carry generations: this agent owns them and checks none of its own; give "
                           "the peer's generations with the remote blocks");
  PDKV_RETURN_IF_ERROR(remote_blocks.validate());
  PDKV_ASSIGN_OR_RETURN(KVLayout local, layout(local_blocks.layout));
  PDKV_ASSIGN_OR_RETURN(auto p, peer(peer_name));
  const KVLayout* remote = p->md.find_layout(remote_layout);
  if (!remote) return NotFound("peer '" + peer_name + "' exports no layout named '" + remote_layout + "'");
  if (local_ids.empty()) return InvalidArgument("no blocks to transfer");
  PDKV_RETURN_IF_ERROR(op == OpKind::kWrite ? check_distinct_blocks(remote_ids, "remote")
                                            : check_distinct_blocks(local_ids, "local"));
  std::shared_ptr<GenClaim> claim;
  if (!remote_blocks.generations.empty()) {
    claim = std::make_shared<GenClaim>(GenClaim{remote_layout, remote_ids, remote_blocks.generations});
    PDKV_RETURN_IF_ERROR(validate_claim(*claim));
  }
  PDKV_ASSIGN_OR_RETURN(auto staged,
                        prepare_staged(peer_name, op, local, local_ids, *remote, remote_ids, plan, opts, claim));
  if (staged) return staged;
  // A transport that takes strided runs gets a peer's fragmented blocks as one run
  // per block (or per request) instead of one extent per token; the others get the
  // plan they always had. (A routing error is left for prepare_resolved() to report.)
  auto routed = route(peer_name, opts);
  if (routed.ok() && routed->transport->caps().strided_extents) {
    // The plan is a temporary (prepare_resolved() keeps its own list): planned into a
    // pooled vector, whose pages stay mapped from one prepare to the next. A fresh
    // 3.6 MB plan per 4K-token 70B request with scattered ids (40,960 runs) spent
    // more in page faults than in planning.
    std::vector<planner::StridedExtent> runs = reuse_plan_memory() ? plan_pool().take()
                                                                   : std::vector<planner::StridedExtent>();
    PDKV_RETURN_IF_ERROR(planner::plan_strided_into(runs, local, local_ids, *remote, remote_ids, plan,
                                                    routed->transport->caps().two_level_extents));
    auto prep = prepare_resolved(peer_name, op, runs, opts, std::move(claim));
    if (reuse_plan_memory()) plan_pool().give(std::move(runs));
    return prep;
  }
  PDKV_ASSIGN_OR_RETURN(std::vector<Extent> ex, plan_blocks(local, local_ids, *remote, remote_ids, plan));
  return prepare_resolved(peer_name, op, ex, opts, std::move(claim));
}

Result<std::shared_ptr<PreparedTransfer>> Agent::Impl::prepare_staged(
    const std::string& peer_name, OpKind op, const KVLayout& local, const std::vector<uint32_t>& local_ids,
    const KVLayout& remote, const std::vector<uint32_t>& remote_ids, const PlanOptions& plan, const XferOptions& opts,
    std::shared_ptr<const GenClaim> claim) {
  // Some transports move small extents as cheaply as their bytes: staging would only
  // add a copy. One that takes two-level runs gets NHD <-> HND as a few thousand runs
  // at most (a 4096-token llama-3-70b request: 2,048, prepared in 0.2 ms over tcp,
  // against 26,400 staged extents in 3.2 ms, at the same GB/s measured in one run:
  // docs/benchmarks.md), so it is not staged either. (A routing error is left for
  // prepare_resolved() to report.)
  auto routed = route(peer_name, opts);
  if (!routed.ok() || routed->transport->caps().direct_small_extents || routed->transport->caps().two_level_extents)
    return std::shared_ptr<PreparedTransfer>();
  for (const KVSegment& s : local.segments()) {  // the gather is a host copy
    auto d = regions_.get(s.region_id);
    if (!d.ok() || d->kind != MemKind::kHost) return std::shared_ptr<PreparedTransfer>();
  }
  const bool strided = routed->transport->caps().strided_extents;
  PDKV_ASSIGN_OR_RETURN(auto staged, plan_staged(local, local_ids, remote, remote_ids, plan, strided));
  if (!staged) return std::shared_ptr<PreparedTransfer>();
  PDKV_ASSIGN_OR_RETURN(auto buf, staging_buffer(staged->bytes));
  std::shared_ptr<PreparedTransfer> prep;
  if (strided) {
    PDKV_ASSIGN_OR_RETURN(prep, prepare_resolved(peer_name, op, staged_wire_runs(*staged, buf->region_id, remote,
                                                                                 remote_ids),
                                                 opts, std::move(claim)));
  } else {
    PDKV_ASSIGN_OR_RETURN(prep, prepare_resolved(peer_name, op, staged_wire_extents(*staged, buf->region_id, remote,
                                                                                    remote_ids),
                                                 opts, std::move(claim)));
  }
  // The copies touch the local layout's regions, which no extent names: pin them too.
  for (const KVSegment& s : local.segments())
    if (std::find(prep->local_regions.begin(), prep->local_regions.end(), s.region_id) == prep->local_regions.end())
      prep->local_regions.push_back(s.region_id);
  prep->staged = std::make_shared<StagedTransfer>(op, std::move(*staged), local, local_ids, std::move(buf));
  return prep;
}

Result<std::shared_ptr<StagingBuffer>> Agent::Impl::staging_buffer(uint64_t bytes) {
  std::lock_guard<std::mutex> lk(staging_mu_);
  std::shared_ptr<StagingBuffer> found;
  for (auto it = staging_.begin(); it != staging_.end();) {
    const bool unused = it->use_count() == 1;
    if (unused && !found && (*it)->size() >= bytes && (*it)->size() / 2 <= bytes) {
      found = *it;
      ++it;
    } else if (unused) {  // keep one idle buffer at most: the rest are freed
      (void)deregister_memory((*it)->region_id);
      it = staging_.erase(it);
    } else {
      ++it;
    }
  }
  if (found) return found;
  PDKV_ASSIGN_OR_RETURN(auto buf, StagingBuffer::allocate(bytes));
  PDKV_ASSIGN_OR_RETURN(RegionDesc d, register_memory(reinterpret_cast<uint64_t>(buf->data()), buf->size(),
                                                      MemKind::kHost, -1, /*remote_access=*/false, -1));
  buf->region_id = d.id;
  staging_.push_back(buf);
  return buf;
}

Result<std::shared_ptr<PreparedTransfer>> Agent::Impl::prepare_extents(const std::string& peer_name, OpKind op,
                                                                 const std::vector<Extent>& extents,
                                                                 const XferOptions& opts) {
  return prepare_resolved(peer_name, op, extents, opts);
}

Result<std::shared_ptr<PreparedTransfer>> Agent::Impl::prepare_resolved(const std::string& peer_name, OpKind op,
                                                                  const std::vector<Extent>& ex,
                                                                  const XferOptions& opts,
                                                                  std::shared_ptr<const GenClaim> claim) {
  std::vector<planner::StridedExtent> runs;
  runs.reserve(ex.size());
  for (const Extent& x : ex)
    runs.push_back(planner::StridedExtent{x.local_region, x.local_offset, x.remote_region, x.remote_offset, x.len});
  return prepare_resolved(peer_name, op, runs, opts, std::move(claim));
}

namespace {

// Bytes from the first byte of a run's first piece to the end of its last piece on
// one side (`stride2`: its repetitions' stride), or nullopt when that overflows u64.
std::optional<uint64_t> run_span(const planner::StridedExtent& x, uint64_t stride, uint64_t stride2) {
  uint64_t steps = 0, steps2 = 0, span = 0;
  if (__builtin_mul_overflow(x.count - 1, stride, &steps) || __builtin_mul_overflow(x.count2 - 1, stride2, &steps2) ||
      __builtin_add_overflow(steps, steps2, &span) || __builtin_add_overflow(span, x.len, &span))
    return std::nullopt;
  return span;
}

// Whether [offset, offset + span) lies inside a region of `region_len` bytes.
bool span_in_region(uint64_t offset, std::optional<uint64_t> span, uint64_t region_len) {
  return span && offset <= region_len && *span <= region_len - offset;
}

}  // namespace

Result<std::shared_ptr<PreparedTransfer>> Agent::Impl::prepare_resolved(const std::string& peer_name, OpKind op,
                                                                  const std::vector<planner::StridedExtent>& ex,
                                                                  const XferOptions& opts,
                                                                  std::shared_ptr<const GenClaim> claim) {
  if (ex.empty()) return InvalidArgument("no extents to transfer");
  PDKV_ASSIGN_OR_RETURN(PeerEntry e, route(peer_name, opts));
  Transport* t = e.transport;
  const TransportCaps caps = t->caps();
  // For "cannot access" errors: the enabled transports that could carry this kind.
  auto alternatives = [&](bool local_side, MemKind kind) {
    std::string alt;
    for (auto& other : transports_) {
      if (other.get() == t || !other->can_reach(e.peer->md)) continue;
      const TransportCaps oc = other->caps();
      if ((local_side ? oc.local_mem_kinds : oc.remote_mem_kinds) & mem_kind_bit(kind))
        alt += (alt.empty() ? "" : ", ") + std::string(other->name());
    }
    return alt.empty() ? std::string()
                       : "; enabled transports that can: " + alt + " (choose one with transport=...)";
  };
  if (op == OpKind::kRead && !caps.read) return NotSupported(std::string(t->name()) + " cannot read");
  if (op == OpKind::kWrite && !caps.write) return NotSupported(std::string(t->name()) + " cannot write");
  if (claim && !caps.generations)
    return NotSupported("transport '" + std::string(t->name()) + "' cannot check block generations at the target " +
                        "before bytes land; transfer without the remote blocks' generations, or use tcp or shm");
  // Region lookups: a handful of regions, millions of extents; cache the last hit.
  std::unordered_map<uint64_t, RegionDesc> local;
  std::unordered_map<uint64_t, const RegionDesc*> remote;
  for (const auto& r : e.peer->md.regions) remote[r.id] = &r;
  auto prep = std::make_shared<PreparedTransfer>();
  std::vector<ResolvedExtent> out;
  out.reserve(ex.size());
  uint64_t last_l = ~0ull, last_r = ~0ull;
  const RegionDesc* ld = nullptr;
  const RegionDesc* rd = nullptr;
  bool strided = false, two_level = false;
  for (size_t i = 0; i < ex.size(); ++i) {
    const planner::StridedExtent& x = ex[i];
    if (x.len == 0) return InvalidArgument("extent " + std::to_string(i) + " has length 0");
    if (x.count == 0) return InvalidArgument("extent " + std::to_string(i) + " has 0 pieces");
    if (x.count > 1 && (x.local_stride < x.len || x.remote_stride < x.len))
      return InvalidArgument("extent " + std::to_string(i) + ": strides " + std::to_string(x.local_stride) + "/" +
                             std::to_string(x.remote_stride) + " are shorter than its " + std::to_string(x.len) +
                             "-byte pieces (they would overlap)");
    if (x.count2 == 0) return InvalidArgument("extent " + std::to_string(i) + " has 0 repetitions");
    if (x.count2 > 1 && (!planner::nested_disjoint(x.len, x.count, x.local_stride, x.count2, x.local_stride2) ||
                         !planner::nested_disjoint(x.len, x.count, x.remote_stride, x.count2, x.remote_stride2)))
      return InvalidArgument("extent " + std::to_string(i) + ": its " + std::to_string(x.count2) +
                             " repetitions (strides " + std::to_string(x.local_stride2) + "/" +
                             std::to_string(x.remote_stride2) + ") would overlap its pieces");
    if (x.local_region != last_l) {
      auto it = local.find(x.local_region);
      if (it == local.end()) {
        PDKV_ASSIGN_OR_RETURN(RegionDesc d, regions_.get(x.local_region));
        if (!(caps.local_mem_kinds & mem_kind_bit(d.kind)))
          return NotSupported("transport '" + std::string(t->name()) + "' cannot access local " +
                              std::string(mem_kind_name(d.kind)) + " region " + std::to_string(d.id) +
                              alternatives(true, d.kind));
        it = local.emplace(d.id, d).first;
        prep->local_regions.push_back(d.id);
      }
      ld = &it->second;
      last_l = x.local_region;
    }
    if (x.remote_region != last_r) {
      auto it = remote.find(x.remote_region);
      if (it == remote.end())
        return NotFound("peer '" + peer_name + "' exports no region " + std::to_string(x.remote_region));
      rd = it->second;
      if (!(caps.remote_mem_kinds & mem_kind_bit(rd->kind)))
        return NotSupported("transport '" + std::string(t->name()) + "' cannot access the peer's " +
                            std::string(mem_kind_name(rd->kind)) + " region " + std::to_string(rd->id) +
                            alternatives(false, rd->kind));
      last_r = x.remote_region;
    }
    // A run is checked whole: its first and last piece (the ones between lie between).
    const bool plain = x.count == 1 && x.count2 == 1;
    const auto lspan = plain ? std::optional<uint64_t>(x.len) : run_span(x, x.local_stride, x.local_stride2);
    const auto rspan = plain ? std::optional<uint64_t>(x.len) : run_span(x, x.remote_stride, x.remote_stride2);
    auto span_str = [&](std::optional<uint64_t> sp) {
      return sp ? std::to_string(*sp) : std::string("more than 2^64");
    };
    if (!span_in_region(x.local_offset, lspan, ld->len))
      return OutOfRange("extent " + std::to_string(i) + ": local bytes [" + std::to_string(x.local_offset) + ", +" +
                        span_str(lspan) + ") fall outside region " + std::to_string(ld->id) + " (" +
                        std::to_string(ld->len) + " bytes)");
    if (!span_in_region(x.remote_offset, rspan, rd->len))
      return OutOfRange("extent " + std::to_string(i) + ": remote bytes [" + std::to_string(x.remote_offset) + ", +" +
                        span_str(rspan) + ") fall outside the peer's region " + std::to_string(rd->id) + " (" +
                        std::to_string(rd->len) + " bytes)");
    ResolvedExtent r{ld->addr + x.local_offset, x.remote_region, x.remote_offset, x.len, ld->kind, ld->device};
    if (x.count > 1) {
      r.count = x.count;
      r.local_stride = x.local_stride;
      r.remote_stride = x.remote_stride;
      strided = true;
    }
    if (x.count2 > 1) {
      r.count2 = x.count2;
      r.local_stride2 = x.local_stride2;
      r.remote_stride2 = x.remote_stride2;
      strided = two_level = true;
    }
    out.push_back(r);
    prep->bytes += r.bytes();
  }
  if (two_level && caps.strided_extents && !caps.two_level_extents) out = expand_two_level(out);
  if (strided && !caps.strided_extents) out = expand_strided(out);
  prep->peer = peer_name;
  prep->transport = std::string(t->name());
  prep->op = op;
  prep->num_extents = out.size();  // what the transport gets (a strided run counts once)
  prep->instance_id = e.peer->md.instance_id;
  prep->checked = claim != nullptr;
  PDKV_ASSIGN_OR_RETURN(prep->ops,
                        t->prepare_with(e.peer, op, std::move(out), std::move(claim), TransferHints{opts.compress}));
  return prep;
}

Result<std::shared_ptr<Transfer>> Agent::Impl::post(const PreparedTransfer& prep, std::string notif, double timeout_s) {
  if (notif.size() > cfg_.max_notif_bytes)
    return InvalidArgument("notification is " + std::to_string(notif.size()) + " bytes (limit " +
                           std::to_string(cfg_.max_notif_bytes) + ")");
  bool restarted = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(prep.peer);
    if (it == peers_.end()) return NotFound("peer '" + prep.peer + "' was removed since this transfer was prepared");
    restarted = it->second.peer->md.instance_id != prep.instance_id;
  }
  Transport* t = transport_by_name(prep.transport);
  if (!t || !prep.ops) return InvalidArgument("prepared transfer is empty");
  if (restarted) {
    // A peer fault, not a caller error: the transfer fails and wait() reports it
    // (docs/faults.md).
    auto xfer = std::make_shared<Transfer>(next_xfer_id_.fetch_add(1), prep.op, prep.peer, prep.transport, prep.bytes,
                                           Clock::time_point::max(), cfg_.wait_spin_us);
    spi::TransferControl(xfer).fail_now(StalePeer("peer '" + prep.peer + "' was re-added (restarted) since this "
                                                  "transfer was prepared; prepare it again"));
    return xfer;
  }
  std::vector<RegionPin> pins;
  pins.reserve(prep.local_regions.size());
  for (uint64_t id : prep.local_regions) {
    PDKV_ASSIGN_OR_RETURN(RegionPin pin, regions_.pin(id, 0, 0, false, ~0u, nullptr));
    pins.push_back(std::move(pin));
  }
  if (timeout_s < 0) timeout_s = cfg_.default_timeout_s;
  auto deadline = timeout_s == 0 ? Clock::time_point::max()
                                 : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                      std::chrono::duration<double>(timeout_s));
  auto xfer = std::make_shared<Transfer>(next_xfer_id_.fetch_add(1), prep.op, prep.peer, prep.transport, prep.bytes,
                                         deadline, cfg_.wait_spin_us);
  spi::TransferControl(xfer).hold_pins(std::move(pins));
  if (prep.staged) {
    // The buffer is this post's until it is done; a push gathers the rows now (they
    // may have changed since prepare).
    if (!prep.staged->begin_post(deadline)) {
      spi::TransferControl(xfer).fail_now(TimeoutError("an earlier post of this transfer still holds its staging "
                                                       "buffer (post it again once that one is done)"));
      return xfer;
    }
    if (prep.op == OpKind::kRead) return post_staged_read(prep, xfer, std::move(notif), t);
    spi::TransferControl(xfer).on_terminal([staged = prep.staged] { staged->finish_post(); });
  }
  t->post(prep.ops, xfer, std::move(notif));
  return xfer;
}

// A staged pull completes in two steps: the transport fills the staging buffer (an
// inner transfer holding the pins), then a short-lived thread scatters it into the
// local rows (a copy of the whole payload: not for a progress thread) and resolves
// the caller's transfer with the inner one's outcome. Cancelling the caller's
// transfer cancels the inner one; its deadline is the inner one's.
std::shared_ptr<Transfer> Agent::Impl::post_staged_read(const PreparedTransfer& prep,
                                                        const std::shared_ptr<Transfer>& xfer, std::string notif,
                                                        Transport* t) {
  auto inner = std::make_shared<Transfer>(next_xfer_id_.fetch_add(1), prep.op, prep.peer, prep.transport, prep.bytes,
                                          xfer->deadline(), cfg_.wait_spin_us);
  spi::TransferControl outer(xfer);
  outer.set_parts(1);
  outer.set_cancel_hook([weak = std::weak_ptr<Transfer>(inner)] {
    if (auto i = weak.lock()) i->cancel();
  });
  spi::TransferControl(inner).on_terminal(
      [weak = std::weak_ptr<Transfer>(inner), xfer, staged = prep.staged] {
        auto i = weak.lock();
        const Status st = i ? i->error() : Internal("staged read finished without its transfer");
        const uint64_t bytes = i ? i->bytes_done() : 0;
        std::thread([xfer, staged, st, bytes] {
          util::name_this_thread("pdkv-relayout");
          if (st.ok()) staged->scatter();
          staged->finish_post();
          spi::TransferControl(xfer).resolve_part(bytes, st);
        }).detach();
      });
  t->post(prep.ops, inner, std::move(notif));
  return xfer;
}

Result<std::shared_ptr<Transfer>> Agent::Impl::send_notification(const std::string& peer_name, std::string notif,
                                                           double timeout_s) {
  if (notif.empty()) return InvalidArgument("notification is empty");
  if (notif.size() > cfg_.max_notif_bytes)
    return InvalidArgument("notification is " + std::to_string(notif.size()) + " bytes (limit " +
                           std::to_string(cfg_.max_notif_bytes) + ")");
  PeerEntry e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(peer_name);
    if (it == peers_.end()) return NotFound("no peer named '" + peer_name + "'");
    e = it->second;
  }
  if (timeout_s < 0) timeout_s = cfg_.default_timeout_s;
  auto deadline = timeout_s == 0 ? Clock::time_point::max()
                                 : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                      std::chrono::duration<double>(timeout_s));
  auto xfer = std::make_shared<Transfer>(next_xfer_id_.fetch_add(1), OpKind::kWrite, peer_name,
                                         std::string(e.transport->name()), 0, deadline, cfg_.wait_spin_us);
  spi::TransferControl(xfer).set_parts(1);
  if (e.transport->caps().notify) {
    e.transport->notify(e.peer, xfer, std::move(notif));
  } else {
    relay_notification(e.peer, xfer, std::move(notif), e.transport);
  }
  return xfer;
}

void Agent::Impl::relay_notification(const std::shared_ptr<const Peer>& peer, const std::shared_ptr<Transfer>& xfer,
                               std::string notif, const Transport* from) {
  for (auto& t : transports_) {
    if (t.get() == from || !t->caps().notify || !t->can_reach(peer->md)) continue;
    t->notify(peer, xfer, std::move(notif));
    return;
  }
  spi::TransferControl(xfer).resolve_part(0, ConnectionError("no transport of agent '" + cfg_.name +
                                                             "' can carry a notification to '" + peer->md.name +
                                                             "' (enable tcp or shm)"));
}

}  // namespace pdkv
