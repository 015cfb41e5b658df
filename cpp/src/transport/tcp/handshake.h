// The initiator's side of the tcp handshake, done blocking on the calling thread
// before a connection is handed to a progress thread (the target's side is
// FrameReceiver::on_hello).
//
//   initiator -> kHello {wire version, our name, the target's name and instance
//                         (empty/0: anyone), the shared secret}
//   target    -> kHelloAck {its instance, its name}   or kError {why}
//
// The target may be anyone: its answer goes through check_header() like every
// frame before a byte more is read. Every step has the caller's deadline.
//
// Thread safety: pure functions of their arguments (blocking I/O on a new socket).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "pdkv/status.h"
#include "util/socket.h"

namespace pdkv::tcp {

// Who we say we are and whom we expect.
struct HelloParams {
  std::string self_name;
  std::string target;     // "": any agent (a metadata fetch)
  uint64_t instance = 0;  // the target instance we expect (0: any)
  std::string_view secret;
};

// Connects to `hp` and completes the handshake within `timeout_s`. The socket is
// left blocking; *peer_name (if given) receives the target's name.
Result<util::ScopedFd> dial(const util::HostPort& hp, const HelloParams& hello, double timeout_s,
                            std::string* peer_name);

// On a socket that completed the handshake: asks for the target's metadata blob
// and waits for it until `deadline`. `address` names the target in messages.
Result<std::string> request_metadata(int fd, const std::string& address,
                                     std::chrono::steady_clock::time_point deadline);

}  // namespace pdkv::tcp
