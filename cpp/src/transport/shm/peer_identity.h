// Who is at the other end of an shm control socket, as the kernel says (never as the
// peer says): SO_PEERCRED's pid and uid, a uid policy (ShmOptions.allowed_peer_uids),
// and a pidfd that pins the peer process, so a cross-memory copy is never addressed to
// a pid the peer no longer owns (it exited; the pid may belong to another process now).
//
// Thread safety: plain functions; PeerPin is immutable after construction and its
// exited() may be called from any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pdkv/status.h"
#include "util/socket.h"

namespace pdkv::shm {

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// The credentials of the process at the other end of connected Unix socket `fd`
// (SO_PEERCRED: for a dialled socket, the process that called listen()).
Result<PeerCred> peer_cred(int fd);

// OK when `cred.uid` is this process's uid or listed in `allowed`; else AuthFailed
// naming `who`, the uid and the option.
Status check_peer_uid(const PeerCred& cred, const std::vector<uint32_t>& allowed, const std::string& who);

// A pidfd of the peer process of connected socket `sock` (SO_PEERPIDFD where the
// kernel has it, Linux >= 6.5: race-free; else pidfd_open(cred.pid) right after
// connecting). ConnectionError when the peer process is already gone.
Result<util::ScopedFd> pin_peer_process(int sock, const PeerCred& cred, const std::string& who);

// True once the process of `pidfd` has exited (its pid may be reused from then on).
// A pidfd of -1 (none) is never "exited".
bool peer_process_exited(int pidfd);

}  // namespace pdkv::shm
