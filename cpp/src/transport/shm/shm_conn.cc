#include "transport/shm/shm_conn.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "util/socket.h"

namespace pdkv::shm {

RemoteRegion::~RemoteRegion() {
  if (base) ::munmap(base, len);
}

ShmConn::~ShmConn() {
  if (fd >= 0) ::close(fd);
  for (int f : fds) ::close(f);
  for (auto& [id, a] : answers)
    if (a.fd >= 0) ::close(a.fd);
}

Status send_frame(ShmConn& c, Ctl type, uint64_t id, std::string_view aux, uint32_t status, int pass_fd) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, id, static_cast<uint32_t>(aux.size()), status};
  std::lock_guard<std::mutex> lk(c.send_mu);
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
    ssize_t w = ::sendmsg(c.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (Clock::now() > deadline) return TimeoutError("sending to " + c.desc + " timed out");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      return ConnectionError("sending to " + c.desc + " failed: " + util::errno_str(errno));
    }
    done += static_cast<size_t>(w);
    mh.msg_control = nullptr;  // the fd went with the first byte
    mh.msg_controllen = 0;
    util::advance_iov(mh, static_cast<size_t>(w));
  }
  return Status::Ok();
}

}  // namespace pdkv::shm
