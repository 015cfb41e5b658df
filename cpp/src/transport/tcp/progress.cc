#include "transport/tcp/progress.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include "transport/tcp/tcp_transport_impl.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::tcp {
namespace {

using util::errno_str;

// The listener, out of file descriptors, stops watching for this long when it
// cannot even shed the pending connection.
constexpr auto kListenPause = std::chrono::milliseconds(100);
// After activity the thread keeps waking every 20 ms for this long instead of
// sleeping indefinitely, so the next post needs no eventfd wake-up (and deadlines
// are enforced).
constexpr auto kLinger = std::chrono::milliseconds(200);
constexpr auto kScanInterval = std::chrono::milliseconds(10);

// epoll data of the two non-connection descriptors.
void* const kEventFdTag = nullptr;

}  // namespace

ProgressThread::ProgressThread(TcpTransport* t, uint32_t spin_us) : t_(t), spin_us_(spin_us), frames_(*t) {}

ProgressThread::~ProgressThread() {
  if (epfd_ >= 0) ::close(epfd_);
  if (evfd_ >= 0) ::close(evfd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
}

Status ProgressThread::start(int listen_fd) {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || evfd_ < 0) return Internal("epoll/eventfd: " + errno_str(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = kEventFdTag;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  if (listen_fd >= 0) {
    listen_fd_ = listen_fd;
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ev.data.ptr = this;  // the listener
    epoll_ctl(epfd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  }
  th_ = std::thread([this] { run(); });
  return Status::Ok();
}

void ProgressThread::stop() {
  stop_.store(true);
  wake();
  if (th_.joinable()) th_.join();
  std::vector<std::shared_ptr<TcpConn>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [p, c] : conns_) all.push_back(c);
  }
  for (auto& c : all) t_->kill(c, ConnectionError("agent is shutting down"));
  std::lock_guard<std::mutex> lk(mu_);
  conns_.clear();
  graveyard_.clear();
}

void ProgressThread::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(evfd_, &one, sizeof one);
  (void)r;
}

void ProgressThread::add(const std::shared_ptr<TcpConn>& c, bool handshake) {
  if (handshake) slow_begin();
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns_[c.get()] = c;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = c.get();
  epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd(), &ev);
  if (handshake) wake();  // start the handshake timer
}

void ProgressThread::set_interest(TcpConn& c, bool in, bool out) {
  epoll_event ev{};
  ev.events = (in ? uint32_t(EPOLLIN | EPOLLRDHUP) : 0u) | (out ? uint32_t(EPOLLOUT) : 0u);
  ev.data.ptr = &c;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, c.fd(), &ev);
}

void ProgressThread::request_kill(const std::shared_ptr<TcpConn>& c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    kill_q_.push_back(c);
  }
  wake();
}

void ProgressThread::enqueue(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m) {
  // After c's send lock is released: mu_ is a leaf lock.
  if (c->send(std::move(m)) == TcpConn::SendResult::kFailed) request_kill(c);
}

void ProgressThread::run() {
  util::name_this_thread("pdkv-tcp");
  epoll_event evs[64];
  auto last_active = Clock::now();
  auto next_scan = Clock::now();
  const auto spin = std::chrono::microseconds(spin_us_);
  auto last_busy = Clock::now() - kLinger;
  while (!stop_.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    const bool busy = npending.load(std::memory_order_acquire) > 0 || nslow_.load() > 0 || nwatch_.load() > 0;
    if (busy) last_busy = now;
    int timeout = -1;
    if (spin_us_ > 0 && now - last_active < spin) {
      timeout = 0;
    } else if (busy || now - last_busy < kLinger) {
      timeout = 20;
    }
    if (listen_paused_) {
      if (now >= listen_resume_) {
        resume_listener();
      } else if (timeout < 0 || timeout > 20) {
        timeout = 20;
      }
    }
    if (timeout < 0) idle_.store(true, std::memory_order_release);
    int n = ::epoll_wait(epfd_, evs, 64, timeout);
    idle_.store(false, std::memory_order_release);
    if (n < 0 && errno != EINTR) {
      PDKV_LOG_ERROR("epoll_wait: %s", errno_str(errno).c_str());
      break;
    }
    if (n > 0) last_active = Clock::now();
    for (int i = 0; i < n; ++i) {
      void* p = evs[i].data.ptr;
      if (p == kEventFdTag) {
        uint64_t v;
        ssize_t r = ::read(evfd_, &v, sizeof v);
        (void)r;
        kill_requested();
        continue;
      }
      if (p == this) {
        accept_all();
        continue;
      }
      std::shared_ptr<TcpConn> c;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = conns_.find(static_cast<TcpConn*>(p));
        if (it == conns_.end()) continue;
        c = it->second;
      }
      // A hang-up or error while output is queued ends in flush (the send fails), also
      // when reading is paused by back-pressure.
      if (evs[i].events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) flush(c);
      // A waiting caller may be reading this connection itself: leave it to them.
      auto rl = c->try_lock_rx();
      if (!rl || c->fd() < 0) continue;
      if (c->draining()) {
        drain(c);
        continue;
      }
      if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) on_readable(c);
    }
    if (busy && Clock::now() >= next_scan) {
      scan_deadlines();
      next_scan = Clock::now() + kScanInterval;
    }
    graveyard_.clear();
  }
}

void ProgressThread::kill_requested() {
  std::vector<std::shared_ptr<TcpConn>> kq;
  {
    std::lock_guard<std::mutex> lk(mu_);
    kq.swap(kill_q_);
  }
  for (auto& c : kq) {
    const Status why = c->kill_reason();
    t_->kill(c, why.ok() ? ConnectionError("connection to " + c->desc() + " failed") : why);
  }
}

void ProgressThread::accept_all() {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of descriptors (or kernel memory): the listen socket stays readable, so
      // returning would spin. Shed the pending connections, or stop watching a while.
      if (err == EMFILE || err == ENFILE) {
        const int shed = shed_one();
        if (shed > 0) continue;
        if (shed == 0) return;
      }
      pause_listener(err);
      return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char host[64] = "?";
    uint16_t port = 0;
    if (ss.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      port = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      port = ntohs(a->sin6_port);
    }
    // TcpOptions::max_inbound_conns, counted before any work is spent on it (TLS).
    uint32_t open = 0;
    auto slot = t_->admission().accept(&open);
    const std::string refused = "this agent has " + std::to_string(open) +
                                " inbound connections open (TcpOptions.max_inbound_conns); refusing one from " + host;
    const auto hello_deadline = util::deadline_after(t_->opts().handshake_timeout_s);
    std::shared_ptr<TlsChannel> tls;
    if (t_->tls()) {  // the session's handshake runs on its pump thread; the hello comes through it
      if (!slot) {  // (no error frame without a session: closed at once)
        ::close(fd);
        t_->log_rejected("tcp: " + refused);
        continue;
      }
      util::ScopedFd plain;
      auto ch = TlsChannel::accept(t_->tls(), fd, hello_deadline, &plain);  // takes fd
      if (!ch.ok()) {
        t_->log_rejected("tcp: TLS for an inbound connection from " + std::string(host) + ": " + ch.status().message());
        continue;
      }
      tls = std::move(ch).value();
      fd = plain.release();
    }
    ProgressThread* owner = t_->pick_thread();
    auto c = TcpConn::accepted(fd, owner, "inbound connection from " + std::string(host) + ":" + std::to_string(port),
                               host, hello_deadline);
    c->set_tls(std::move(tls));
    owner->add(c, true);
    if (slot) {
      c->hold(std::move(slot));
    } else {
      // Over TcpOptions::max_inbound_conns: told why (an error frame before its hello
      // is answered), then closed like any refused connection.
      auto lk = c->lock_rx();
      if (c->fd() >= 0) t_->fail_conn_locked(c, ResourceExhausted(refused));
    }
  }
}

int ProgressThread::shed_one() {
  if (spare_fd_ < 0) spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (spare_fd_ < 0) return -1;
  ::close(spare_fd_);
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  const int err = errno;
  if (fd >= 0) ::close(fd);  // the peer sees the connection closed and can retry later
  spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return (err == EAGAIN || err == EWOULDBLOCK) ? 0 : -1;
  t_->log_rejected("tcp: out of file descriptors: closed an incoming connection at once");
  return 1;
}

void ProgressThread::pause_listener(int err) {
  t_->log_rejected("tcp: accepting connections failed (" + errno_str(err) + "); pausing the listener for " +
                   std::to_string(kListenPause.count()) + " ms");
  epoll_event ev{};
  ev.events = 0;
  ev.data.ptr = this;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  listen_paused_ = true;
  listen_resume_ = Clock::now() + kListenPause;
}

void ProgressThread::resume_listener() {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = this;
  epoll_ctl(epfd_, EPOLL_CTL_MOD, listen_fd_, &ev);
  listen_paused_ = false;
}

void ProgressThread::flush(const std::shared_ptr<TcpConn>& c) {
  if (c->flush()) request_kill(c);
}

void ProgressThread::drain(const std::shared_ptr<TcpConn>& c) {
  char buf[65536];
  for (;;) {
    ssize_t r = ::recv(c->fd(), buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) continue;
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && Clock::now() < c->deadline()) return;
    break;  // EOF, error or drain deadline: close for good
  }
  epoll_ctl(epfd_, EPOLL_CTL_DEL, c->fd(), nullptr);
  c->close_socket();  // ends its draining count
  std::lock_guard<std::mutex> lk(mu_);
  graveyard_.push_back(c);
  conns_.erase(c.get());
}

void ProgressThread::scan_deadlines() {
  const auto now = Clock::now();
  // A snapshot, so no connection lock is taken under mu_ (a leaf lock).
  std::vector<std::shared_ptr<TcpConn>> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    all.reserve(conns_.size());
    for (auto& [p, c] : conns_) all.push_back(c);
  }
  struct Doomed {
    std::shared_ptr<TcpConn> conn;
    Status why;  // OK: a draining connection whose linger time is over
    uint64_t culprit = 0;
  };
  std::vector<Doomed> doomed;
  for (auto& c : all) {
    if (c->fd() < 0) continue;
    if (c->draining()) {
      if (now >= c->deadline()) doomed.push_back({c, Status::Ok()});
      continue;
    }
    if (!c->authed() && !c->outbound()) {
      if (now >= c->deadline())
        doomed.push_back({c, TimeoutError(c->desc() + " did not complete the handshake in time")});
      continue;  // a half-sent hello is bounded by the handshake deadline
    }
    Status stalled = frame_stalled(*c, now);
    if (!stalled.ok()) {
      doomed.push_back({c, std::move(stalled)});
      continue;
    }
    const uint64_t culprit = c->expired_transfer(now);
    if (culprit) {
      doomed.push_back({c,
                        TimeoutError("transfer " + std::to_string(culprit) + " to " + c->desc() +
                                     " timed out; the peer stalled or the link is too slow"),
                        culprit});
    }
  }
  for (auto& d : doomed) {
    const auto& c = d.conn;
    // A caller driving c (TcpTransport::drive) checks the same deadlines itself.
    auto rl = c->try_lock_rx();
    if (!rl || c->fd() < 0) continue;
    if (c->draining()) {
      drain(c);
      continue;
    }
    if (!c->outbound()) {
      t_->fail_conn_locked(c, d.why);  // tell the silent client why it is dropped
    } else {
      t_->kill_locked(c, d.why, d.culprit);
    }
  }
}

Status ProgressThread::frame_stalled(TcpConn& c, Clock::time_point now) {
  const double limit_s = t_->opts().frame_timeout_s;
  return c.frame_stalled(now, std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit_s)),
                         limit_s);
}

void ProgressThread::on_readable(const std::shared_ptr<TcpConn>& c, const Transfer* until) {
  const uint64_t got = frames_.receive(c, until);
  if (c->open()) c->note_received(got);  // not when it was closed meanwhile
}

}  // namespace pdkv::tcp
