// The initiator's side of the shm handshake, done blocking on the posting thread:
//
//   initiator -> kHello     {version, the instance it expects, our name, its name, nonce_i, pub_i}
//   target    -> kChallenge {instance, name, nonce_t, pub_t}   or kError {why}
//   initiator -> kProof     {mac_i}
//   target    -> kHelloAck  {instance, pid, name, mac_t}      or kError {why}
// (the challenge-response of pdkv/spi/auth.h: the secret never crosses the socket)
//
// The answer is checked (check_ctl_header) before its body is read; a target of
// another instance or name is refused. Who the target is comes from the kernel, not
// from it: the socket's peer process (SO_PEERCRED) must have an allowed uid (this
// process's, or ShmOptions.allowed_peer_uids) and be the pid the HelloAck names (else
// AuthFailed), and it is pinned with a pidfd before the hello is sent, so cross-memory
// copies never address a pid it no longer owns. When the socket is gone and another
// instance of the same agent listens next to it, the error says the peer restarted.
//
// Thread safety: reentrant (blocking I/O on a new socket).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/spi/transport.h"
#include "transport/shm/conn.h"

namespace pdkv::shm {

// Connects to `peer`'s shm endpoint as agent `self_name` and completes the
// handshake by `deadline` (the first post's transfer deadline bounds it); returns the
// authenticated, non-blocking connection. `allowed_uids`: ShmOptions.allowed_peer_uids.
Result<std::shared_ptr<ShmConn>> dial(const Peer& peer, const std::string& self_name, Clock::time_point deadline,
                                      const std::vector<uint32_t>& allowed_uids);

}  // namespace pdkv::shm
