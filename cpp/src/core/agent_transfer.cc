// Agent::Impl's transfer path: preparing transfers (block lists through the planner,
// staged through a local buffer when the layouts differ, or extents), checking every
// run against its regions, posting them and sending notifications.
#include <algorithm>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/agent_impl.h"
#include "core/relayout.h"
#include "pdkv/spi/transfer_control.h"
#include "util/bench_switches.h"
#include "util/log.h"
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

}  // namespace

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
