#include "transport/shm/conn.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "transport/shm/peer_identity.h"
#include "util/socket.h"

namespace pdkv::shm {
namespace {

constexpr size_t kMaxQueuedFds = 4;  // fds received ahead of their RegionResp

}  // namespace

RemoteRegion::~RemoteRegion() {
  if (base) ::munmap(base, shared_len);
}

// ---------------------------------------------------------------- identity

std::shared_ptr<ShmConn> ShmConn::dialled(int fd, std::string desc, std::string peer_name, pid_t peer_pid,
                                          int peer_pidfd) {
  return std::shared_ptr<ShmConn>(
      new ShmConn(fd, true, std::move(desc), std::move(peer_name), peer_pid, peer_pidfd, Clock::time_point::max()));
}

std::shared_ptr<ShmConn> ShmConn::accepted(int fd, pid_t peer_pid, Clock::time_point hello_deadline) {
  return std::shared_ptr<ShmConn>(
      new ShmConn(fd, false, "local process " + std::to_string(peer_pid), "", peer_pid, -1, hello_deadline));
}

ShmConn::ShmConn(int fd, bool outbound, std::string desc, std::string peer_name, pid_t peer_pid, int peer_pidfd,
                 Clock::time_point hello_deadline)
    : fd_(fd),
      outbound_(outbound),
      base_desc_(std::move(desc)),
      peer_pid_(peer_pid),
      peer_pidfd_(peer_pidfd),
      hello_deadline_(hello_deadline),
      peer_name_(std::move(peer_name)),
      authed_(outbound) {}  // a dialled connection finished its handshake before this

ShmConn::~ShmConn() {
  if (fd_ >= 0) ::close(fd_);
  if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
  for (int f : fds_) ::close(f);
  for (auto& [id, a] : shared_.answers)
    if (a.fd >= 0) ::close(a.fd);
}

bool ShmConn::peer_exited() const { return peer_process_exited(peer_pidfd_); }

std::string ShmConn::desc() const {
  if (outbound_ || !authed()) return base_desc_;
  return "peer '" + peer_name_ + "' (" + base_desc_ + ")";
}

const std::string& ShmConn::peer_name() const {
  static const std::string unknown;
  return authed() ? peer_name_ : unknown;
}

void ShmConn::authenticate(std::string name) {
  if (authed()) return;
  peer_name_ = std::move(name);
  authed_.store(true, std::memory_order_release);
}

// ---------------------------------------------------------------- shared state

RemoteGens::~RemoteGens() {
  if (base) ::munmap(const_cast<uint32_t*>(base), size_t{n} * sizeof(uint32_t));
}

bool ShmConn::retire(const Status& why, std::map<uint64_t, PendingNotify>* notifies, std::map<uint64_t, Lease>* leases) {
  std::lock_guard<std::mutex> lk(mu_);
  if (shared_.dead) return false;
  shared_.dead = true;
  gone_.store(true, std::memory_order_release);
  shared_.dead_reason = why;
  notifies->swap(shared_.notifies);
  for (auto& [id, a] : shared_.gen_answers)
    if (a.fd >= 0) ::close(a.fd);
  shared_.gen_answers.clear();
  leases->swap(shared_.leases);
  shared_.leased_blocks = 0;
  cv_.notify_all();
  return true;
}

// ---------------------------------------------------------------- sending

Status ShmConn::send_frame(Ctl type, uint64_t id, std::string_view aux, uint32_t status, int pass_fd) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, id, static_cast<uint32_t>(aux.size()), status};
  std::lock_guard<std::mutex> lk(send_mu_);
  iovec iov[2] = {{&h, sizeof h}, {const_cast<char*>(aux.data()), aux.size()}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = aux.empty() ? 1 : 2;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))];
  if (pass_fd >= 0) {
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    cmsghdr* cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
  }
  size_t want = sizeof h + aux.size(), done = 0;
  const auto deadline = util::deadline_after(5.0);
  while (done < want) {
    ssize_t w = ::sendmsg(fd_, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (Clock::now() > deadline) return TimeoutError("sending to " + desc() + " timed out");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      return ConnectionError("sending to " + desc() + " failed: " + util::errno_str(errno));
    }
    done += static_cast<size_t>(w);
    mh.msg_control = nullptr;  // the fd went with the first byte
    mh.msg_controllen = 0;
    util::advance_iov(mh, static_cast<size_t>(w));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- receiving

ShmConn::RxStep ShmConn::read_frame(uint32_t max_notif, Status* err) {
  for (;;) {
    char* dst;
    size_t want;
    if (!in_aux_) {
      dst = reinterpret_cast<char*>(&hdr_) + hdr_got_;
      want = sizeof(CtlHdr) - hdr_got_;
    } else {
      dst = aux_.data() + aux_got_;
      want = aux_.size() - aux_got_;
    }
    iovec iov{dst, want};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxQueuedFds)];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (outbound_) {  // only a target sends fds (with RegionResp)
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
    }
    ssize_t r = ::recvmsg(fd_, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return RxStep::kEmpty;
      *err = ConnectionError("receiving from " + desc() + " failed: " + util::errno_str(errno));
      return RxStep::kBroken;
    }
    if (r == 0) {
      *err = ConnectionError(desc() + " closed the connection");
      return RxStep::kBroken;
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); outbound_ && cm; cm = CMSG_NXTHDR(&mh, cm)) {
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof f);
          fds_.push_back(f);
        }
      }
    }
    if (fds_.size() > kMaxQueuedFds) {
      *err = ProtocolError(desc() + " sent more file descriptors than region responses");
      return RxStep::kBroken;
    }
    if (!in_aux_) {
      if (hdr_got_ == 0)  // a frame starts: it must be complete in time
        frame_deadline_ = util::deadline_after(kFrameTimeoutS).time_since_epoch().count();
      hdr_got_ += static_cast<size_t>(r);
      if (hdr_got_ < sizeof(CtlHdr)) continue;
      const CtlSide side = outbound_   ? CtlSide::kInitiator
                           : authed()  ? CtlSide::kTarget
                           : handshake_ ? CtlSide::kTargetProof
                                        : CtlSide::kTargetPreHello;
      Status st = check_ctl_header(hdr_, side, max_notif);
      if (!st.ok()) {
        *err = ProtocolError(desc() + ": " + st.message());
        return RxStep::kBadHeader;
      }
      aux_.assign(hdr_.aux_len, '\0');  // bounded by check_ctl_header
      aux_got_ = 0;
      in_aux_ = hdr_.aux_len > 0;
      if (in_aux_) continue;
    } else {
      aux_got_ += static_cast<size_t>(r);
      if (aux_got_ < aux_.size()) continue;
    }
    in_aux_ = false;
    hdr_got_ = 0;
    frame_deadline_ = Clock::time_point::max().time_since_epoch().count();
    return RxStep::kFrame;
  }
}

int ShmConn::take_fd() {
  if (fds_.empty()) return -1;
  const int f = fds_.front();
  fds_.pop_front();
  return f;
}

}  // namespace pdkv::shm
