// Small POSIX socket helpers shared by the tcp transport and the benchmarks.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "pdkv/status.h"

namespace pdkv::util {

// Owns a file descriptor; closes it on destruction.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& o) noexcept : fd_(o.release()) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string str() const;
};

// Parses "host:port" or "[v6]:port".
Result<HostPort> parse_host_port(const std::string& s);
// Resolves host (numeric or name) to a socket address.
Result<sockaddr_storage> resolve(const HostPort& hp, socklen_t* len);
// Creates a listening TCP socket bound to hp (port 0: any). Returns the bound port in *port.
Result<ScopedFd> listen_tcp(const HostPort& hp, uint16_t* port, int backlog = 128);
// Connects with a timeout; returns a blocking socket with TCP_NODELAY set.
Result<ScopedFd> connect_tcp(const HostPort& hp, double timeout_s);
// Unlinks the Unix sockets (`*.sock`) of `dir` that are this user's, at least
// `min_age_s` seconds old, and refuse connections (no process listens: their agent
// was killed before it could unlink them); returns how many went. Looks at 4096
// entries at most. listen_unix() calls it before it binds.
size_t reclaim_dead_sockets(const std::string& dir, int min_age_s);

// A listening Unix socket for a same-host control channel, non-blocking, mode 0600:
// <dir>/<agent name, sanitized>-<instance hex><suffix>, dir = $PDKV_SHM_DIR or
// /tmp/pdkv-<uid> (created 0700). The path is returned in *path (unlink it at exit).
Result<ScopedFd> listen_unix(const std::string& agent_name, uint64_t instance, const std::string& suffix,
                             std::string* path);
// Connects to a Unix socket path by `deadline`; returns a blocking socket. A frozen
// listener accepts nothing, and once its backlog is full a blocking connect() would wait
// forever, so the connect does not block: it is retried until the deadline (Timeout,
// naming the full backlog). No listener: ConnectionError at once.
Result<ScopedFd> connect_unix(const std::string& path, std::chrono::steady_clock::time_point deadline);
Status set_nonblocking(int fd, bool on);

// setsockopt(TCP_CONGESTION) to `name` ("" leaves the socket's). InvalidArgument when
// the kernel refuses it, naming the congestion controls this process may use
// (net.ipv4.tcp_allowed_congestion_control) and those available
// (net.ipv4.tcp_available_congestion_control).
Status set_congestion_control(int fd, const std::string& name);
// Blocking full send/recv with a deadline (poll-based). Fail with Timeout/ConnectionError.
Status send_all(int fd, const void* buf, size_t n, std::chrono::steady_clock::time_point deadline);
Status recv_all(int fd, void* buf, size_t n, std::chrono::steady_clock::time_point deadline);
std::string errno_str(int err);
// Skips the first `n` bytes of mh's iovec array (after a partial sendmsg/recvmsg).
void advance_iov(msghdr& mh, size_t n);
std::chrono::steady_clock::time_point deadline_after(double seconds);

}  // namespace pdkv::util
