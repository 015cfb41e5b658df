// The tcp Transport: start-up and shutdown, the peers' connection slots (dialing on
// first use), the teardown of a connection, and the registration. prepare.cc cuts a
// transfer into batches, post.cc sends them and settles their parts; the other parts
// it wires are listed in tcp_transport_impl.h.
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
  // Accepted connections inherit a congestion control set on their listener.
  PDKV_RETURN_IF_ERROR(util::set_congestion_control(listen_fd_.get(), opts_.congestion_control));
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
                                                auth::derive_key(pc.peer->secret), tls_, opts_.congestion_control},
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
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd fd, dial(hp, HelloParams{hooks_->agent_name(), "", 0, auth::derive_key(secret), tls_,
                                                                 opts_.congestion_control},
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
