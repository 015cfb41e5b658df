#include "transport/shm/shm_dial.h"

#include <dirent.h>

#include <algorithm>
#include <cctype>

#include "transport/shm/peer_identity.h"
#include "util/socket.h"

namespace pdkv::shm {
namespace {

// The peer's socket is gone. If another instance of the same agent now listens in
// the same directory (`<name>-<16 hex instance>.sock`), the peer restarted.
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
  while (dirent* ent = ::readdir(d)) {
    const std::string n = ent->d_name;
    if (n == base || n.size() != base.size() || n.compare(0, prefix.size(), prefix) != 0 ||
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string inst = n.substr(prefix.size(), 16);
    if (!std::all_of(inst.begin(), inst.end(), [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)); }))
      continue;
    if (util::connect_unix(dir + "/" + n, util::deadline_after(0.5)).ok()) {  // a live listener, not a stale file
      other = inst;
      break;
    }
  }
  ::closedir(d);
  if (other.empty()) return st;
  return StalePeer("peer '" + peer.md.name + "' restarted: the instance in its metadata is gone and instance " +
                   other + " listens now; fetch its metadata again (" + st.message() + ")");
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
  Hello hello{kShmVersion, peer.md.instance_id, self_name, peer.md.name, peer.secret};
  const std::string body = encode_hello(hello);
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(Ctl::kHello), 0, 0, static_cast<uint32_t>(body.size()), 0};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame += body;
  const std::string where = "handshake with peer '" + peer.md.name + "'";
  PDKV_RETURN_IF_ERROR(util::send_all(fd.get(), frame.data(), frame.size(), deadline).with_context(where));
  CtlHdr r{};
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), &r, sizeof r, deadline).with_context(where));
  PDKV_RETURN_IF_ERROR(check_ctl_header(r, CtlSide::kInitiatorHello, 0).with_context(where));
  std::string aux(r.aux_len, '\0');  // bounded by check_ctl_header
  PDKV_RETURN_IF_ERROR(util::recv_all(fd.get(), aux.data(), aux.size(), deadline).with_context(where));
  if (r.type == static_cast<uint16_t>(Ctl::kError))
    return Status(status_code_from_wire(r.status), "peer '" + peer.md.name + "' refused the connection: " + aux);
  PDKV_ASSIGN_OR_RETURN(HelloAck ack, parse_hello_ack(aux));
  if (ack.instance != peer.md.instance_id)
    return StalePeer("peer '" + peer.md.name + "' restarted since its metadata was fetched");
  if (ack.name != peer.md.name)
    return ProtocolError("agent '" + ack.name + "' answered at the shm address of peer '" + peer.md.name + "'");
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
