// The shm transport: same host, one copy, done by the initiator.
//
// Regions an agent allocates as memfd-backed shared memory (Agent.alloc in Python)
// are mapped once by a same-host peer (the fd travels over a Unix socket after the
// peer authenticated with the secret); a transfer is then one memcpy per extent,
// straight between the two processes' KV pools. Host memory pdkv did not allocate
// is reached with cross-memory attach (process_vm_writev/readv), where the kernel
// permits it. Small transfers copy inline in the posting thread (lowest latency);
// larger ones on pdkv's copy thread. Notifications go over the Unix socket after
// every byte was copied and complete the transfer when the peer acknowledges them.
// Block generations: a write leases the blocks first (one round trip); a read checks
// them against the target's shared generation table, before and after the copy.
//
// Direct access means the target cannot check each write, so the initiator never
// trusts the metadata blob for bounds: before first use it asks the target, over
// the authenticated socket, what region `id` is now (RegionReq), and uses only the
// answer (a mismatch with the blob is an error). The target remembers which peer
// confirmed which region; when it deregisters one it tells each of them to stop
// (Revoke) and waits for their acknowledgements, at most kRevokeTimeoutS, after
// which it closes that peer's connection (a peer must re-confirm on a new one).
//
// Peer faults never fail prepare(): connecting and confirming happen when a
// transfer is first posted, and their errors fail that transfer.
//
// Protocol: wire.h and docs/wire.md.
//
// Files: shm_transport_impl.h lists them.
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pdkv/spi/registry.h"
#include "transport/shm/copy_ops.h"
#include "transport/shm/remote_region.h"
#include "transport/shm/wire.h"
#include "transport/shm/handshake.h"
#include "transport/shm/shm_transport_impl.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/bench_switches.h"

namespace pdkv::shm {

bool two_level_runs_allowed() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kShmOneLevel, "1");
  return on;
}

Status ShmTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  PDKV_RETURN_IF_ERROR(opts_.validate());  // also checked by AgentConfig::validate()
  PDKV_ASSIGN_OR_RETURN(listen_fd_, util::listen_unix(hooks->agent_name(), hooks->instance_id(), ".sock", &path_));
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  ev.data.ptr = this;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_.get(), &ev);
  tfd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);  // -1: wake_at wakes at once
  ev.data.ptr = &tfd_;
  if (tfd_ >= 0 && epoll_ctl(epfd_, EPOLL_CTL_ADD, tfd_, &ev) != 0) {
    ::close(tfd_);
    tfd_ = -1;
  }
  th_ = std::thread([this] { run(); });
  copies_.start(opts_.copy_threads);
  return Status::Ok();
}

void ShmTransport::shutdown() {
  if (shut_.exchange(true)) return;
  stop_ = true;
  wake();
  if (th_.joinable()) th_.join();
  for (auto& j : copies_.stop()) {
    {
      std::lock_guard<std::mutex> lk(checks_mu_);
      read_checks_.erase(j.xfer.get());
    }
    end_lease(j);
    unpin(*j.b);
    spi::TransferControl(j.xfer).resolve_part(0, ConnectionError("agent is shutting down"));
    if (!j.notif.empty()) spi::TransferControl(j.xfer).resolve_part(0, Cancelled("notification not sent"));
  }
  std::vector<std::shared_ptr<ShmConn>> cs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) cs.push_back(c);
  }
  for (auto& c : cs) kill(c, ConnectionError("agent is shutting down"));
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_.clear();
    peers_.clear();
  }
  if (!path_.empty()) ::unlink(path_.c_str());
  if (epfd_ >= 0) ::close(epfd_);
  if (evfd_ >= 0) ::close(evfd_);
  if (tfd_ >= 0) ::close(tfd_);
  epfd_ = evfd_ = tfd_ = -1;
}

void ShmTransport::wake_at(Clock::time_point t) {
  if (t == Clock::time_point::max()) return;  // no deadline to watch
  if (tfd_ < 0) return wake();
  std::lock_guard<std::mutex> lk(timer_mu_);
  if (t >= armed_) return;  // the thread looks earlier anyway (and polls while anything is pending)
  // steady_clock is CLOCK_MONOTONIC (what the timerfd counts).
  const int64_t ns = std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
  itimerspec its{};
  its.it_value.tv_sec = static_cast<time_t>(ns / 1000000000);
  its.it_value.tv_nsec = static_cast<long>(ns % 1000000000);
  if (::timerfd_settime(tfd_, TFD_TIMER_ABSTIME, &its, nullptr) != 0) return wake();
  armed_ = t;
}

// ---------------------------------------------------------------- initiator side

// One state (and connection) per peer instance; newer metadata of the same
// instance replaces the old for the next dial.
std::shared_ptr<ShmPeerState> ShmTransport::peer_state(const std::shared_ptr<const Peer>& peer) {
  std::shared_ptr<ShmPeerState> ps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = peers_[peer->md.name];
    if (!slot || slot->instance != peer->md.instance_id) {
      slot = std::make_shared<ShmPeerState>();
      slot->instance = peer->md.instance_id;
      slot->peer = peer;
      return slot;
    }
    ps = slot;
  }
  std::lock_guard<std::mutex> lk(ps->mu);
  ps->peer = peer;
  return ps;
}

Result<std::shared_ptr<ShmConn>> ShmTransport::get_conn(ShmPeerState& ps, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lk(ps.mu);
  if (ps.conn) {
    if (!ps.conn->lock()->dead) return ps.conn;
  }
  if (shut_) return ConnectionError("agent is shutting down");
  // The first contact is bounded by the transfer's deadline too (a frozen peer that
  // accepts and never answers must not hold a post for the whole connect timeout).
  const auto by = std::min(deadline, util::deadline_after(connect_timeout_));
  if (by <= Clock::now()) return TimeoutError("the transfer's deadline passed before peer '" + ps.peer->md.name +
                                              "' was connected over shm");
  PDKV_ASSIGN_OR_RETURN(ps.conn, dial(*ps.peer, hooks_->agent_name(), by, opts_.allowed_peer_uids));
  add_conn(ps.conn);
  return ps.conn;
}

Result<std::shared_ptr<const PreparedOps>> ShmTransport::prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                         std::vector<ResolvedExtent> extents,
                                                                         std::shared_ptr<const GenClaim> claim) {
  PDKV_ASSIGN_OR_RETURN(auto ops, prepare(std::move(peer), op, std::move(extents)));
  auto p = std::const_pointer_cast<ShmPrepared>(std::static_pointer_cast<const ShmPrepared>(ops));
  p->claim_wire = encode_claim(*claim);
  p->claim = std::move(claim);
  return ops;
}

// Sends LeaseReq: the target is to check the claimed block generations and pin the
// blocks until LeaseEnd. Returns the lease id; its answer lands in lease_answers.
Result<uint64_t> ShmTransport::send_lease_req(const std::shared_ptr<ShmConn>& c, const std::string& claim_wire,
                                              Clock::time_point deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return TimeoutError("the transfer's deadline passed before its blocks were leased");
  const double hold_s = deadline == Clock::time_point::max()
                            ? kMaxLeaseHoldMs / 1000.0
                            : std::chrono::duration<double>(deadline - now).count();
  const auto hold_ms = static_cast<uint32_t>(std::clamp(hold_s * 1000.0 + 1.0, 1.0, double(kMaxLeaseHoldMs)));
  util::ByteWriter w;
  w.put<uint32_t>(hold_ms);
  std::string aux = w.take() + claim_wire;
  uint64_t id;
  {
    auto s = c->lock();
    if (s->dead) return s->dead_reason;
    id = s->next_lease++;
    s->lease_answers.emplace(id, std::nullopt);
  }
  Status sent = c->send_frame(Ctl::kLeaseReq, id, aux);
  if (!sent.ok()) {
    c->lock()->lease_answers.erase(id);
    return sent;
  }
  return id;
}

// A write's lease: granted before the copy (one round trip), since a write into blocks
// the target freed would corrupt their new owner. A target that does not answer in
// time loses the connection, which releases whatever it granted.
Result<uint64_t> ShmTransport::take_lease(const std::shared_ptr<ShmConn>& c, const std::string& claim_wire,
                                          Clock::time_point deadline) {
  PDKV_ASSIGN_OR_RETURN(uint64_t id, send_lease_req(c, claim_wire, deadline));
  std::optional<Status> ans;
  bool got = false;
  {
    auto s = c->lock();
    got = s.wait_until(answer_by(deadline), [&] { return s->dead || s->lease_answers[id].has_value(); });
    ans = s->lease_answers[id];
    s->lease_answers.erase(id);
    if (s->dead) return s->dead_reason;  // the target released the lease with the connection
  }
  if (!got) {
    Status st = TimeoutError(c->desc() + " did not answer a block lease request in time");
    kill(c, st);
    return st;
  }
  if (!ans->ok()) return *ans;
  return id;
}

// ---- Shared generation tables (docs/wire-shm.md): a read checks its claim against
// the target's published table before the copy and again after it, with no round
// trip; a write still takes a lease.

// The target's table for `layout`, mapped on first use (one round trip per
// connection and layout). nullptr: the target does not share it (use a lease).
Result<std::shared_ptr<RemoteGens>> ShmTransport::gen_table(const std::shared_ptr<ShmConn>& c,
                                                              const std::string& layout, Clock::time_point deadline) {
  uint64_t id;
  {
    auto s = c->lock();
    if (s->dead) return s->dead_reason.ok() ? ConnectionError("connection closed") : s->dead_reason;
    auto it = s->gen_tables.find(layout);
    if (it != s->gen_tables.end()) return it->second;
    id = s->next_gen_req++;
    s->gen_answers.emplace(id, GenAnswer{});
  }
  Status sent = c->send_frame(Ctl::kGenReq, id, layout);
  GenAnswer a;
  bool got = false;
  {
    auto s = c->lock();
    got = sent.ok() && s.wait_until(answer_by(deadline), [&] { return s->dead || s->gen_answers[id].done; });
    a = std::move(s->gen_answers[id]);
    s->gen_answers.erase(id);
    if (s->dead) {
      if (a.fd >= 0) ::close(a.fd);
      return s->dead_reason.ok() ? ConnectionError("connection closed") : s->dead_reason;
    }
  }
  if (!sent.ok()) return sent;
  if (!got) {
    Status st = TimeoutError(c->desc() + " did not share its generation table in time");
    kill(c, st);
    return st;
  }
  if (!a.st.ok()) {
    if (a.st.code() == StatusCode::kNotSupported) return std::shared_ptr<RemoteGens>();
    return a.st;
  }
  util::ScopedFd fd(a.fd);
  // The table is the target's word: check what mapping it can do to us. Its size and
  // seals (no shrinking: a shrunk file would fault our loads) before mapping n u32s.
  struct stat st {};
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  const uint64_t need = uint64_t{a.n} * sizeof(uint32_t);
  Status bad;
  if (a.n == 0) bad = ProtocolError(c->desc() + " shared an empty generation table for layout '" + layout + "'");
  else if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || uint64_t(st.st_size) < need)
    bad = ProtocolError(c->desc() + " shared a generation table for layout '" + layout + "' smaller than its " +
                        std::to_string(a.n) + " blocks");
  else if (seals < 0 || !(seals & F_SEAL_SHRINK))
    bad = ProtocolError(c->desc() + " shared a generation table for layout '" + layout + "' that is not sealed");
  if (!bad.ok()) {
    kill(c, bad);
    return bad;
  }
  void* p = ::mmap(nullptr, need, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ResourceExhausted("mapping a generation table failed: " + util::errno_str(errno));
  auto t = std::make_shared<RemoteGens>();
  t->base = static_cast<const uint32_t*>(p);
  t->n = a.n;
  auto s = c->lock();
  auto [it, fresh] = s->gen_tables.emplace(layout, t);
  (void)fresh;  // another post mapped it meanwhile: use that one
  return it->second;
}

// Checks `claim` against the published table now (acquire loads). *retired: a
// claimed entry is 0, the mark of a removed layout (its name may have a new table).
Status ShmTransport::check_gens(const RemoteGens& t, const GenClaim& claim, bool during, bool* retired) {
  for (size_t i = 0; i < claim.blocks.size(); ++i) {
    const uint32_t b = claim.blocks[i];
    if (b >= t.n) {
      // A removed layout's table (all 0) may have been re-added with more blocks.
      if (retired && __atomic_load_n(&t.base[0], __ATOMIC_ACQUIRE) == 0) *retired = true;
      return OutOfRange("block " + std::to_string(b) + " is beyond layout '" + claim.layout + "' (" +
                        std::to_string(t.n) + " blocks)");
    }
    const uint32_t g = __atomic_load_n(&t.base[b], __ATOMIC_ACQUIRE);
    if (g == claim.gens[i]) continue;
    if (g == 0 && retired) *retired = true;
    if (during)
      return StaleBlock("layout '" + claim.layout + "' block " + std::to_string(b) + ": the transfer expects "
                        "generation " + std::to_string(claim.gens[i]) + ", the block went to generation " +
                        std::to_string(g) + " during the read (freed or reused while it was copied); the read's "
                        "destination bytes are not valid");
    return StaleBlock("layout '" + claim.layout + "' block " + std::to_string(b) + ": the transfer expects "
                      "generation " + std::to_string(claim.gens[i]) + ", the block is at generation " +
                      std::to_string(g) + " (freed or reused since it was handed out); nothing was transferred");
  }
  return Status::Ok();
}

// Before a read's copy: the table, mapped, and the claim checked against it. nullptr:
// the target shares no table (the caller takes a lease).
Result<std::shared_ptr<RemoteGens>> ShmTransport::check_read_claim(const std::shared_ptr<ShmConn>& c,
                                                                     const GenClaim& claim,
                                                                     Clock::time_point deadline) {
  for (int attempt = 0;; ++attempt) {
    PDKV_ASSIGN_OR_RETURN(auto t, gen_table(c, claim.layout, deadline));
    if (!t) return t;
    bool retired = false;
    Status st = check_gens(*t, claim, false, &retired);
    if (st.ok()) return t;
    if (!retired || attempt > 0) return st;
    // The layout was removed since we mapped its table: ask for the current one.
    auto s = c->lock();
    auto it = s->gen_tables.find(claim.layout);
    if (it != s->gen_tables.end() && it->second == t) s->gen_tables.erase(it);
  }
}

void ShmTransport::end_lease(Job& job) {
  if (job.lease == 0) return;
  (void)job.b->conn->send_frame(Ctl::kLeaseEnd, job.lease, {});  // a dead connection released it already
  job.lease = 0;
}

Result<std::shared_ptr<const PreparedOps>> ShmTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  // No peer I/O here: connecting and confirming regions happen at the first post,
  // so a peer fault fails the transfer rather than the call.
  auto p = std::make_shared<ShmPrepared>();
  p->ps = peer_state(peer);
  p->peer = std::move(peer);
  p->op = op;
  p->extents = std::move(extents);
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

// Binds a prepared transfer to a live connection and the regions confirmed on it;
// every run is checked against the confirmed lengths (copy_ops.h).
Result<std::shared_ptr<const Binding>> ShmTransport::bind(const ShmPrepared& p, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lk(p.mu);
  const Peer& peer = *p.peer;
  if (p.bound) {
    for (auto& r : p.bound->regions)
      if (r->revoked) return NotFound(deregistered(peer.md.name, r->id));
    if (!p.bound->conn->gone()) return p.bound;
  }
  PDKV_ASSIGN_OR_RETURN(auto conn, get_conn(*p.ps, deadline));
  auto b = std::make_shared<Binding>();
  b->conn = conn;
  b->op = p.op;
  b->pid = conn->peer_pid();
  b->ops.reserve(p.extents.size());
  std::unordered_map<uint64_t, uint32_t> index;
  uint64_t last_id = ~0ull;
  uint32_t last_idx = 0;
  for (const auto& e : p.extents) {
    if (e.remote_region != last_id) {
      auto it = index.find(e.remote_region);
      if (it == index.end()) {
        PDKV_ASSIGN_OR_RETURN(auto r, confirm_region(conn, peer, e.remote_region, answer_by(deadline)));
        it = index.emplace(e.remote_region, static_cast<uint32_t>(b->regions.size())).first;
        b->regions.push_back(std::move(r));
      }
      last_id = e.remote_region;
      last_idx = it->second;
    }
    PDKV_RETURN_IF_ERROR(add_run_ops(*b, *b->regions[last_idx], last_idx, e, peer.md.name));
  }
  p.bound = b;
  return std::shared_ptr<const Binding>(b);
}

void ShmTransport::unpin(const Binding& b) {
  for (auto& r : b.regions)
    if (r->inflight.fetch_sub(1) == 1 && r->revoked) ack_revoke_when_idle(r);
}

void ShmTransport::send_notify(const std::shared_ptr<ShmConn>& c, const std::shared_ptr<Transfer>& xfer,
                               const std::string& notif) {
  uint64_t seq;
  {
    auto s = c->lock();
    if (s->dead) {
      Status why = s->dead_reason;
      spi::TransferControl(xfer).resolve_part(0, why.ok() ? ConnectionError("connection closed") : why);
      return;
    }
    seq = s->next_seq++;
    s->notifies[seq] = PendingNotify{xfer, xfer->deadline(), false};
  }
  Status st = c->send_frame(Ctl::kNotify, seq, notif);
  if (!st.ok()) {
    bool mine = false;
    {
      mine = c->lock()->notifies.erase(seq) > 0;
    }
    if (mine) spi::TransferControl(xfer).resolve_part(0, st);
    return;
  }
  if (opts_.notify_on_send) {
    // The whole Notify frame is in the socket, after every byte landed: complete the
    // transfer now. The acknowledgement is still awaited (to its deadline); one that
    // never comes is counted and logged (lose_notifications), not resolved here.
    bool mine = false;
    {
      auto s = c->lock();
      auto it = s->notifies.find(seq);
      if (it != s->notifies.end()) {
        it->second.resolved = true;
        mine = true;
      }
    }
    if (mine) spi::TransferControl(xfer).resolve_part(0, Status::Ok());
  }
  wake_at(xfer->deadline());  // the acknowledgement's deadline, without a thread switch now
}

// A read checked against the target's shared generation table before its copy
// (post) is checked again after it: a bump of a claimed block that the copy could
// have seen the effects of is seen here, and fails the read with StaleBlock (its
// destination bytes are then not valid).
void ShmTransport::finish_job(Job& job, Status st) {
  if (job.b->op == OpKind::kRead) {
    ReadCheck rc;
    {
      std::lock_guard<std::mutex> lk(checks_mu_);
      auto it = read_checks_.find(job.xfer.get());
      if (it != read_checks_.end()) {
        rc = std::move(it->second);
        read_checks_.erase(it);
      }
    }
    if (rc.table && st.ok()) {
      // Every load of the copy happens before the second look at the table.
      std::atomic_thread_fence(std::memory_order_acquire);
      st = check_gens(*rc.table, *rc.claim, true, nullptr);
    }
  }
  complete_job(job, st);
}

void ShmTransport::complete_job(Job& job, Status st) {
  // The bytes are in memory the peer shares with us; fail the transfer if the peer
  // died meanwhile (the progress thread sees its socket close at once).
  if (st.ok() && job.b->conn->gone())
    st = ConnectionError(job.b->conn->desc() + " went away during the transfer");
  // The copy is over: the target may unpin the blocks (before the notification, which
  // follows on the same socket).
  end_lease(job);
  // Resolve the data part before unpinning: unpinning may acknowledge a revoke, and the
  // peer's deregistration returns on that ack; by then this transfer must be terminal.
  spi::TransferControl(job.xfer).resolve_part(st.ok() ? job.b->total : 0, st);
  unpin(*job.b);
  if (job.notif.empty()) return;
  if (!st.ok()) {
    spi::TransferControl(job.xfer).resolve_part(0, Cancelled("notification not sent: the copy failed"));
    return;
  }
  // Data landed: the second part is the acknowledged notification.
  send_notify(job.b->conn, job.xfer, job.notif);
}

void ShmTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const ShmPrepared>(ops);
  spi::TransferControl(xfer).set_parts(notif.empty() ? 1 : 2);
  auto fail = [&](const Status& st) {
    spi::TransferControl(xfer).resolve_part(0, st);
    if (!notif.empty()) spi::TransferControl(xfer).resolve_part(0, Cancelled("notification not sent"));
  };
  auto bound = bind(*prep, xfer->deadline());
  if (!bound.ok()) return fail(bound.status());
  auto b = std::move(bound).value();
  drain_control(b->conn);
  if (b->conn->gone()) {
    // The peer closed the connection before this transfer touched it: dial again, so
    // the dial itself says what happened (StalePeer for a restarted peer,
    // PeerConnectionError for a dead one, NotFound for a revoked region).
    bound = bind(*prep, xfer->deadline());
    if (!bound.ok()) return fail(bound.status());
    b = std::move(bound).value();
    drain_control(b->conn);
  }
  {
    Status dead;
    {
      auto s = b->conn->lock();
      if (s->dead) dead = s->dead_reason.ok() ? ConnectionError("connection closed") : s->dead_reason;
    }
    if (!dead.ok()) return fail(dead);
  }
  for (size_t i = 0; i < b->regions.size(); ++i) {
    auto& r = b->regions[i];
    r->inflight.fetch_add(1);
    if (r->revoked) {
      for (size_t j = 0; j <= i; ++j)
        if (b->regions[j]->inflight.fetch_sub(1) == 1) ack_revoke_when_idle(b->regions[j]);
      return fail(NotFound(deregistered(prep->peer->md.name, r->id)));
    }
  }
  uint64_t lease = 0;
  if (prep->claim && prep->op == OpKind::kRead) {
    // Checked against the target's table now and again after the copy (finish_job).
    auto t = check_read_claim(b->conn, *prep->claim, xfer->deadline());
    if (!t.ok()) {
      unpin(*b);
      return fail(t.status());
    }
    if (*t) {
      std::lock_guard<std::mutex> lk(checks_mu_);
      read_checks_[xfer.get()] = ReadCheck{std::move(*t), prep->claim};
    }
  }
  if (prep->claim && (prep->op != OpKind::kRead || !read_checked(xfer.get()))) {
    // A write (or a read from a target without a shared table) takes a lease first.
    auto l = take_lease(b->conn, prep->claim_wire, xfer->deadline());
    if (!l.ok()) {
      unpin(*b);
      return fail(l.status());
    }
    lease = *l;
  }
  Job job{b, xfer, std::move(notif), lease};
  if (b->total <= opts_.inline_bytes) {
    Status st = run_copies(*b, xfer.get());
    finish_job(job, st);
    return;
  }
  copies_.submit(std::move(job));
}

void ShmTransport::run_job(Job& job) {
  if (spi::TransferControl(job.xfer).cancel_requested())
    return finish_job(job, Cancelled("cancelled before the copy started"));  // ends the lease, drops the read check
  finish_job(job, run_copies(*job.b, job.xfer.get()));
}

void ShmTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto c = get_conn(*peer_state(peer), xfer->deadline());
  if (!c.ok()) {
    spi::TransferControl(xfer).resolve_part(0, c.status());
    return;
  }
  send_notify(*c, xfer, notif);
}

Status ShmTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  const auto by = timeout_s > 0 ? util::deadline_after(timeout_s) : Clock::time_point::max();
  PDKV_ASSIGN_OR_RETURN(auto c, get_conn(*peer_state(peer), by));
  (void)c;
  return Status::Ok();
}

void ShmTransport::drop_peer(const std::string& name) {
  std::shared_ptr<ShmPeerState> ps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    ps = it->second;
    peers_.erase(it);
  }
  std::shared_ptr<ShmConn> c;
  {
    std::lock_guard<std::mutex> lk(ps->mu);
    c = ps->conn;
  }
  if (c) kill(c, ConnectionError("peer '" + name + "' was removed"));
}

namespace {

Status shm_viable() {
  int fd = ::memfd_create("pdkv-probe", MFD_CLOEXEC);
  if (fd < 0) return NotSupported("memfd_create failed: " + util::errno_str(errno));
  ::close(fd);
  return Status::Ok();
}

TransportFactory shm_factory() {
  TransportFactory f;
  f.name = "shm";
  f.description = "same-host shared memory (memfd pools; cross-memory attach otherwise)";
  f.viable = shm_viable;
  f.create = create_with<ShmOptions>([](const AgentConfig&, const ShmOptions& opts) -> Result<std::unique_ptr<Transport>> {
    return std::unique_ptr<Transport>(std::make_unique<ShmTransport>(opts));
  });
  f.priority = 200;
  f.default_options = default_options_of<ShmOptions>;
  return f;
}

bool registered = register_transport(shm_factory());

}  // namespace

}  // namespace pdkv::shm
