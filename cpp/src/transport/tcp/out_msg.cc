#include "transport/tcp/out_msg.h"

#include <sys/socket.h>

#include <cerrno>

namespace pdkv::tcp {

FrameHeader make_hdr(FrameType t, uint64_t xfer, uint32_t batch) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(t);
  h.xfer_id = xfer;
  h.batch = batch;
  return h;
}

iovec OutMsg::segment(size_t i) const {
  switch (i) {
    case 0: return {const_cast<FrameHeader*>(&hdr), kHdr};
    case 1: return {const_cast<void*>(descs), desc_bytes};
    case 2: return {const_cast<char*>(aux.data()), aux.size()};
    default: return data[i - 3];
  }
}

void OutMsg::finalize() {
  hdr.aux_len = static_cast<uint32_t>(aux.size());
  if (!own_iov.empty()) {
    data = own_iov.data();
    ndata = own_iov.size();
  }
  total = kHdr + desc_bytes + aux.size();
  for (size_t i = 0; i < ndata; ++i) total += data[i].iov_len;
}

void OutMsg::advance(size_t w) {
  sent += w;
  while (w > 0) {
    iovec v = segment(seg);
    size_t left = v.iov_len - seg_off;
    if (w >= left) {
      w -= left;
      ++seg;
      seg_off = 0;
    } else {
      seg_off += w;
      w = 0;
    }
  }
}

int send_some(int fd, OutMsg& m, int* err) {
  iovec iov[kIovMax];
  while (m.sent < m.total) {
    int n = 0;
    size_t off = m.seg_off;
    for (size_t s = m.seg; s < m.nsegs() && n < kIovMax; ++s) {
      iovec v = m.segment(s);
      if (v.iov_len > off) {
        iov[n].iov_base = static_cast<char*>(v.iov_base) + off;
        iov[n].iov_len = v.iov_len - off;
        ++n;
      }
      off = 0;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      *err = errno;
      return -1;
    }
    m.advance(static_cast<size_t>(w));
  }
  return 1;
}

OutMsg error_frame(const Status& st, uint64_t xfer, uint32_t batch) {
  OutMsg m;
  m.hdr = make_hdr(FrameType::kError, xfer, batch);
  m.hdr.status = static_cast<uint32_t>(st.code());
  m.aux = st.message().substr(0, kMaxErrorBytes);
  m.finalize();
  return m;
}

}  // namespace pdkv::tcp
