// The tcp Transport: start-up and shutdown, prepare, post and cancel, the peers'
// connection slots, and the teardown of a connection. The parts it wires are
// listed in tcp_transport_impl.h.
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "pdkv/spi/registry.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/tcp_transport_impl.h"
#include "util/log.h"

namespace pdkv::tcp {
namespace {

// Failed authentications: the first one from an (address, agent name) is free, then its
// hellos are refused for 0.1 s, 0.2 s, ... up to 10 s (docs/wire.md, guard.h).
constexpr double kAuthBackoffBaseS = 0.1;
constexpr double kAuthBackoffMaxS = 10.0;
constexpr size_t kAuthBackoffSources = 4096;
constexpr uint32_t kAuthFreeFailures = 1;

// The host to publish: the listen host, or for a wildcard bind (0.0.0.0 / ::) the
// first non-loopback address of an interface that is up (peers cannot dial a
// wildcard). Agent.connect() also substitutes the host it actually reached.
std::string advertised_host(const std::string& listen) {
  if (listen != "0.0.0.0" && listen != "::" && listen != "[::]") return listen;
  const bool v6 = listen != "0.0.0.0";
  ifaddrs* ifs = nullptr;
  std::string found;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i && found.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      char buf[INET6_ADDRSTRLEN] = {0};
      if (i->ifa_addr->sa_family == AF_INET && !v6) {
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
        found = buf;
      } else if (i->ifa_addr->sa_family == AF_INET6 && v6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
        if (IN6_IS_ADDR_LINKLOCAL(&a->sin6_addr)) continue;
        inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
        found = buf;
      }
    }
    ::freeifaddrs(ifs);
  }
  if (found.empty()) found = v6 ? "::1" : "127.0.0.1";
  PDKV_LOG_INFO("tcp: listening on %s, advertising %s", listen.c_str(), found.c_str());
  return found;
}

// Raw bytes per batch of a write that may be compressed: the codec chunk, in whole
// FP8 scale groups (or rows) when FP8 may be chosen, so every frame is whole rows.
// At most `cap` bytes (device memory: a staging chunk); 0 when a row does not fit.
uint64_t compressed_batch_bytes(const TcpCompression& o, uint64_t cap = UINT64_MAX) {
  const uint64_t chunk = std::min<uint64_t>(o.chunk_bytes, cap);
  const bool fp8 = o.mode == CompressMode::kFp8 || (o.mode == CompressMode::kAuto && o.policy == CompressPolicy::kLossyAllowed);
  if (!fp8) return chunk;
  const uint64_t row = uint64_t(o.fp8.heads) * o.fp8.head_dim * dtype_size(o.dtype);
  const uint64_t group = row * o.fp8.rows_per_group;
  const uint64_t unit = group <= chunk ? group : row;  // validate() keeps row <= chunk_bytes
  return chunk / unit * unit;
}

}  // namespace

// ---------------------------------------------------------------- life

TcpTransport::TcpTransport(const TcpOptions& opts)
    : opts_(opts),
      staging_(*this, opts.stage_chunk_bytes, opts.stage_buffers),
      backoff_(kAuthBackoffBaseS, kAuthBackoffMaxS, kAuthBackoffSources, kAuthFreeFailures),
      admission_(opts.max_inbound_conns, opts.max_inbound_per_peer) {
  // Always there: a transfer may ask for compression with the agent's mode off, and
  // peers may ask for compressed read responses (its threads start on first use).
  encoder_ = std::make_unique<Encoder>(opts_.compress, opts_.gather_below_bytes);
}

TransportCaps TcpTransport::caps() const {
  TransportCaps c;
  c.local_mem_kinds = mem_kinds();
  c.remote_mem_kinds = mem_kinds();
  c.generations = true;
  c.serves_metadata = true;
  c.strided_extents = true;  // kFlagStrided frames to peers that take them, plain pieces to the others
  // kFlagStrided2 frames to peers that take them, one-level descriptors to the others
  // (off under the benchmark switch BenchSwitch::kTcpOneLevel=1: the agent expands them).
  c.two_level_extents = two_level_wire_allowed();
  return c;
}

Status TcpTransport::start(AgentHooks* hooks) {
  hooks_ = hooks;
  PDKV_RETURN_IF_ERROR(opts_.validate());  // AgentConfig::validate() checked it too; a transport created alone is not
  util::HostPort hp{opts_.listen_host, opts_.listen_port};
  uint16_t port = 0;
  PDKV_ASSIGN_OR_RETURN(listen_fd_, util::listen_tcp(hp, &port));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(listen_fd_.get(), true));
  addr_ = util::HostPort{advertised_host(opts_.listen_host), port};
  if (opts_.tls) {
    PDKV_ASSIGN_OR_RETURN(tls_, TlsContext::create());
  }
  for (uint32_t i = 0; i < opts_.progress_threads; ++i) {
    threads_.push_back(std::make_unique<ProgressThread>(this, opts_.spin_us));
    PDKV_RETURN_IF_ERROR(threads_.back()->start(i == 0 ? listen_fd_.get() : -1));
  }
  return Status::Ok();
}

void TcpTransport::shutdown() {
  if (shut_.exchange(true)) return;
  encoder_->stop();  // queued encodes fail fast once shut_ is set; later batches fail in pump_encodes
  staging_.stop();  // queued tasks fail fast once shut_ is set
  decoder_.stop();  // queued decodes finish (their acks go out before the progress threads stop)
  for (auto& t : threads_) t->stop();
  std::lock_guard<std::mutex> lk(mu_);
  peers_.clear();
}

void TcpTransport::log_rejected(const std::string& line) {
  if (util::log_level() < util::LogLevel::kWarn) return;
  uint64_t held = 0;
  if (!reject_log_.allow(Clock::now(), &held)) return;
  if (held > 0) {
    PDKV_LOG_WARN("%s (%llu similar lines suppressed in the last second)", line.c_str(),
                  static_cast<unsigned long long>(held));
  } else {
    PDKV_LOG_WARN("%s", line.c_str());
  }
}

// ---------------------------------------------------------------- prepare

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  return prepare_with(std::move(peer), op, std::move(extents), nullptr, TransferHints{});
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare_with(std::shared_ptr<const Peer> peer, OpKind op,
                                                                      std::vector<ResolvedExtent> extents,
                                                                      std::shared_ptr<const GenClaim> claim,
                                                                      const TransferHints& hints) {
  if (!peer->md.find_endpoint("tcp"))
    return NotSupported("peer '" + peer->md.name + "' publishes no tcp endpoint");
  TcpCompression z = opts_.compress;
  if (hints.compress) {
    z.mode = *hints.compress;
    // The agent's codec options were checked for its own mode, not this one (FP8 rows
    // against chunk_bytes).
    Status valid = z.validate();
    if (!valid.ok())
      return InvalidArgument("compress='" + std::string(compress_mode_name(z.mode)) +
                             "' does not fit the agent's tcp.compress options: " + valid.message());
  }
  auto p = std::make_shared<TcpPrepared>();
  p->peer = std::move(peer);
  p->op = op;
  p->zmode = z.mode;
  uint64_t batch_bytes = opts_.batch_bytes;
  for (const auto& e : extents)
    if (e.local_kind == MemKind::kCuda) {
      p->staged = true;
      p->device = e.local_device;
      break;
    }
  if (p->staged) {
    // Batches are staged through pinned chunks: no batch may exceed one.
    PDKV_ASSIGN_OR_RETURN(auto st, staging_.stager());
    batch_bytes = std::min(batch_bytes, st->chunk());
    if (z.mode != CompressMode::kOff && device_may_compress(z, p->device)) {
      // A compressed write's frames, or a compressed read's responses: codec chunks of
      // whole fp8 groups.
      batch_bytes = compressed_batch_bytes(z, st->chunk());
      if (batch_bytes == 0)
        return InvalidArgument("tcp stage_chunk_bytes (" + std::to_string(st->chunk()) +
                               ") is smaller than one fp8 row of the compressed device " +
                               (op == OpKind::kWrite ? "write" : "read"));
    }
  } else if (z.mode != CompressMode::kOff) {
    // Batches of a transfer that may be compressed are codec chunks: the pipeline
    // unit (a write's frames; a read's requests, each answered by one response).
    const uint64_t chunked = std::min(batch_bytes, compressed_batch_bytes(z));
    if (z.mode == CompressMode::kAuto && chunked < batch_bytes) {
      // auto may send it plain: then in plain-sized batches (1 MiB batches cost a
      // loopback write a third of its speed in acks and frames).
      auto plain = std::make_shared<TcpPrepared>();
      plain->peer = p->peer;
      plain->op = op;
      plain->zmode = z.mode;
      PDKV_RETURN_IF_ERROR(cut_batches(*plain, extents, batch_bytes));
      p->plain = std::move(plain);
    }
    batch_bytes = chunked;
  }
  PDKV_RETURN_IF_ERROR(cut_batches(*p, extents, batch_bytes));
  if (claim) {
    p->claim_aux = encode_claim_aux(encode_claim(*claim));
    if (p->plain) p->plain->claim_aux = p->claim_aux;
  }
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

// Strided runs go out as strided descriptors to a peer that takes them, two-level
// runs as two-level descriptors to a peer that takes those (else one one-level
// descriptor per repetition); to an older peer each run is expanded into one plain
// descriptor per piece.
Status TcpTransport::cut_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                 uint64_t batch_bytes) const {
  bool has_runs = false, has_two_level = false;
  for (const ResolvedExtent& e : extents) {
    has_runs |= e.count > 1 || e.count2 > 1;
    has_two_level |= e.count2 > 1;
  }
  const PeerFeatures f = peer_features(*p.peer);
  p.strided = has_runs && f.strided_extents;
  p.two_level = p.strided && has_two_level && f.two_level_extents && two_level_wire_allowed();
  if (p.strided && has_two_level && !p.two_level)
    cut_strided_batches(p, expand_two_level(extents), batch_bytes);
  else if (p.strided)
    cut_strided_batches(p, extents, batch_bytes);
  else if (has_runs)
    cut_plain_batches(p, expand_strided(extents), batch_bytes);
  else
    cut_plain_batches(p, extents, batch_bytes);
  constexpr uint64_t kMaxEntries = 0xFFFFFFFFull;  // batches index them with u32
  if (p.iov.size() > kMaxEntries || p.runs.size() > kMaxEntries || p.descs.size() > kMaxEntries ||
      p.sdescs.size() > kMaxEntries || p.sdescs2.size() > kMaxEntries)
    return InvalidArgument("transfer has too many extents");
  return Status::Ok();
}

PeerFeatures TcpTransport::peer_features(const Peer& peer) {
  for (const auto& [transport, extra] : peer.md.extras)
    if (transport == "tcp") return decode_extra(extra);
  return PeerFeatures{};
}

// A batch of small extents is gathered into one segment (out_msg.h), so it is not
// bound by the iovec limit behind batch_extents: it may grow to kMaxGatherExtents.
// Staged (device) batches go through one pinned buffer either way.
bool TcpTransport::batch_full(const TcpPrepared& p, const TcpBatch& cur) const {
  const uint64_t n = p.lazy && !p.staged ? cur.extents : cur.count;  // staged: gathered by runs
  if (n == 0) return false;
  if (n < opts_.batch_extents) return false;
  return p.staged || !gathers(cur.bytes, n, opts_.gather_below_bytes) || n >= kMaxGatherExtents;
}

void TcpTransport::cut_plain_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                     uint64_t batch_bytes) const {
  size_t n = 0;
  for (const auto& e : extents) n += (e.len + batch_bytes - 1) / batch_bytes;
  p.descs.reserve(n);
  p.iov.reserve(n);
  TcpBatch cur;
  auto close_batch = [&] {
    if (cur.count) p.batches.push_back(cur);
    const auto at = static_cast<uint32_t>(p.descs.size());
    cur = TcpBatch{at, 0, 0, at, 0, 0};
  };
  for (const auto& e : extents) {
    uint64_t off = 0;
    while (off < e.len) {
      uint64_t room = batch_bytes - cur.bytes;
      if (room == 0 || batch_full(p, cur)) {
        close_batch();
        room = batch_bytes;
      }
      uint64_t len = std::min(e.len - off, room);
      p.descs.push_back(WireExtent{e.remote_region, e.remote_offset + off, len});
      p.iov.push_back({reinterpret_cast<void*>(e.local_addr + off), len});
      ++cur.count;
      ++cur.desc_count;
      ++cur.pieces;
      cur.bytes += len;
      p.total += len;
      off += len;
    }
  }
  close_batch();
}

// Strided runs become strided descriptors, cut between batches at piece boundaries
// (a piece larger than a batch is cut like a plain extent). From host memory the
// local side stays a run per descriptor (p.lazy): prepare is O(runs). So does device
// memory: the strided-copy kernel gathers a write's runs into the pinned buffer and
// copies a read response out to them (cuda/strided_copy.h). Compressed device writes
// (their encoder walks iovecs) keep one iovec per piece.
void TcpTransport::cut_strided_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                       uint64_t batch_bytes) const {
  p.lazy = lazy_runs_allowed() &&
           (!p.staged || (cuda::strided_kernel_enabled() && (p.op == OpKind::kRead || p.zmode == CompressMode::kOff)));
  if (p.two_level) {
    p.sdescs2.reserve(extents.size());
  } else {
    p.sdescs.reserve(extents.size());
  }
  if (p.lazy) {
    p.runs.reserve(extents.size());
  } else {
    p.iov.reserve(extents.size());
  }
  auto ndescs = [&] { return p.two_level ? p.sdescs2.size() : p.sdescs.size(); };
  TcpBatch cur;
  auto close_batch = [&] {
    if (cur.count) p.batches.push_back(cur);
    const size_t local = p.lazy ? p.runs.size() : p.iov.size();
    cur = TcpBatch{static_cast<uint32_t>(local), 0, 0, static_cast<uint32_t>(ndescs()), 0, 0};
  };
  auto full = [&] {
    return cur.count > 0 && (batch_full(p, cur) || cur.pieces >= kMaxStridedPieces ||
                             cur.desc_count >= kMaxExtentsPerFrame);
  };
  // Repetitions [rep, rep + k2) of pieces [first, first + k) of `e` (each piece from
  // byte `off`, `len` bytes) as one descriptor of the current batch.
  auto add = [&](const ResolvedExtent& e, uint64_t first, uint64_t k, uint64_t off, uint64_t len, uint64_t rep,
                 uint64_t k2) {
    const uint64_t rstride = k > 1 ? e.remote_stride : 0;
    const uint64_t rstride2 = k2 > 1 ? e.remote_stride2 : 0;
    const uint64_t roff = e.remote_offset + rep * e.remote_stride2 + first * e.remote_stride + off;
    if (p.two_level) {
      p.sdescs2.push_back(WireStrided2Extent{e.remote_region, roff, len, k, rstride, k2, rstride2});
    } else {
      p.sdescs.push_back(WireStridedExtent{e.remote_region, roff, len, k, rstride});
    }
    const uint64_t local = e.local_addr + rep * e.local_stride2 + first * e.local_stride + off;
    const PieceRun run = make_run(reinterpret_cast<char*>(local), len, k, e.local_stride, k2, e.local_stride2);
    if (p.lazy) {
      p.runs.push_back(run);
      ++cur.count;
      cur.extents += run.extents();
    } else {
      const size_t before = p.iov.size();
      append_iovecs(&run, 1, p.iov);
      cur.count += static_cast<uint32_t>(p.iov.size() - before);
    }
    ++cur.desc_count;
    cur.pieces += k * k2;
    cur.bytes += k * k2 * len;
    p.total += k * k2 * len;
  };
  // Repetition `rep` of `e` as one-level descriptors.
  auto add_level = [&](const ResolvedExtent& e, uint64_t rep) {
    if (e.len > batch_bytes || e.count == 1) {  // piece by piece, each cut by bytes like a plain extent
      for (uint64_t i = 0; i < e.count; ++i)
        for (uint64_t off = 0; off < e.len;) {
          if (cur.bytes == batch_bytes || full()) close_batch();
          const uint64_t len = std::min(e.len - off, batch_bytes - cur.bytes);
          add(e, i, 1, off, len, rep, 1);
          off += len;
        }
      return;
    }
    for (uint64_t done = 0; done < e.count;) {
      if (batch_bytes - cur.bytes < e.len || full()) close_batch();
      const uint64_t k = std::min({e.count - done, (batch_bytes - cur.bytes) / e.len, kMaxStridedPieces - cur.pieces});
      add(e, done, k, 0, e.len, rep, 1);
      done += k;
    }
  };
  for (const auto& e : extents) {
    const uint64_t rep_bytes = e.count * e.len;  // no overflow: the agent checked the run's span
    if (e.count2 == 1 || rep_bytes > batch_bytes || e.count > kMaxStridedPieces) {
      for (uint64_t j = 0; j < e.count2; ++j) add_level(e, j);
      continue;
    }
    // Whole repetitions at a time: as many as the batch has room for.
    for (uint64_t j = 0; j < e.count2;) {
      if (batch_bytes - cur.bytes < rep_bytes || kMaxStridedPieces - cur.pieces < e.count || full()) close_batch();
      const uint64_t k2 = std::min({e.count2 - j, (batch_bytes - cur.bytes) / rep_bytes,
                                    (kMaxStridedPieces - cur.pieces) / e.count});
      add(e, 0, e.count, 0, e.len, j, k2);
      j += k2;
    }
  }
  close_batch();
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                         std::vector<ResolvedExtent> extents,
                                                                         std::shared_ptr<const GenClaim> claim) {
  return prepare_with(std::move(peer), op, std::move(extents), std::move(claim), TransferHints{});
}

// ---------------------------------------------------------------- peers and their connection slots

Result<std::shared_ptr<PeerConns>> TcpTransport::peer_conns(const std::shared_ptr<const Peer>& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(peer->md.name);
  if (it != peers_.end() && it->second->peer->md.instance_id == peer->md.instance_id) return it->second;
  const Endpoint* ep = peer->md.find_endpoint("tcp");
  if (!ep) return NotSupported("peer '" + peer->md.name + "' publishes no tcp endpoint");
  PDKV_ASSIGN_OR_RETURN(util::HostPort hp, util::parse_host_port(ep->address));
  auto pc = std::make_shared<PeerConns>(peer->md.name);
  pc->peer = peer;
  for (const auto& [transport, extra] : peer->md.extras)
    if (transport == "tcp") pc->features = decode_extra(extra);
  pc->hp = hp;
  pc->conns.resize(opts_.conns_per_peer);
  if (it != peers_.end()) {
    // The peer restarted: connections to the old instance are useless.
    auto old = it->second;
    std::vector<std::shared_ptr<TcpConn>> cs;
    {
      std::lock_guard<std::mutex> lk2(old->mu);
      cs = old->conns;
    }
    request_kills(cs, StalePeer("peer '" + peer->md.name + "' was replaced by a new instance"));
  }
  peers_[peer->md.name] = pc;
  return pc;
}

void TcpTransport::request_kills(const std::vector<std::shared_ptr<TcpConn>>& cs, const Status& why) {
  for (auto& c : cs)
    if (c && c->owner()) {
      c->set_kill_reason(why);
      c->owner()->request_kill(c);
    }
}

Result<std::shared_ptr<TcpConn>> TcpTransport::get_conn(PeerConns& pc, uint32_t slot, bool may_connect,
                                                        Clock::time_point deadline) {
  std::lock_guard<std::mutex> lk(pc.mu);
  auto& c = pc.conns[slot];
  if (c && !c->is_dead()) return c;
  if (!may_connect) return ConnectionError("no open connection to peer '" + pc.peer->md.name + "'");
  if (shut_) return ConnectionError("agent is shutting down");
  // (Another post may have dialled this slot while we waited for pc.mu, up to its
  // own deadline: ours is checked again here.)
  double timeout_s = opts_.connect_timeout_s;
  if (deadline != Clock::time_point::max()) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0)
      return TimeoutError("the transfer's deadline passed before a connection to peer '" + pc.peer->md.name + "' at " +
                          pc.hp.str() + " was made");
    timeout_s = std::min(timeout_s, left);
  }
  std::string name;
  std::shared_ptr<TlsChannel> tls;
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd,
                        dial(pc.hp, HelloParams{hooks_->agent_name(), pc.peer->md.name, pc.peer->md.instance_id,
                                                auth::derive_key(pc.peer->secret), tls_},
                             timeout_s, &name, &tls));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(fd.get(), true));
  ProgressThread* owner = pick_thread();
  auto conn = TcpConn::dialled(fd.release(), owner, "peer '" + pc.peer->md.name + "' at " + pc.hp.str(), name,
                               pc.weak_from_this(), slot);
  conn->set_tls(std::move(tls));
  c = conn;
  owner->add(conn, false);
  return conn;
}

Status TcpTransport::connect(std::shared_ptr<const Peer> peer, double timeout_s) {
  PDKV_ASSIGN_OR_RETURN(auto pc, peer_conns(peer));
  const auto deadline = timeout_s > 0 ? util::deadline_after(timeout_s) : Clock::time_point::max();
  for (uint32_t i = 0; i < opts_.conns_per_peer; ++i) {
    auto c = get_conn(*pc, i, true, deadline);
    if (!c.ok()) return c.status();
  }
  return Status::Ok();
}

void TcpTransport::drop_peer(const std::string& name) {
  std::shared_ptr<PeerConns> pc;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    pc = it->second;
    peers_.erase(it);
  }
  std::vector<std::shared_ptr<TcpConn>> cs;
  {
    std::lock_guard<std::mutex> lk(pc->mu);
    cs = pc->conns;
  }
  request_kills(cs, ConnectionError("peer '" + name + "' was removed"));
}

Result<std::string> TcpTransport::fetch_metadata(const std::string& address, std::string_view secret,
                                                 double timeout_s) {
  PDKV_ASSIGN_OR_RETURN(util::HostPort hp, util::parse_host_port(address));
  const auto deadline = util::deadline_after(timeout_s);
  std::shared_ptr<TlsChannel> tls;  // outlives the fd's use below
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, dial(hp, HelloParams{hooks_->agent_name(), "", 0, auth::derive_key(secret), tls_},
                                                timeout_s, nullptr, &tls));
  return request_metadata(fd.get(), address, deadline);
}

// ---------------------------------------------------------------- connection teardown

void TcpTransport::kill(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit) {
  auto rl = c->lock_rx();  // the receive state is reset
  kill_locked(c, why, culprit);
}

void TcpTransport::kill_locked(const std::shared_ptr<TcpConn>& c, const Status& why, uint64_t culprit) {
  std::unordered_map<uint64_t, PendingPart> pend;
  std::deque<std::unique_ptr<OutMsg>> sq;
  if (!c->retire(&pend, &sq)) return;
  c->abandon_rx();  // no device copy may land after this
  c->leave_slot();
  if (why.code() != StatusCode::kOk && !why.message().empty() && why.code() != StatusCode::kConnectionError)
    PDKV_LOG_DEBUG("connection to %s closed: %s", c->desc().c_str(), why.to_string().c_str());
  sq.clear();  // releases pins of unsent read responses
  for (auto& [k, part] : pend) {
    Status st = why;
    if (culprit && part.post->xfer->id() != culprit && why.code() == StatusCode::kTimeout)
      st = ConnectionError("connection to " + c->desc() + " was closed because transfer " + std::to_string(culprit) +
                           " on it timed out");
    resolve(part, 0, st);
  }
  // Stop reading and writing; linger briefly so an error frame we sent is read
  // before the peer sees a reset.
  c->start_draining(std::chrono::milliseconds(500));
}

Status TcpTransport::admit(const std::shared_ptr<TcpConn>& c, const std::string& name) {
  if (c->outbound() || c->admitted()) return Status::Ok();
  PDKV_ASSIGN_OR_RETURN(auto ticket, admission_.admit(name));
  c->hold(std::move(ticket));
  c->set_admitted();
  return Status::Ok();
}

void TcpTransport::fail_conn_locked(const std::shared_ptr<TcpConn>& c, const Status& st, uint64_t xfer,
                                    uint32_t batch) {
  log_rejected("closing " + c->desc() + ": " + st.to_string());
  OutMsg m = error_frame(st, xfer, batch);
  c->send_if_idle(m);  // best effort: tell the peer why, unless output is already queued
  kill_locked(c, st);
}

// ---------------------------------------------------------------- posting

void TcpTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const TcpPrepared>(ops);
  auto pcr = peer_conns(prep->peer);
  if (!pcr.ok()) {
    spi::TransferControl(xfer).fail_now(pcr.status());
    return;
  }
  bool sample = false;
  auto choice = choose_compression(*prep, **pcr, &sample);
  if (!choice.ok()) {
    spi::TransferControl(xfer).fail_now(choice.status());
    return;
  }
  const TcpCompression z = compression_of(*prep);
  if (!choice->compress && prep->plain) prep = prep->plain;  // auto chose plain: plain-sized batches
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->prep = prep;
  post->pc = *pcr;
  post->notif = std::move(notif);
  post->sample_codec = sample;
  const uint32_t nconn = opts_.conns_per_peer;
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  const uint32_t base = post->pc->rr.fetch_add(1, std::memory_order_relaxed);
  const bool spread = nconn > 1 && nb > 1;
  post->compress = *choice;
  post->reads_unsettled = nb;
  if (post->compress.compress && prep->op == OpKind::kRead) {
    post->zspec = make_zspec(z, post->compress.kind);
  } else if (post->compress.compress) {
    // (A read says so when a compressed response lands: the target may answer plain.)
    spi::TransferControl(xfer).set_compression(codec_kind_name(post->compress.kind).data());
  }
  // Compressed batches may leave out of order (several encoder threads): the
  // notification then follows the last ack, as for a spread transfer.
  const bool unordered = post->compress.compress && nb > 1;
  post->separate_notif = !post->notif.empty() && (prep->op == OpKind::kRead || spread || unordered);
  post->data_left = nb;
  spi::TransferControl(xfer).set_parts(nb + (post->separate_notif ? 1 : 0));
  std::weak_ptr<TcpPost> wp = post;
  spi::TransferControl(xfer).set_cancel_hook([this, wp] {
    if (auto p = wp.lock()) cancel(p);
  });
  if (post->compress.compress && prep->op == OpKind::kWrite) {
    post->zbase = base;
    return pump_encodes(post);
  }
  for (uint32_t i = 0; i < nb; ++i) {
    const uint32_t slot = (base + i) % nconn;
    if (prep->staged && prep->op == OpKind::kWrite) {
      staging_.run([this, post, i, slot] { stage_and_send(post, i, slot); });
    } else {
      send_batch(post, i, slot, nullptr);
    }
  }
}

void TcpTransport::send_batch(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot,
                              std::shared_ptr<cuda::PinnedBuffer> staged, std::shared_ptr<EncodedBatch> encoded,
                              std::shared_ptr<void> ticket) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  PendingPart part{post, i, b.bytes};
  if (prep->op == OpKind::kRead && prep->lazy) {
    part.runs = &prep->runs[b.first];
    part.nruns = b.count;
    part.extents = b.extents;
  } else if (prep->op == OpKind::kRead) {
    part.dst = &prep->iov[b.first];
    part.ndst = b.count;
    part.extents = b.count;
  }
  Status connect_err;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    connect_err = post->connect_err;
  }
  if (!connect_err.ok() || spi::TransferControl(xfer).cancel_requested()) {
    resolve(part, 0, connect_err.ok() ? Cancelled("cancelled") : connect_err);
    return;
  }
  auto cr = get_conn(*post->pc, slot, true, xfer->deadline());
  if (!cr.ok()) {
    {
      std::lock_guard<std::mutex> lk(post->mu);
      post->connect_err = cr.status();
    }
    resolve(part, 0, cr.status());
    return;
  }
  auto& conn = *cr;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    post->conns.push_back(conn);
  }
  const bool compressed = encoded != nullptr;  // (posted from an encoder thread: no driver for wait())
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(prep->op == OpKind::kWrite ? FrameType::kWrite : FrameType::kReadReq, xfer->id(), i);
  m->hdr.count = b.desc_count;
  if (prep->two_level) {
    m->hdr.flags |= kFlagStrided2;
    m->descs = &prep->sdescs2[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireStrided2Extent);
  } else if (prep->strided) {
    m->hdr.flags |= kFlagStrided;
    m->descs = &prep->sdescs[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireStridedExtent);
  } else {
    m->descs = &prep->descs[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireExtent);
  }
  if (prep->op == OpKind::kWrite) {
    m->hdr.payload = b.bytes;
    m->gather_below = opts_.gather_below_bytes;
    if (encoded) {
      m->hdr.type = static_cast<uint16_t>(FrameType::kWriteZ);
      m->hdr.payload = encoded->bytes.size();
      m->own_iov.push_back({encoded->bytes.data(), encoded->bytes.size()});
      // Released once the frame left (or was dropped): the buffer goes back, the ticket
      // lets the next batch of this write be encoded.
      m->lease = std::make_shared<std::pair<std::shared_ptr<EncodedBatch>, std::shared_ptr<void>>>(std::move(encoded),
                                                                                                 std::move(ticket));
    } else if (staged) {
      m->own_iov.push_back({staged->data(), b.bytes});
      m->lease = std::move(staged);
    } else if (prep->lazy) {
      m->runs = &prep->runs[b.first];
      m->nruns = b.count;
    } else {
      m->data = &prep->iov[b.first];
      m->ndata = b.count;
    }
  }
  if (!prep->claim_aux.empty()) {
    m->hdr.flags |= kFlagGens;
    m->aux = prep->claim_aux;
  }
  const bool zreply = prep->op == OpKind::kRead && post->compress.compress;
  if (zreply) {  // the spec follows the claim (docs/wire.md, "Compressed reads")
    m->hdr.flags |= kFlagZReply;
    m->aux.append(reinterpret_cast<const char*>(&post->zspec), sizeof post->zspec);
  }
  if (prep->op == OpKind::kWrite && !post->separate_notif && !post->notif.empty() && i == nb - 1 &&
      !post->data_failed) {
    m->hdr.flags |= kFlagNotif;
    m->aux += post->notif;
  }
  m->keep = prep;
  m->finalize();
  if (prep->op == OpKind::kWrite) spi::TransferControl(xfer).add_wire_bytes(m->hdr.payload);
  if (!conn->track(std::move(part), xfer->id())) {
    resolve(PendingPart{post, i, b.bytes}, 0, ConnectionError("connection to " + conn->desc() + " closed"));
    return;
  }
  if (nb == 1 && !prep->staged && !compressed && !zreply) {
    // Small transfers: the caller's wait() reads the ack itself (one thread hop
    // fewer, the latency of a plain socket round trip). Not for device memory: the
    // caller's thread would have to bind a CUDA context.
    std::weak_ptr<TcpConn> wc = conn;
    spi::TransferControl(xfer).set_driver([this, wc](Transfer& x, Clock::time_point deadline, uint32_t spin_us) {
      if (auto c = wc.lock()) drive(c, x, deadline, spin_us);
    });
  }
  conn->owner()->enqueue(conn, std::move(m));
  conn->owner()->wake_if_idle();  // so it spins for the ack and enforces the deadline
}

void TcpTransport::stage_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  auto fail = [&](const Status& st) {
    post->data_failed = true;
    resolve(PendingPart{post, i, b.bytes}, 0, st);
  };
  if (shut_) return fail(ConnectionError("agent is shutting down"));
  if (spi::TransferControl(xfer).cancel_requested()) return fail(Cancelled("cancelled"));
  if (post->data_failed) return fail(Cancelled("an earlier batch of this transfer failed"));
  auto abandon = [&] { return spi::TransferControl(xfer).cancel_requested() || shut_.load(); };
  auto buf = prep->lazy ? staging_.gather_runs(prep->device, &prep->runs[b.first], b.count, xfer->deadline(), abandon)
                        : staging_.gather(prep->device, &prep->iov[b.first], b.count, xfer->deadline(), abandon);
  if (!buf.ok()) return fail(buf.status());
  send_batch(post, i, slot, std::move(buf).value());
}

void TcpTransport::resolve(const PendingPart& p, uint64_t bytes, const Status& st) {
  const auto& post = p.post;
  if (post->separate_notif && p.batch != kNotifyBatch) {
    if (!st.ok()) post->data_failed = true;
    const bool last_data = post->data_left.fetch_sub(1, std::memory_order_acq_rel) == 1;
    settle(post, p.batch, bytes, st);
    if (last_data) {
      if (post->data_failed || spi::TransferControl(post->xfer).cancel_requested()) {
        spi::TransferControl(post->xfer).resolve_part(0, Cancelled("notification not sent: the data did not all land"));
      } else {
        send_separate_notify(post);
      }
    }
    return;
  }
  settle(post, p.batch, bytes, st);
}

void TcpTransport::settle(const std::shared_ptr<TcpPost>& post, uint32_t batch, uint64_t bytes, const Status& st) {
  if (post->prep && post->prep->op == OpKind::kRead && batch != kNotifyBatch && settle_read(post, bytes, st)) return;
  if (!spi::TransferControl(post->xfer).resolve_part(bytes, st)) return;
  // A plain write that completed measures the link to its peer (compression kAuto).
  if (!post->prep || post->prep->op != OpKind::kWrite || post->compress.compress) return;
  if (post->prep->zmode != CompressMode::kAuto || post->xfer->state() != XferState::kDone) return;
  post->pc->chooser.plain_delivered(post->prep->total, post->posted);
}

bool TcpTransport::settle_read(const std::shared_ptr<TcpPost>& post, uint64_t bytes, const Status& st) {
  if (!st.ok()) post->read_failed = true;
  if (post->reads_unsettled.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;  // not the last
  const TcpPrepared& prep = *post->prep;
  if (post->compress.compress || prep.zmode != CompressMode::kAuto || post->read_failed) return false;
  post->pc->read_chooser.plain_delivered(prep.total, post->posted);
  if (!post->sample_codec || prep.batches.empty()) return false;
  // Not on this (progress) thread: a sample costs a chunk's encode and decode.
  return encoder_->post([this, post, bytes, st] {
    const TcpPrepared& p = *post->prep;
    const CodecKind kind = codec_for_mode(compression_of(p), post->pc->features.codecs);
    std::vector<iovec> scratch;
    uint32_t n = 0;
    const iovec* iov = iovecs_of(p, p.batches[0], scratch, &n);
    encoder_->calibrate(kind, iov, n, /*again=*/true);
    spi::TransferControl(post->xfer).resolve_part(bytes, st);
  });
}

// ---------------------------------------------------------------- compression

TcpCompression TcpTransport::compression_of(const TcpPrepared& prep) const {
  TcpCompression z = opts_.compress;
  z.mode = prep.zmode;
  return z;
}

// Device memory: forced modes compress; auto only with FP8 kernels on a real GPU
// (device_staging.h; a lossless codec would run on the host after staging).
bool TcpTransport::device_may_compress(const TcpCompression& z, int device) {
  if (z.mode != CompressMode::kAuto) return true;
  return z.policy == CompressPolicy::kLossyAllowed && staging_.gpu_fp8_on_hardware(device);
}

Result<Choice> TcpTransport::choose_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample) {
  if (prep.zmode == CompressMode::kOff || prep.batches.empty()) return Choice{};
  if (prep.op == OpKind::kRead) {
    if (!prep.staged) return choose_read_compression(prep, pc, sample);
    // Into device memory: forced modes ask as for host memory (the response is decoded
    // on the GPU for fp8, on the host then copied in otherwise); auto only for FP8
    // with real GPU kernels, once a plain read measured the link (as writes), and
    // never a codec sample (that would read device memory on the host).
    const TcpCompression o = compression_of(prep);
    if (o.mode != CompressMode::kAuto) {
      bool no_sample = false;
      return choose_read_compression(prep, pc, &no_sample);
    }
    const PeerFeatures& f = pc.features;
    const bool peer_fp8 = f.compressed_read && ((f.codecs >> static_cast<unsigned>(CodecKind::kFp8)) & 1u);
    if (!peer_fp8 || !device_may_compress(o, prep.device) || pc.read_chooser.link_bps() == 0) return Choice{};
    return Choice{true, CodecKind::kFp8};
  }
  const TcpCompression o = compression_of(prep);
  const PeerFeatures& f = pc.features;
  const std::string& peer = pc.peer->md.name;
  auto decodes = [&](CodecKind k) { return f.compressed_write && ((f.codecs >> static_cast<unsigned>(k)) & 1u); };
  if (o.mode == CompressMode::kAuto && prep.staged) {
    // The GPU quantizes at device-memory speed, far above a socket: FP8 wins whenever
    // the peer decodes it, once a plain write has measured the link.
    if (!decodes(CodecKind::kFp8) || !device_may_compress(o, prep.device) || pc.chooser.link_bps() == 0)
      return Choice{};
    return Choice{true, CodecKind::kFp8};
  }
  if (o.mode == CompressMode::kAuto) {
    if (!f.compressed_write) return Choice{};  // an older peer: plain, as it expects
    const CodecKind k = codec_for_mode(o, f.codecs);
    std::vector<iovec> scratch;
    uint32_t n = 0;
    const iovec* iov = iovecs_of(prep, prep.batches[0], scratch, &n);
    encoder_->calibrate(k, iov, n, pc.chooser.resample_due());
    return pc.chooser.choose(*encoder_, k, f.codecs, CodecPipeline{encoder_->threads(), f.decode_threads});
  }
  const CodecKind k = o.mode == CompressMode::kFp8 ? CodecKind::kFp8 : o.codec;
  if (!f.compressed_write)
    return NotSupported("peer '" + peer + "' does not accept compressed writes (an older pdkv: its metadata has no "
                        "tcp features); set tcp.compress.mode to 'auto' or 'off' for it");
  if (!decodes(k))
    return NotSupported("peer '" + peer + "' cannot decode " + std::string(codec_kind_name(k)) +
                        " frames (its build lacks that library)");
  return Choice{true, k};
}

// A read asks; the target answers compressed or plain. So a peer that cannot answer
// compressed (an older pdkv, or one lacking the codec) is simply read plain, whatever
// the mode; kAuto decides from the delivered rate of plain reads from that peer (the
// initiator waits for the whole round trip, so its measure is the one that counts)
// and this agent's codec figures (sampled on bytes read from that peer).
Choice TcpTransport::choose_read_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample) {
  const TcpCompression o = compression_of(prep);
  const PeerFeatures& f = pc.features;
  const CodecKind k = codec_for_mode(o, f.codecs);
  if (!f.compressed_read || !((f.codecs >> static_cast<unsigned>(k)) & 1u)) return Choice{};
  if (o.mode != CompressMode::kAuto) return Choice{true, k};
  const bool due = pc.read_chooser.resample_due() || encoder_->figures(k).encode_bps == 0;
  const Choice c = pc.read_chooser.choose(*encoder_, k, f.codecs, CodecPipeline{f.encode_threads, decoder_.threads()});
  *sample = !c.compress && due;
  return c;
}

void TcpTransport::pump_encodes(const std::shared_ptr<TcpPost>& post) {
  const uint32_t nb = static_cast<uint32_t>(post->prep->batches.size());
  for (;;) {
    uint32_t i = 0;
    std::vector<uint32_t> unsent;
    {
      std::lock_guard<std::mutex> lk(post->mu);
      if (post->znext >= nb || post->zinflight >= kEncodeAhead) return;
      if (encoder_->stopped()) {  // shutting down: fail the rest here, without recursing
        for (uint32_t j = post->znext; j < nb; ++j) unsent.push_back(j);
        post->znext = nb;
      } else {
        i = post->znext++;
        ++post->zinflight;
      }
    }
    if (!unsent.empty()) {
      post->data_failed = true;
      for (uint32_t j : unsent)
        resolve(PendingPart{post, j, post->prep->batches[j].bytes}, 0, ConnectionError("agent is shutting down"));
      return;
    }
    std::shared_ptr<void> ticket(new char, [this, post](void* p) {
      delete static_cast<char*>(p);
      {
        std::lock_guard<std::mutex> lk(post->mu);
        --post->zinflight;
      }
      pump_encodes(post);
    });
    encoder_->run([this, post, i, ticket]() mutable { encode_and_send(post, i, std::move(ticket)); });
  }
}

void TcpTransport::encode_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, std::shared_ptr<void> ticket) {
  const auto& prep = post->prep;
  const TcpBatch& b = prep->batches[i];
  auto fail = [&](const Status& st) {
    post->data_failed = true;
    resolve(PendingPart{post, i, b.bytes}, 0, st);
  };
  if (shut_) return fail(ConnectionError("agent is shutting down"));
  if (spi::TransferControl(post->xfer).cancel_requested()) return fail(Cancelled("cancelled"));
  if (post->data_failed) return fail(Cancelled("an earlier batch of this transfer failed"));
  auto buf = encoder_->buffer();
  Status st = prep->staged
                  ? staging_.encode(*encoder_, post->compress.kind, prep->device, &prep->iov[b.first], b.count,
                                    post->xfer->deadline(),
                                    [&] { return spi::TransferControl(post->xfer).cancel_requested() || shut_.load(); },
                                    *buf)
                  : encode_batch(*prep, b, post->compress.kind, *buf);
  if (!st.ok()) return fail(st.with_context("compressing batch " + std::to_string(i) + " of the write"));
  const uint32_t slot = (post->zbase + i) % opts_.conns_per_peer;
  send_batch(post, i, slot, nullptr, std::move(buf), std::move(ticket));
}

Status TcpTransport::encode_batch(const TcpPrepared& prep, const TcpBatch& b, CodecKind kind, EncodedBatch& out) {
  std::vector<iovec> scratch;
  uint32_t n = 0;
  const iovec* iov = iovecs_of(prep, b, scratch, &n);
  return encoder_->encode(kind, iov, n, out);
}

void TcpTransport::send_separate_notify(const std::shared_ptr<TcpPost>& p) {
  // Never connect from here (this may run on a progress thread).
  auto conn = get_conn(*p->pc, 0, false);
  if (!conn.ok()) {
    spi::TransferControl(p->xfer).resolve_part(0, conn.status().with_context("sending the notification"));
    return;
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kNotify, p->xfer->id(), kNotifyBatch);
  m->aux = p->notif;
  m->finalize();
  if (!(*conn)->track(PendingPart{p, kNotifyBatch, 0}, p->xfer->id())) {
    spi::TransferControl(p->xfer).resolve_part(0, ConnectionError("connection to peer '" + p->pc->peer->md.name + "' closed"));
    return;
  }
  (*conn)->owner()->enqueue(*conn, std::move(m));
  (*conn)->owner()->wake_if_idle();
}

void TcpTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto pcr = peer_conns(peer);
  if (!pcr.ok()) {
    spi::TransferControl(xfer).fail_now(pcr.status());
    return;
  }
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->pc = *pcr;
  post->notif = std::move(notif);
  post->separate_notif = true;
  auto cr = get_conn(*post->pc, 0, true, xfer->deadline());
  if (!cr.ok()) {
    spi::TransferControl(xfer).resolve_part(0, cr.status());
    return;
  }
  send_separate_notify(post);
}

void TcpTransport::cancel(const std::shared_ptr<TcpPost>& p) {
  std::vector<std::shared_ptr<TcpConn>> conns;
  {
    std::lock_guard<std::mutex> lk(p->mu);
    for (auto& w : p->conns)
      if (auto c = w.lock()) conns.push_back(c);
  }
  for (auto& c : conns)
    for (auto& part : c->drop_unsent(p->xfer->id())) resolve(part, 0, Cancelled("cancelled before it was sent"));
}

void TcpTransport::drive(const std::shared_ptr<TcpConn>& c, Transfer& x, Clock::time_point deadline,
                         uint32_t spin_us) {
  auto rl = c->try_lock_rx();
  if (!rl || !c->open()) return;
  if (!c->set_driven(true)) return;  // the owner thread stops watching EPOLLIN while we read
  deadline = std::min(deadline, x.deadline());
  const auto spin_end = Clock::now() + std::chrono::microseconds(spin_us);
  while (!x.terminal() && c->open()) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    Status stalled = c->owner()->frame_stalled(*c, now);
    if (!stalled.ok()) {
      kill_locked(c, stalled);
      break;
    }
    // Spin briefly (the ack of a small write is usually microseconds away), then
    // block in short slices so deadlines and shutdown are noticed.
    int timeout = 0;
    if (now >= spin_end) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
      timeout = static_cast<int>(std::min<int64_t>(left, 10));
    }
    pollfd pf{c->fd(), POLLIN | POLLRDHUP, 0};
    const int r = ::poll(&pf, 1, timeout);
    if (r > 0) c->owner()->on_readable(c);
  }
  c->set_driven(false);
}

// ---------------------------------------------------------------- registration

namespace {

TransportFactory tcp_factory() {
  TransportFactory f;
  f.name = "tcp";
  f.description = "TCP sockets: any host to any host (host memory)";
  f.viable = [] { return Status::Ok(); };
  f.create = create_with<TcpOptions>([](const AgentConfig&, const TcpOptions& opts) -> Result<std::unique_ptr<Transport>> {
    return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(opts));
  });
  f.priority = 100;
  f.default_options = default_options_of<TcpOptions>;
  return f;
}

bool registered = register_transport(tcp_factory());

}  // namespace

Result<std::unique_ptr<Transport>> create_tcp_transport(const TcpOptions& opts) {
  PDKV_RETURN_IF_ERROR(opts.validate());
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(opts));
}

}  // namespace pdkv::tcp
