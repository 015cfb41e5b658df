// The initiator's side of the shm handshake, done blocking on the posting thread:
//
//   initiator -> kHello     {version, the instance it expects, our name, its name, nonce_i, pub_i}
//   target    -> kChallenge {instance, name, nonce_t, pub_t}   or kError {why}
//   initiator -> kProof     {mac_i}
//   target    -> kHelloAck  {instance, pid, name, mac_t}      or kError {why}
// (the challenge-response of pdkv/spi/auth.h: the secret never crosses the socket)
//
// The answer is checked (check_ctl_header) before its body is read; a target of
// another instance or name is refused. When the socket is gone and another
// instance of the same agent listens next to it, the error says the peer restarted.
//
// Thread safety: reentrant (blocking I/O on a new socket).
#pragma once

#include <memory>
#include <string>

#include "pdkv/status.h"
#include "pdkv/spi/transport.h"
#include "transport/shm/shm_conn.h"

namespace pdkv::shm {

// Connects to `peer`'s shm endpoint as agent `self_name` and completes the
// handshake within `timeout_s`; returns the authenticated, non-blocking connection.
Result<std::shared_ptr<ShmConn>> dial(const Peer& peer, const std::string& self_name, double timeout_s);

}  // namespace pdkv::shm
