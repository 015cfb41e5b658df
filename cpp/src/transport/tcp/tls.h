// Optional TLS 1.3 on tcp connections (TcpOptions::tls), through OpenSSL.
//
// Each connection's TLS session runs on a pump thread that holds the TCP socket and
// moves plaintext through a Unix socketpair; the transport uses the pair's other end
// as the connection's fd, so framing, scatter-gather and deadlines stay exactly as on
// a plain connection (one extra copy each way besides the cipher: the cost
// `pdkv bench transfer --tls` measures).
//
// Authentication is not TLS's job here: certificates are ephemeral and unchecked. The
// pdkv handshake (pdkv/spi/auth.h) runs inside the session and binds it: both proofs
// cover the session's TLS exporter value (RFC 5705/8446 keying material), so a
// machine in the middle, which has one TLS session with each end, makes every proof
// fail. An agent with tls on speaks only TLS; one without, only plaintext.
//
// Thread safety: TlsContext is immutable after create(); a TlsChannel's binding() is
// safe from any thread once the handshake finished (the transport reads it only after
// bytes came through the channel, i.e. after the handshake).
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "pdkv/status.h"
#include "util/socket.h"

namespace pdkv::tcp {

using TlsBinding = std::array<uint8_t, 32>;

// The SSL_CTXs of one transport: TLS 1.3 only, an ephemeral Ed25519 certificate.
class TlsContext {
 public:
  static Result<std::shared_ptr<TlsContext>> create();
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  void* client() const { return client_; }  // SSL_CTX*
  void* server() const { return server_; }  // SSL_CTX*

 private:
  TlsContext() = default;
  void* client_ = nullptr;
  void* server_ = nullptr;
};

// One connection's TLS session and its pump thread.
class TlsChannel {
 public:
  // Initiator: the TLS handshake on `tcp` (blocking, until `deadline`), then the pump
  // starts. *plain receives the transport's end of the plaintext pair.
  static Result<std::shared_ptr<TlsChannel>> connect(std::shared_ptr<const TlsContext> ctx, util::ScopedFd tcp,
                                                     std::chrono::steady_clock::time_point deadline,
                                                     const std::string& where, util::ScopedFd* plain);
  // Target: starts the pump thread, which does the TLS handshake (until `deadline`;
  // else it closes both ends) and then pumps. *plain as above.
  static Result<std::shared_ptr<TlsChannel>> accept(std::shared_ptr<const TlsContext> ctx, int tcp_fd,
                                                    std::chrono::steady_clock::time_point deadline,
                                                    util::ScopedFd* plain);
  ~TlsChannel();
  TlsChannel(const TlsChannel&) = delete;
  TlsChannel& operator=(const TlsChannel&) = delete;

  // The session's channel binding (32 bytes of TLS exporter keying material); zeros
  // until the handshake finished.
  TlsBinding binding() const;
  // Makes the pump stop (closes the TCP side) and waits for its thread.
  void stop();

 private:
  TlsChannel() = default;
  void run(std::chrono::steady_clock::time_point handshake_deadline);
  bool pump();

  std::shared_ptr<const TlsContext> ctx_;
  void* ssl_ = nullptr;  // SSL*, owned by the pump thread once it runs
  util::ScopedFd tcp_;
  util::ScopedFd pair_;  // the pump's end of the plaintext pair
  int wake_[2] = {-1, -1};  // stop(): a pipe the pump polls
  mutable std::mutex mu_;
  TlsBinding binding_{};
  std::thread th_;
};

}  // namespace pdkv::tcp
