#include "util/socket.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <thread>

namespace pdkv::util {

std::string errno_str(int err) {
  char buf[128];
  // GNU strerror_r returns a char*.
  const char* s = strerror_r(err, buf, sizeof buf);
  return s;
}

void advance_iov(msghdr& mh, size_t n) {
  while (n && mh.msg_iovlen) {
    if (n >= mh.msg_iov[0].iov_len) {
      n -= mh.msg_iov[0].iov_len;
      ++mh.msg_iov;
      --mh.msg_iovlen;
    } else {
      mh.msg_iov[0].iov_base = static_cast<char*>(mh.msg_iov[0].iov_base) + n;
      mh.msg_iov[0].iov_len -= n;
      n = 0;
    }
  }
}

size_t reclaim_dead_sockets(const std::string& dir, int min_age_s) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return 0;
  size_t removed = 0, seen = 0;
  const time_t now = ::time(nullptr);
  while (dirent* e = ::readdir(d)) {
    if (++seen > 4096) break;  // bounded: a directory this full is not ours to clean
    const std::string name = e->d_name;
    if (name.size() < 6 || name.compare(name.size() - 5, 5, ".sock") != 0) continue;
    const std::string p = dir + "/" + name;
    struct stat st{};
    // Only our own sockets, old enough that no agent is between its bind() and listen().
    if (::lstat(p.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (now - st.st_mtime < min_age_s) continue;
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    if (p.size() >= sizeof sa.sun_path) continue;
    std::memcpy(sa.sun_path, p.c_str(), p.size() + 1);
    ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) break;
    // ECONNREFUSED: nobody listens there any more (its agent was killed); EAGAIN: alive, busy.
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 && errno == ECONNREFUSED &&
        ::unlink(p.c_str()) == 0)
      ++removed;
  }
  ::closedir(d);
  return removed;
}

Result<ScopedFd> listen_unix(const std::string& agent_name, uint64_t instance, const std::string& suffix,
                             std::string* path) {
  const char* env = std::getenv("PDKV_SHM_DIR");
  const std::string dir = env && *env ? std::string(env) : "/tmp/pdkv-" + std::to_string(::getuid());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return Internal("cannot create the socket directory " + dir + ": " + errno_str(errno));
  reclaim_dead_sockets(dir, 10);  // socket files of killed agents (nobody listening) go
  std::string safe;
  for (char ch : agent_name.substr(0, 40)) safe += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  char inst[20];
  snprintf(inst, sizeof inst, "%016llx", static_cast<unsigned long long>(instance));
  *path = dir + "/" + safe + "-" + inst + suffix;
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path->size() >= sizeof sa.sun_path)
    return InvalidArgument("socket path too long (" + *path + "); set PDKV_SHM_DIR to a shorter directory");
  std::memcpy(sa.sun_path, path->c_str(), path->size() + 1);
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return Internal("socket(AF_UNIX): " + errno_str(errno));
  ::unlink(path->c_str());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return Internal("cannot bind " + *path + ": " + errno_str(errno));
  ::chmod(path->c_str(), 0600);
  if (::listen(fd.get(), 128) != 0) return Internal("listen " + *path + ": " + errno_str(errno));
  return fd;
}

Result<ScopedFd> connect_unix(const std::string& path, std::chrono::steady_clock::time_point deadline) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof sa.sun_path) return InvalidArgument("bad Unix socket path '" + path + "'");
  std::memcpy(sa.sun_path, path.c_str(), path.size() + 1);
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return Internal("socket(AF_UNIX): " + errno_str(errno));
  for (;;) {
    // A Unix-socket connect either completes at once or fails with EAGAIN (backlog full).
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) break;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return ConnectionError("cannot connect to " + path + ": " + errno_str(errno));
    if (std::chrono::steady_clock::now() >= deadline)
      return TimeoutError("cannot connect to " + path + ": its backlog stayed full (is the peer frozen?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  PDKV_RETURN_IF_ERROR(set_nonblocking(fd.get(), false));
  return fd;
}

std::chrono::steady_clock::time_point deadline_after(double seconds) {
  if (seconds <= 0 || seconds > 1e7) return std::chrono::steady_clock::time_point::max();
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

std::string HostPort::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Result<HostPort> parse_host_port(const std::string& s) {
  HostPort hp;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    auto close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return InvalidArgument("address '" + s + "' is not of the form [ipv6]:port");
    hp.host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == std::string::npos) return InvalidArgument("address '" + s + "' is not of the form host:port");
    hp.host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (hp.host.empty()) return InvalidArgument("address '" + s + "' has no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    return InvalidArgument("address '" + s + "' has an invalid port");
  unsigned long p = std::stoul(port);
  if (p > 65535) return InvalidArgument("address '" + s + "' has a port above 65535");
  hp.port = static_cast<uint16_t>(p);
  return hp;
}

Result<sockaddr_storage> resolve(const HostPort& hp, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port = std::to_string(hp.port);
  int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || !res)
    return InvalidArgument("cannot resolve host '" + hp.host + "': " + std::string(gai_strerror(rc)));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

namespace {

std::string proc_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s.empty() ? "?" : s;
}

}  // namespace

Status set_congestion_control(int fd, const std::string& name) {
  if (name.empty()) return Status::Ok();
  if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0)
    return Status::Ok();
  const int err = errno;
  return InvalidArgument("tcp.congestion_control '" + name + "' is refused by the kernel (" + errno_str(err) +
                         "); allowed for this process: " +
                         proc_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control") +
                         "; available: " + proc_line("/proc/sys/net/ipv4/tcp_available_congestion_control") +
                         " (others need CAP_NET_ADMIN or their module loaded)");
}

Status set_nonblocking(int fd, bool on) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl < 0) return Internal("fcntl(F_GETFL): " + errno_str(errno));
  fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
  if (fcntl(fd, F_SETFL, fl) < 0) return Internal("fcntl(F_SETFL): " + errno_str(errno));
  return Status::Ok();
}

Result<ScopedFd> listen_tcp(const HostPort& hp, uint16_t* port, int backlog) {
  socklen_t len = 0;
  PDKV_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(hp, &len));
  ScopedFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Internal("socket(): " + errno_str(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0)
    return ConnectionError("cannot listen on " + hp.str() + ": bind: " + errno_str(errno));
  if (::listen(fd.get(), backlog) != 0) return ConnectionError("listen on " + hp.str() + ": " + errno_str(errno));
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

static int remaining_ms(std::chrono::steady_clock::time_point deadline) {
  if (deadline == std::chrono::steady_clock::time_point::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return left.count() < 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
}

Result<ScopedFd> connect_tcp(const HostPort& hp, double timeout_s) {
  socklen_t len = 0;
  PDKV_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(hp, &len));
  ScopedFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return Internal("socket(): " + errno_str(errno));
  auto deadline = deadline_after(timeout_s);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    if (errno != EINPROGRESS) return ConnectionError("cannot connect to " + hp.str() + ": " + errno_str(errno));
    pollfd p{fd.get(), POLLOUT, 0};
    int rc;
    do {
      rc = ::poll(&p, 1, remaining_ms(deadline));
    } while (rc < 0 && errno == EINTR);
    if (rc == 0)
      return TimeoutError("connecting to " + hp.str() + " timed out after " + std::to_string(timeout_s) + " s");
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
    if (err != 0) return ConnectionError("cannot connect to " + hp.str() + ": " + errno_str(err));
  }
  int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  PDKV_RETURN_IF_ERROR(set_nonblocking(fd.get(), false));
  return fd;
}

Status send_all(int fd, const void* buf, size_t n, std::chrono::steady_clock::time_point deadline) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    pollfd pf{fd, POLLOUT, 0};
    int rc = ::poll(&pf, 1, remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) return TimeoutError("send timed out");
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return ConnectionError("send: " + errno_str(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status recv_all(int fd, void* buf, size_t n, std::chrono::steady_clock::time_point deadline) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    int rc = ::poll(&pf, 1, remaining_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) return TimeoutError("timed out waiting for the peer to answer");
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r == 0) return ConnectionError("peer closed the connection");
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return ConnectionError("recv: " + errno_str(errno));
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Status::Ok();
}

}  // namespace pdkv::util
