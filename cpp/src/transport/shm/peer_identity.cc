#include "transport/shm/peer_identity.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace pdkv::shm {

Result<PeerCred> peer_cred(int fd) {
  ucred cr{};
  socklen_t len = sizeof cr;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || len != sizeof cr)
    return ConnectionError("reading the shm peer's credentials (SO_PEERCRED) failed: " + util::errno_str(errno));
  if (cr.pid <= 0) return ConnectionError("the kernel reports no process at the other end of the shm socket");
  return PeerCred{cr.pid, cr.uid, cr.gid};
}

Status check_peer_uid(const PeerCred& cred, const std::vector<uint32_t>& allowed, const std::string& who) {
  if (cred.uid == ::getuid() || cred.uid == ::geteuid()) return Status::Ok();
  if (std::find(allowed.begin(), allowed.end(), static_cast<uint32_t>(cred.uid)) != allowed.end()) return Status::Ok();
  return AuthFailed(who + " is process " + std::to_string(cred.pid) + " of uid " + std::to_string(cred.uid) +
                    ", not this process's uid " + std::to_string(::geteuid()) +
                    "; list it in ShmOptions.allowed_peer_uids to accept it");
}

Result<util::ScopedFd> pin_peer_process(int sock, const PeerCred& cred, const std::string& who) {
  int pidfd = -1;
  socklen_t len = sizeof pidfd;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0 || len != sizeof pidfd) pidfd = -1;
  if (pidfd < 0 && errno == ESRCH)
    return ConnectionError(who + ": its process " + std::to_string(cred.pid) + " is gone");
  if (pidfd < 0) {  // an older kernel: pin the pid right after connecting
    pidfd = static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0));
    if (pidfd < 0 && errno == ESRCH)
      return ConnectionError(who + ": its process " + std::to_string(cred.pid) + " is gone");
    if (pidfd < 0)
      return ConnectionError(who + ": pinning its process " + std::to_string(cred.pid) +
                             " (pidfd_open) failed: " + util::errno_str(errno));
  }
  util::ScopedFd fd(pidfd);
  if (peer_process_exited(fd.get()))
    return ConnectionError(who + ": its process " + std::to_string(cred.pid) + " is gone");
  return fd;
}

bool peer_process_exited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd p{pidfd, POLLIN, 0};
  for (;;) {
    const int r = ::poll(&p, 1, 0);
    if (r < 0 && errno == EINTR) continue;
    return r > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL));
  }
}

}  // namespace pdkv::shm
