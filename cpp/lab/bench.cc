#include "bench.h"

#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <pybind11/stl.h>

#include "util/socket.h"

namespace py = pybind11;
using pdkv::util::ScopedFd;

namespace bench {
namespace {

// Each message: 16-byte header {u64 bytes, u32 want_ack, u32 rcvlowat}, then `bytes` bytes.
struct MsgHdr {
  uint64_t bytes;
  uint32_t want_ack;
  uint32_t rcvlowat;
};

bool recv_full(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    ssize_t r = ::recv(fd, c, n, 0);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= size_t(r);
  }
  return true;
}

bool send_full(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return false;
    }
    c += w;
    n -= size_t(w);
  }
  return true;
}

// A sink: accepts connections and swallows messages into a reusable buffer.
class Sink {
 public:
  Sink(const std::string& host, uint16_t want_port, size_t buf_bytes) : buf_(buf_bytes) {
    uint16_t port = 0;
    auto r = pdkv::util::listen_tcp({host, want_port}, &port);
    if (!r.ok()) throw std::runtime_error(r.status().message());
    lfd_ = std::move(r).value();
    port_ = port;
    th_ = std::thread([this] { accept_loop(); });
  }
  ~Sink() { stop(); }
  uint16_t port() const { return port_; }
  void stop() {
    if (stopped_.exchange(true)) return;
    ::shutdown(lfd_.get(), SHUT_RDWR);
    if (th_.joinable()) th_.join();
    std::lock_guard<std::mutex> lk(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    for (auto& t : conns_) t.join();
    conns_.clear();
  }

 private:
  void accept_loop() {
    for (;;) {
      int fd = ::accept(lfd_.get(), nullptr, nullptr);
      if (fd < 0) {
        if (errno == EINTR) continue;
        return;
      }
      std::lock_guard<std::mutex> lk(mu_);
      fds_.push_back(fd);
      conns_.emplace_back([this, fd] { serve(fd); ::close(fd); });
    }
  }
  void serve(int fd) {
    int cur_lowat = 1;
    MsgHdr h;
    while (recv_full(fd, &h, sizeof h)) {
      uint64_t left = h.bytes;
      size_t pos = 0;
      while (left) {
        if (h.rcvlowat) {
          int want = int(std::max<uint64_t>(1, std::min<uint64_t>(h.rcvlowat, left / 2)));
          if (want != cur_lowat && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0) cur_lowat = want;
        }
        size_t n = std::min<uint64_t>(left, buf_.size() - pos);
        ssize_t r = ::recv(fd, buf_.data() + pos, n, 0);
        if (r <= 0) {
          if (r < 0 && errno == EINTR) continue;
          return;
        }
        left -= uint64_t(r);
        pos = (pos + size_t(r)) % buf_.size();
      }
      if (cur_lowat != 1) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
        cur_lowat = 1;
      }
      if (h.want_ack) {
        char a = 1;
        if (!send_full(fd, &a, 1)) return;
      }
    }
  }
  std::vector<char> buf_;
  ScopedFd lfd_;
  uint16_t port_ = 0;
  std::thread th_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> conns_;
  std::atomic<bool> stopped_{false};
};

ScopedFd dial(const std::string& host, uint16_t port, bool nodelay, const std::string& congestion) {
  auto r = pdkv::util::connect_tcp({host, port}, 10.0);
  if (!r.ok()) throw std::runtime_error(r.status().message());
  ScopedFd fd = std::move(r).value();
  // The sender's congestion control decides the data's pace: the same as pdkv's (--congestion-control).
  if (auto st = pdkv::util::set_congestion_control(fd.get(), congestion); !st.ok())
    throw std::runtime_error(st.message());
  int v = nodelay ? 1 : 0;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &v, sizeof v);
  return fd;
}

// Streams `total` bytes over `conns` connections (one thread each) as messages of
// `msg_bytes`, each acked. Returns seconds.
double stream(const std::string& host, uint16_t port, int conns, uint64_t total, uint64_t msg_bytes, bool tuned,
              uint32_t rcvlowat, const std::string& congestion) {
  std::vector<ScopedFd> fds;
  for (int i = 0; i < conns; ++i) fds.push_back(dial(host, port, tuned, congestion));
  std::vector<char> src(std::min<uint64_t>(msg_bytes, 64ull << 20), 7);
  std::atomic<bool> ok{true};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ths;
  for (int i = 0; i < conns; ++i) {
    uint64_t share = total / conns + (uint64_t(i) < total % conns ? 1 : 0);
    ths.emplace_back([&, i, share] {
      int fd = fds[i].get();
      uint64_t left = share;
      while (left && ok) {
        uint64_t n = std::min(left, msg_bytes);
        MsgHdr h{n, 1, tuned ? rcvlowat : 0};
        if (tuned) {
          // Header and data in one sendmsg, like the transport.
          uint64_t sent = 0;
          bool first = true;
          while (sent < n) {
            uint64_t c = std::min<uint64_t>(n - sent, src.size());
            iovec iov[2];
            int k = 0;
            if (first) iov[k++] = {&h, sizeof h};
            iov[k++] = {src.data(), c};
            msghdr mh{};
            mh.msg_iov = iov;
            mh.msg_iovlen = k;
            size_t want = (first ? sizeof h : 0) + c;
            size_t done = 0;
            while (done < want) {
              ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL);
              if (w <= 0) {
                if (w < 0 && errno == EINTR) continue;
                ok = false;
                return;
              }
              done += size_t(w);
              pdkv::util::advance_iov(mh, size_t(w));
            }
            first = false;
            sent += c;
          }
        } else {
          if (!send_full(fd, &h, sizeof h)) { ok = false; return; }
          uint64_t sent = 0;
          while (sent < n) {
            uint64_t c = std::min<uint64_t>(n - sent, src.size());
            if (!send_full(fd, src.data(), c)) { ok = false; return; }
            sent += c;
          }
        }
        char a;
        if (!recv_full(fd, &a, 1)) { ok = false; return; }
        left -= n;
      }
    });
  }
  for (auto& t : ths) t.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!ok) throw std::runtime_error("raw socket stream failed");
  return s;
}

// Round trips of `bytes`-byte messages, each acked with one byte. Returns ns per trip.
std::vector<double> pingpong(const std::string& host, uint16_t port, uint64_t bytes, int iters, int warmup,
                             const std::string& congestion) {
  ScopedFd fd = dial(host, port, true, congestion);
  std::vector<char> src(bytes + sizeof(MsgHdr), 7);
  std::vector<double> out;
  out.reserve(iters);
  for (int i = 0; i < iters + warmup; ++i) {
    MsgHdr h{bytes, 1, 0};
    std::memcpy(src.data(), &h, sizeof h);
    auto t0 = std::chrono::steady_clock::now();
    if (!send_full(fd.get(), src.data(), src.size())) throw std::runtime_error("pingpong send failed");
    char a;
    if (!recv_full(fd.get(), &a, 1)) throw std::runtime_error("pingpong recv failed");
    if (i >= warmup) out.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  return out;
}

// Single-thread memcpy of (dst, src, len) triples, `iters` times. Returns seconds.
double memcpy_extents(const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& ex, int iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i)
    for (auto& [d, s, n] : ex) std::memcpy(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void bind(py::module_& m) {
  py::class_<Sink>(m, "Sink")
      .def(py::init<const std::string&, uint16_t, size_t>(), py::arg("host"), py::arg("port") = 0,
           py::arg("buf_bytes") = size_t(64) << 20)
      .def_property_readonly("port", &Sink::port)
      .def("stop", &Sink::stop, py::call_guard<py::gil_scoped_release>());
  m.def("stream", &stream, py::arg("host"), py::arg("port"), py::arg("conns"), py::arg("total"), py::arg("msg_bytes"),
        py::arg("tuned"), py::arg("rcvlowat") = 1u << 20, py::arg("congestion") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("pingpong", &pingpong, py::arg("host"), py::arg("port"), py::arg("bytes"), py::arg("iters"),
        py::arg("warmup") = 20, py::arg("congestion") = "", py::call_guard<py::gil_scoped_release>());
  m.def("memcpy_extents", &memcpy_extents, py::arg("extents"), py::arg("iters") = 1,
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace bench
