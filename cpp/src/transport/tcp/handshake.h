// The tcp handshake: a mutual challenge-response (pdkv/spi/auth.h); the secret
// never crosses the wire.
//
//   initiator -> kHello     {wire version, our name, the target's name and instance
//                            (empty/0: anyone), nonce_i, pub_i}
//   target    -> kChallenge {its instance, its name, nonce_t, pub_t}   or kError {why}
//   initiator -> kProof     {mac_i}
//   target    -> kHelloAck  {mac_t}   (only after mac_i checked)   or kError {why}
//
// The initiator's side (dial) runs blocking on the calling thread before a
// connection is handed to a progress thread; the target's side runs in
// FrameReceiver (on_hello, on_proof) with the helpers below. Either end may be
// anyone: every answer goes through check_header() before a byte more is read, and
// every step has the caller's deadline.
//
// Thread safety: pure functions of their arguments (blocking I/O on a new socket);
// a TargetHandshake belongs to one connection's receiver.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/spi/auth.h"
#include "pdkv/status.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/tls.h"
#include "util/socket.h"

namespace pdkv::tcp {

// Who we say we are and whom we expect.
struct HelloParams {
  std::string self_name;
  std::string target;     // "": any agent (a metadata fetch)
  uint64_t instance = 0;  // the target instance we expect (0: any)
  auth::Key key;          // of the secret we prove (auth::derive_key)
  std::shared_ptr<const TlsContext> tls;  // TcpOptions::tls: the handshake runs inside a TLS session
  std::string congestion_control;         // TcpOptions::congestion_control ("": the system's)
};

// Connects to `hp` and completes the handshake within `timeout_s`. The socket is
// left blocking; *peer_name (if given) receives the target's name. AuthFailed when
// either side's proof fails (the target's message, or ours when the target could
// not prove it knows the secret). With hello.tls the returned fd is the plaintext
// end of *channel (keep the channel as long as the fd).
Result<util::ScopedFd> dial(const util::HostPort& hp, const HelloParams& hello, double timeout_s,
                            std::string* peer_name, std::shared_ptr<TlsChannel>* channel = nullptr);

// On a socket that completed the handshake: asks for the target's metadata blob
// and waits for it until `deadline`. `address` names the target in messages.
Result<std::string> request_metadata(int fd, const std::string& address,
                                     std::chrono::steady_clock::time_point deadline);

// The target's answer to a valid hello: its half of the exchange (keep it until the
// proof arrives) and, in *challenge, the kChallenge body to send.
// `binding`: the connection's TLS session (TlsChannel::binding), zeros without one.
Result<auth::TargetHandshake> begin_challenge(const HelloBody& hello, const std::string& self_name,
                                              uint64_t self_instance, std::string* challenge,
                                              const auth::ChannelBinding& binding = auth::ChannelBinding{});

}  // namespace pdkv::tcp
