#include "transport/tcp/tls.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "util/thread_name.h"

namespace pdkv::tcp {
namespace {

constexpr char kExporterLabel[] = "EXPORTER-pdkv-channel-binding";
constexpr size_t kPumpBuffer = 256 << 10;

SSL* ssl_of(void* p) { return static_cast<SSL*>(p); }

std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "no detail";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return buf;
}

int ms_until(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

// Drives SSL_connect / SSL_accept on a non-blocking socket until done, `deadline`, or
// a byte on `wake` (stop()).
Status handshake(SSL* ssl, int fd, bool client, std::chrono::steady_clock::time_point deadline, int wake) {
  for (;;) {
    const int r = client ? SSL_connect(ssl) : SSL_accept(ssl);
    if (r == 1) return Status::Ok();
    const int e = SSL_get_error(ssl, r);
    short ev = 0;
    if (e == SSL_ERROR_WANT_READ) ev = POLLIN;
    else if (e == SSL_ERROR_WANT_WRITE) ev = POLLOUT;
    else
      return ProtocolError(std::string("TLS handshake failed (") + openssl_error() +
                           "; does the peer run tcp with the same TcpOptions.tls?)");
    pollfd p[2] = {{fd, ev, 0}, {wake, POLLIN, 0}};
    const int ms = ms_until(deadline);
    if (ms == 0) return TimeoutError("TLS handshake did not finish in time");
    const int n = ::poll(p, wake >= 0 ? 2 : 1, ms);
    if (n < 0 && errno != EINTR) return ConnectionError(std::string("poll: ") + std::strerror(errno));
    if (wake >= 0 && (p[1].revents & POLLIN)) return Cancelled("the transport is shutting down");
  }
}

}  // namespace

// ---------------------------------------------------------------- TlsContext

Result<std::shared_ptr<TlsContext>> TlsContext::create() {
  std::shared_ptr<TlsContext> c(new TlsContext());
  EVP_PKEY* key = EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519");
  X509* x = X509_new();
  bool ok = key && x && X509_set_version(x, 2) == 1 && ASN1_INTEGER_set(X509_get_serialNumber(x), 1) == 1 &&
            X509_gmtime_adj(X509_getm_notBefore(x), -3600) && X509_gmtime_adj(X509_getm_notAfter(x), 3650L * 86400) &&
            X509_set_pubkey(x, key) == 1;
  if (ok) {
    X509_NAME* n = X509_get_subject_name(x);
    ok = X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("pdkv"), -1, -1,
                                    0) == 1 &&
         X509_set_issuer_name(x, n) == 1 && X509_sign(x, key, nullptr) > 0;
  }
  SSL_CTX* server = ok ? SSL_CTX_new(TLS_server_method()) : nullptr;
  SSL_CTX* client = ok ? SSL_CTX_new(TLS_client_method()) : nullptr;
  c->server_ = server;
  c->client_ = client;
  ok = ok && server && client && SSL_CTX_set_min_proto_version(server, TLS1_3_VERSION) == 1 &&
       SSL_CTX_set_min_proto_version(client, TLS1_3_VERSION) == 1 && SSL_CTX_use_certificate(server, x) == 1 &&
       SSL_CTX_use_PrivateKey(server, key) == 1;
  X509_free(x);
  EVP_PKEY_free(key);
  if (!ok) return Internal("TLS: creating the context failed (" + openssl_error() + ")");
  // Peers are authenticated by pdkv's handshake inside the session, bound to it.
  SSL_CTX_set_verify(client, SSL_VERIFY_NONE, nullptr);
  SSL_CTX_set_num_tickets(server, 0);
  for (SSL_CTX* s : {server, client}) {
    SSL_CTX_set_mode(s, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    // AES-128-GCM first (AES-NI: the cheapest per byte), then ChaCha20 for CPUs without it.
    SSL_CTX_set_ciphersuites(s, "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384");
    // Read whole socket buffers, not a record header and then its body (two syscalls
    // per 16 KiB record otherwise).
    SSL_CTX_set_read_ahead(s, 1);
    SSL_CTX_set_default_read_buffer_len(s, kPumpBuffer);
  }
  return c;
}

TlsContext::~TlsContext() {
  SSL_CTX_free(static_cast<SSL_CTX*>(server_));
  SSL_CTX_free(static_cast<SSL_CTX*>(client_));
}

// ---------------------------------------------------------------- TlsChannel

namespace {

// The plaintext pair (one end to the caller), the wake pipe, an SSL on `tcp_fd`.
Status make_channel(void* ctx, int tcp_fd, void** ssl, util::ScopedFd* pair, int wake[2], util::ScopedFd* plain) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return ConnectionError(std::string("TLS: socketpair: ") + std::strerror(errno));
  *plain = util::ScopedFd(sv[0]);
  *pair = util::ScopedFd(sv[1]);
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) return ConnectionError(std::string("TLS: pipe: ") + std::strerror(errno));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(tcp_fd, true));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(pair->get(), true));
  SSL* s = SSL_new(static_cast<SSL_CTX*>(ctx));
  if (!s || SSL_set_fd(s, tcp_fd) != 1) {
    SSL_free(s);
    return Internal("TLS: SSL_new failed (" + openssl_error() + ")");
  }
  *ssl = s;
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<TlsChannel>> TlsChannel::connect(std::shared_ptr<const TlsContext> ctx, util::ScopedFd tcp,
                                                        std::chrono::steady_clock::time_point deadline,
                                                        const std::string& where, util::ScopedFd* plain) {
  std::shared_ptr<TlsChannel> ch(new TlsChannel());
  ch->ctx_ = std::move(ctx);
  ch->tcp_ = std::move(tcp);
  PDKV_RETURN_IF_ERROR(make_channel(ch->ctx_->client(), ch->tcp_.get(), &ch->ssl_, &ch->pair_, ch->wake_, plain));
  PDKV_RETURN_IF_ERROR(handshake(ssl_of(ch->ssl_), ch->tcp_.get(), true, deadline, -1).with_context("with " + where));
  {
    std::lock_guard<std::mutex> lk(ch->mu_);
    SSL_export_keying_material(ssl_of(ch->ssl_), ch->binding_.data(), ch->binding_.size(), kExporterLabel,
                               sizeof kExporterLabel - 1, nullptr, 0, 0);
  }
  ch->th_ = std::thread([raw = ch.get()] { raw->run(std::chrono::steady_clock::time_point{}); });
  return ch;
}

Result<std::shared_ptr<TlsChannel>> TlsChannel::accept(std::shared_ptr<const TlsContext> ctx, int tcp_fd,
                                                       std::chrono::steady_clock::time_point deadline,
                                                       util::ScopedFd* plain) {
  std::shared_ptr<TlsChannel> ch(new TlsChannel());
  ch->ctx_ = std::move(ctx);
  ch->tcp_ = util::ScopedFd(tcp_fd);
  PDKV_RETURN_IF_ERROR(make_channel(ch->ctx_->server(), ch->tcp_.get(), &ch->ssl_, &ch->pair_, ch->wake_, plain));
  ch->th_ = std::thread([raw = ch.get(), deadline] { raw->run(deadline); });
  return ch;
}

TlsChannel::~TlsChannel() {
  stop();
  SSL_free(ssl_of(ssl_));
  for (int& f : wake_)
    if (f >= 0) ::close(f);
}

void TlsChannel::stop() {
  if (wake_[1] >= 0) {
    const char b = 1;
    (void)!::write(wake_[1], &b, 1);
  }
  if (th_.joinable() && th_.get_id() != std::this_thread::get_id()) th_.join();
}

TlsBinding TlsChannel::binding() const {
  std::lock_guard<std::mutex> lk(mu_);
  return binding_;
}

void TlsChannel::run(std::chrono::steady_clock::time_point handshake_deadline) {
  util::name_this_thread("pdkv-tls");
  SSL* ssl = ssl_of(ssl_);
  bool ok = true;
  if (handshake_deadline != std::chrono::steady_clock::time_point{}) {  // the target's side
    ok = handshake(ssl, tcp_.get(), false, handshake_deadline, wake_[0]).ok();
    if (ok) {
      std::lock_guard<std::mutex> lk(mu_);
      SSL_export_keying_material(ssl, binding_.data(), binding_.size(), kExporterLabel, sizeof kExporterLabel - 1,
                                 nullptr, 0, 0);
    }
  }
  if (ok && pump()) SSL_shutdown(ssl);  // best effort close_notify
  ERR_clear_error();
  // The transport sees its end close; the peer sees the TCP connection close.
  pair_.reset();
  ::shutdown(tcp_.get(), SHUT_RDWR);
}

// Moves bytes both ways until a side closes (true: our transport's end closed, so a
// close_notify is due) or fails (false).
bool TlsChannel::pump() {
  SSL* ssl = ssl_of(ssl_);
  std::vector<char> up(kPumpBuffer), down(kPumpBuffer);  // plaintext -> TLS, TLS -> plaintext
  size_t up_len = 0, up_off = 0, down_len = 0, down_off = 0;
  for (;;) {
    bool moved = false;
    short tcp_ev = 0, pair_ev = 0;
    if (up_len == 0) {
      const ssize_t r = ::read(pair_.get(), up.data(), up.size());
      if (r == 0) return true;
      if (r > 0) {
        up_len = static_cast<size_t>(r);
        up_off = 0;
        moved = true;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return false;
      } else {
        pair_ev |= POLLIN;
      }
    }
    if (up_off < up_len) {
      size_t n = 0;
      if (SSL_write_ex(ssl, up.data() + up_off, up_len - up_off, &n) == 1) {
        up_off += n;
        if (up_off == up_len) up_len = up_off = 0;
        moved = true;
      } else {
        const int e = SSL_get_error(ssl, 0);
        if (e == SSL_ERROR_WANT_WRITE) tcp_ev |= POLLOUT;
        else if (e == SSL_ERROR_WANT_READ) tcp_ev |= POLLIN;
        else return false;
      }
    }
    // As many records as have arrived (read-ahead buffers them), up to the buffer:
    // one write to the plaintext side for many records.
    while (down_len < down.size()) {
      size_t n = 0;
      if (SSL_read_ex(ssl, down.data() + down_len, down.size() - down_len, &n) == 1) {
        down_len += n;
        moved = true;
        continue;
      }
      const int e = SSL_get_error(ssl, 0);
      if (e == SSL_ERROR_WANT_READ) tcp_ev |= POLLIN;
      else if (e == SSL_ERROR_WANT_WRITE) tcp_ev |= POLLOUT;
      else return false;  // SSL_ERROR_ZERO_RETURN: the peer closed; anything else: broken
      break;
    }
    if (down_off < down_len) {
      const ssize_t w = ::write(pair_.get(), down.data() + down_off, down_len - down_off);
      if (w > 0) {
        down_off += static_cast<size_t>(w);
        if (down_off == down_len) down_len = down_off = 0;
        moved = true;
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return false;
      } else {
        pair_ev |= POLLOUT;
      }
    }
    if (moved) continue;
    // An fd we want nothing of is left out (-1): its hang-up must not wake us in a loop.
    pollfd p[3] = {{tcp_ev ? tcp_.get() : -1, tcp_ev, 0}, {pair_ev ? pair_.get() : -1, pair_ev, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(p, 3, -1) < 0 && errno != EINTR) return false;
    if (p[2].revents & POLLIN) return false;  // stop()
    if ((p[0].revents & (POLLERR | POLLNVAL)) || (p[1].revents & (POLLERR | POLLNVAL))) return false;
  }
}

}  // namespace pdkv::tcp
