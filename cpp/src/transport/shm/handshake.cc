#include "transport/shm/handshake.h"

#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>

#include "transport/shm/peer_identity.h"
#include "util/socket.h"

namespace pdkv::shm {
namespace {

// The peer's socket is gone. If another instance of the same agent now listens in
// the same directory (`<name>-<16 hex instance>.sock`), the peer restarted -- unless
// the process in the peer's metadata is still alive and that listener is another
// process: then two agents share the name (names are not unique on a host), and the
// peer's own socket went away while its process lives; the connection error stays,
// naming the other listener, instead of a StalePeer that would send the caller to
// fetch the other agent's metadata.
Status explain_unreachable(const Peer& peer, const std::string& path, const Status& st) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return st;
  const std::string dir = path.substr(0, slash), base = path.substr(slash + 1);
  const std::string suffix = ".sock";
  const size_t tail = 1 + 16 + suffix.size();  // "-<instance>.sock"
  if (base.size() <= tail || base.compare(base.size() - suffix.size(), suffix.size(), suffix) != 0) return st;
  const std::string prefix = base.substr(0, base.size() - tail + 1);  // "<name>-"
  DIR* d = ::opendir(dir.c_str());
  if (!d) return st;
  std::string other;
  pid_t other_pid = 0;
  while (dirent* ent = ::readdir(d)) {
    const std::string n = ent->d_name;
    if (n == base || n.size() != base.size() || n.compare(0, prefix.size(), prefix) != 0 ||
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string inst = n.substr(prefix.size(), 16);
    if (!std::all_of(inst.begin(), inst.end(), [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)); }))
      continue;
    auto fd = util::connect_unix(dir + "/" + n, util::deadline_after(0.5));
    if (fd.ok()) {  // a live listener, not a stale file
      other = inst;
      if (auto cred = peer_cred(fd->get()); cred.ok()) other_pid = cred->pid;
      break;
    }
  }
  ::closedir(d);
  if (other.empty()) return st;
  const pid_t was = static_cast<pid_t>(peer.md.pid);
  if (was > 0 && other_pid > 0 && other_pid != was && (::kill(was, 0) == 0 || errno == EPERM))
    return Status(st.code(), st.message() + "; process " + std::to_string(was) + " of peer '" + peer.md.name +
                                 "' still runs, and another agent of that name (instance " + other +
                                 ", process " + std::to_string(other_pid) + ") listens in the same directory");
  return StalePeer("peer '" + peer.md.name + "' restarted: the instance in its metadata is gone and instance " +
                   other + " listens now; fetch its metadata again (" + st.message() + ")");
}

// One handshake frame, whole, before `deadline`.
Status send_ctl(int fd, Ctl type, const std::string& body, std::chrono::steady_clock::time_point deadline) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, 0, static_cast<uint32_t>(body.size()), 0};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame += body;
  return util::send_all(fd, frame.data(), frame.size(), deadline);
}

// The target's next handshake frame, checked before its aux is read; a kError
// becomes its status.
Status recv_ctl(int fd, const Peer& peer, const std::string& where, std::chrono::steady_clock::time_point deadline, CtlHdr* r,
                std::string* aux) {
  PDKV_RETURN_IF_ERROR(util::recv_all(fd, r, sizeof *r, deadline).with_context(where));
  PDKV_RETURN_IF_ERROR(check_ctl_header(*r, CtlSide::kInitiatorHello, 0).with_context(where));
  aux->assign(r->aux_len, '\0');  // bounded by check_ctl_header
  PDKV_RETURN_IF_ERROR(util::recv_all(fd, aux->data(), aux->size(), deadline).with_context(where));
  if (r->type == static_cast<uint16_t>(Ctl::kError))
    return Status(status_code_from_wire(r->status), "peer '" + peer.md.name + "' refused the connection: " + *aux);
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<ShmConn>> dial(const Peer& peer, const std::string& self_name, Clock::time_point deadline,
                                      const std::vector<uint32_t>& allowed_uids) {
  const Endpoint* e = peer.md.find_endpoint("shm");
  if (!e) return NotSupported("peer '" + peer.md.name + "' publishes no shm endpoint");
  auto fdr = util::connect_unix(e->address, deadline);
  if (!fdr.ok() && fdr.status().code() == StatusCode::kTimeout)  // it listens, but is frozen
    return Status(fdr.status().code(), "peer '" + peer.md.name + "': " + fdr.status().message());
  if (!fdr.ok())
    return explain_unreachable(peer, e->address,
                               Status(fdr.status().code(), "peer '" + peer.md.name + "': " + fdr.status().message()));
  util::ScopedFd fd = std::move(fdr).value();
  // The kernel's word on who listens there, before anything is sent to it.
  const std::string who = "the process listening at the shm address of peer '" + peer.md.name + "' (" + e->address + ")";
  PDKV_ASSIGN_OR_RETURN(PeerCred cred, peer_cred(fd.get()));
  PDKV_RETURN_IF_ERROR(check_peer_uid(cred, allowed_uids, who));
  PDKV_ASSIGN_OR_RETURN(util::ScopedFd pidfd, pin_peer_process(fd.get(), cred, who));
  const std::string where = "handshake with peer '" + peer.md.name + "'";
  PDKV_ASSIGN_OR_RETURN(auth::InitiatorHandshake hs, auth::InitiatorHandshake::begin("shm", kShmVersion, self_name));
  PDKV_RETURN_IF_ERROR(send_ctl(fd.get(), Ctl::kHello,
                                encode_hello(Hello{kShmVersion, peer.md.instance_id, self_name, peer.md.name,
                                                   hs.nonce(), hs.pub()}),
                                deadline)
                           .with_context(where));
  CtlHdr r{};
  std::string aux;
  PDKV_RETURN_IF_ERROR(recv_ctl(fd.get(), peer, where, deadline, &r, &aux));
  if (r.type != static_cast<uint16_t>(Ctl::kChallenge))
    return ProtocolError(where + ": expected a challenge, got control frame type " + std::to_string(r.type));
  PDKV_ASSIGN_OR_RETURN(Challenge ch, parse_challenge(aux));
  if (ch.instance != peer.md.instance_id)
    return StalePeer("peer '" + peer.md.name + "' restarted since its metadata was fetched");
  if (ch.name != peer.md.name)
    return ProtocolError("agent '" + ch.name + "' answered at the shm address of peer '" + peer.md.name + "'");
  auth::Mac proof{};
  PDKV_RETURN_IF_ERROR(
      hs.answer(ch.name, ch.instance, ch.nonce, ch.pub, auth::derive_key(peer.secret), &proof).with_context(where));
  PDKV_RETURN_IF_ERROR(
      send_ctl(fd.get(), Ctl::kProof, std::string(reinterpret_cast<const char*>(proof.data()), proof.size()), deadline)
          .with_context(where));
  PDKV_RETURN_IF_ERROR(recv_ctl(fd.get(), peer, where, deadline, &r, &aux));
  if (r.type != static_cast<uint16_t>(Ctl::kHelloAck))
    return ProtocolError(where + ": expected a hello-ack, got control frame type " + std::to_string(r.type));
  PDKV_ASSIGN_OR_RETURN(HelloAck ack, parse_hello_ack(aux));
  if (ack.instance != peer.md.instance_id || ack.name != peer.md.name)
    return ProtocolError(where + ": the hello-ack names another agent than the challenge");
  PDKV_RETURN_IF_ERROR(hs.check_accept(ack.mac).with_context(where));
  if (static_cast<pid_t>(ack.pid) != cred.pid)
    return AuthFailed("peer '" + peer.md.name + "' says it is process " + std::to_string(ack.pid) +
                      " but the kernel says process " + std::to_string(cred.pid) + " listens at " + e->address +
                      "; refusing it (cross-memory copies would go to the wrong process)");
  if (peer_process_exited(pidfd.get()))
    return ConnectionError("peer '" + peer.md.name + "': its process " + std::to_string(cred.pid) +
                           " exited during the handshake");
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(fd.get(), true));
  return ShmConn::dialled(fd.release(), "peer '" + peer.md.name + "' (shm " + e->address + ")", peer.md.name,
                          cred.pid, pidfd.release());
}

}  // namespace pdkv::shm
