#include "netlab_delay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <deque>
#include <stdexcept>
#include <thread>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "util/thread_name.h"

namespace netlab {
namespace {

// Largest frame read: a 64 KiB GSO frame, its Ethernet/VLAN header and the 10-byte
// virtio-net header, with room to spare (a larger one is dropped and counted).
constexpr size_t kMaxFrame = 256 * 1024;

std::runtime_error sys_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Frame {
  int64_t due_ns;
  std::vector<char> bytes;  // virtio-net header + Ethernet frame
};

// One direction of a link: frames read from `in` wait in `queue`, then go to `out`.
struct Direction {
  int in = -1, out = -1;
  bool in_is_tap = false;
  std::deque<Frame> queue;
  uint64_t queued_bytes = 0;
  std::atomic<uint64_t> frames{0}, bytes{0}, dropped{0};
};

int open_tap(const std::string& name) {
  int fd = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw sys_error("cannot open /dev/net/tun");
  ifreq ifr{};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
  std::strncpy(ifr.ifr_name, name.c_str(), IFNAMSIZ - 1);
  if (::ioctl(fd, TUNSETIFF, &ifr) < 0) {
    ::close(fd);
    throw sys_error("cannot create TAP device " + name);
  }
  // GSO frames and checksum offload cross as they are (we forward the header).
  if (::ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) < 0) {
    ::close(fd);
    throw sys_error("cannot enable offloads on " + name);
  }
  return fd;
}

int open_raw(const std::string& link) {
  const unsigned idx = if_nametoindex(link.c_str());
  if (idx == 0) throw sys_error("no interface " + link + " in this network namespace");
  int fd = ::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, htons(ETH_P_ALL));
  if (fd < 0) throw sys_error("cannot open a packet socket");
  auto fail = [&](const std::string& what) {
    auto e = sys_error(what + " on " + link);
    ::close(fd);
    return e;
  };
  int one = 1;
  if (::setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0) throw fail("PACKET_VNET_HDR");
  if (::setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0)
    throw fail("PACKET_IGNORE_OUTGOING");
  const int buf = 8 << 20;
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  sockaddr_ll sll{};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = static_cast<int>(idx);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sll), sizeof sll) < 0) throw fail("bind");
  // Frames for the other hosts' addresses arrive here too (a bridge port sees them all).
  packet_mreq mr{};
  mr.mr_ifindex = static_cast<int>(idx);
  mr.mr_type = PACKET_MR_PROMISC;
  if (::setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) < 0) throw fail("promiscuous mode");
  return fd;
}

// Reads every frame `d.in` has now into the queue, due `delay_ns` from now.
void take_in(Direction& d, std::vector<char>& buf, int64_t delay_ns, uint64_t limit) {
  for (;;) {
    ssize_t n = d.in_is_tap ? ::read(d.in, buf.data(), buf.size())
                            : ::recv(d.in, buf.data(), buf.size(), MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN (drained), or an error poll() reports again
    }
    if (n == 0) return;
    if (static_cast<size_t>(n) > buf.size() || d.queued_bytes + n > limit) {
      d.dropped.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    d.queue.push_back(Frame{now_ns() + delay_ns, std::vector<char>(buf.data(), buf.data() + n)});
    d.queued_bytes += n;
  }
}

// Sends the frames that are due; returns the due time of the next one (or -1).
int64_t send_due(Direction& d, int64_t now) {
  while (!d.queue.empty() && d.queue.front().due_ns <= now) {
    Frame& f = d.queue.front();
    ssize_t n;
    do {
      n = ::write(d.out, f.bytes.data(), f.bytes.size());
    } while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return now + 20000;  // socket buffer full: retry in 20 us
    if (n < 0) {
      d.dropped.fetch_add(1, std::memory_order_relaxed);  // e.g. ENOBUFS: the rate limiter's queue is full
    } else {
      d.frames.fetch_add(1, std::memory_order_relaxed);
      d.bytes.fetch_add(f.bytes.size(), std::memory_order_relaxed);
    }
    d.queued_bytes -= f.bytes.size();
    d.queue.pop_front();
  }
  return d.queue.empty() ? -1 : d.queue.front().due_ns;
}

}  // namespace

struct DelayLine::Port {
  std::string link, tap;
  int tap_fd = -1, raw_fd = -1;
  Direction to_host, from_host;  // tap -> veth (toward the host), veth -> tap
  ~Port() {
    if (tap_fd >= 0) ::close(tap_fd);
    if (raw_fd >= 0) ::close(raw_fd);
  }

  void serve(int stop_fd, int64_t delay_ns, uint64_t limit) {
    pdkv::util::name_this_thread("pdkv-delay");
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);  // sleep to the microsecond, not the default 50 us
    std::vector<char> buf(kMaxFrame);
    for (;;) {
      const int64_t now = now_ns();
      int64_t next = -1;
      for (Direction* d : {&to_host, &from_host}) {
        const int64_t due = send_due(*d, now);
        if (due >= 0 && (next < 0 || due < next)) next = due;
      }
      pollfd p[3] = {{stop_fd, POLLIN, 0}, {tap_fd, POLLIN, 0}, {raw_fd, POLLIN, 0}};
      timespec ts{}, *timeout = nullptr;
      if (next >= 0) {
        const int64_t wait = std::max<int64_t>(0, next - now_ns());
        ts = {static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
        timeout = &ts;
      }
      const int r = ::ppoll(p, 3, timeout, nullptr);
      if (r < 0 && errno != EINTR) return;
      if (p[0].revents) return;
      if (p[1].revents & POLLIN) take_in(to_host, buf, delay_ns, limit);
      if (p[2].revents & POLLIN) take_in(from_host, buf, delay_ns, limit);
      if ((p[1].revents | p[2].revents) & (POLLERR | POLLNVAL)) return;
    }
  }
};

DelayLine::DelayLine(const std::vector<std::string>& links, double one_way_delay_s, uint64_t queue_limit_bytes)
    : delay_ns_(static_cast<int64_t>(one_way_delay_s * 1e9)), limit_(queue_limit_bytes) {
  if (!(one_way_delay_s >= 0) || one_way_delay_s > 10) throw std::invalid_argument("one-way delay must be in [0, 10] s");
  if (links.empty()) throw std::invalid_argument("no links given");
  for (const auto& link : links) {
    if (link.empty() || link.size() > IFNAMSIZ - 3) throw std::invalid_argument("link name '" + link + "' is too long");
    auto p = std::make_unique<Port>();
    p->link = link;
    p->tap = "d-" + link;
    p->tap_fd = open_tap(p->tap);
    p->raw_fd = open_raw(link);
    p->to_host.in = p->tap_fd;
    p->to_host.in_is_tap = true;
    p->to_host.out = p->raw_fd;
    p->from_host.in = p->raw_fd;
    p->from_host.out = p->tap_fd;
    ports_.push_back(std::move(p));
  }
}

DelayLine::~DelayLine() = default;

std::vector<std::string> DelayLine::taps() const {
  std::vector<std::string> out;
  for (const auto& p : ports_) out.push_back(p->tap);
  return out;
}

void DelayLine::run(int stop_fd) {
  std::vector<std::thread> threads;
  for (auto& p : ports_) {
    Port* port = p.get();
    threads.emplace_back([port, stop_fd, this] { port->serve(stop_fd, delay_ns_, limit_); });
  }
  for (auto& t : threads) t.join();
}

std::vector<LinkCounters> DelayLine::counters() const {
  std::vector<LinkCounters> out;
  for (const auto& p : ports_) {
    LinkCounters c;
    c.link = p->link;
    c.frames_to_host = p->to_host.frames.load();
    c.bytes_to_host = p->to_host.bytes.load();
    c.frames_from_host = p->from_host.frames.load();
    c.bytes_from_host = p->from_host.bytes.load();
    c.dropped = p->to_host.dropped.load() + p->from_host.dropped.load();
    out.push_back(std::move(c));
  }
  return out;
}

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<DelayLine>(m, "DelayLine", "netlab's userspace delay line (python -m pdkv.lab.netlab.delay runs it)")
      .def(py::init<const std::vector<std::string>&, double, uint64_t>(), py::arg("links"),
           py::arg("one_way_delay_s"), py::arg("queue_limit_bytes"))
      .def_property_readonly("taps", &DelayLine::taps)
      .def("run", &DelayLine::run, py::arg("stop_fd"), py::call_guard<py::gil_scoped_release>())
      .def("counters", [](const DelayLine& d) {
        py::list out;
        for (const auto& c : d.counters()) {
          py::dict row;
          row["link"] = c.link;
          row["frames_to_host"] = c.frames_to_host;
          row["frames_from_host"] = c.frames_from_host;
          row["bytes_to_host"] = c.bytes_to_host;
          row["bytes_from_host"] = c.bytes_from_host;
          row["dropped"] = c.dropped;
          out.append(row);
        }
        return out;
      });
}

}  // namespace netlab
