#include "transport/tcp/out_msg.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "transport/tcp/scatter.h"
#include "util/bench_switches.h"
#include "util/log.h"

namespace pdkv::tcp {

bool lazy_runs_allowed() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kTcpPieceIovecs, "1");
  return on;
}

bool two_level_wire_allowed() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kTcpOneLevel, "1");
  return on;
}

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
  if (!own_runs.empty()) {
    runs = own_runs.data();
    nruns = own_runs.size();
  }
  uint64_t payload = 0;
  if (runs) {
    // The same choice as for the pieces listed one by one; pieces too large to gather
    // are few (a batch holds at most batch_bytes), so listing them costs little.
    uint64_t pieces = 0;
    for (size_t i = 0; i < nruns; ++i) {
      payload += runs[i].bytes();
      pieces += runs[i].extents();
    }
    gather = gathers(payload, pieces, gather_below);
    if (!gather) {
      append_iovecs(runs, nruns, own_iov);
      runs = nullptr;
      nruns = 0;
    }
  }
  if (!own_iov.empty()) {
    data = own_iov.data();
    ndata = own_iov.size();
  }
  if (!gather) {  // from the iovecs (those listed from runs hold the same bytes)
    payload = 0;
    for (size_t i = 0; i < ndata; ++i) payload += data[i].iov_len;
    gather = gathers(payload, ndata, gather_below);
  }
  total = kHdr + desc_bytes + aux.size() + payload;
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

void OutMsg::advance_gathered(size_t w) {
  sent += w;
  while (seg < 3) {
    const size_t left = segment(seg).iov_len - seg_off;
    if (w < left) {
      seg_off += w;
      return;
    }
    w -= left;
    ++seg;
    seg_off = 0;
  }
  stage_off += w;
}

void OutMsg::refill_stage() {
  if (!stage) stage.reset(new char[kStageBytes]);  // uninitialized: every byte sent is copied in first
  if (runs) {
    stage_len = gather_from_runs(runs, nruns, run_cur, stage.get(), kStageBytes);  // scatter.h
  } else {
    IovCursor cur{gather_idx, gather_off};
    stage_len = gather_from_iov(data, ndata, cur, stage.get(), kStageBytes);
    gather_idx = cur.idx;
    gather_off = cur.off;
  }
  stage_off = 0;
}

namespace {

// One non-blocking sendmsg of `n` iovecs: the bytes sent (> 0), 0 when the socket
// buffer is full (EAGAIN; wait for EPOLLOUT), -1 on an error (`*err` = errno).
ssize_t send_iov(int fd, iovec* iov, int n, int* err) {
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = static_cast<size_t>(n);
  for (;;) {
    const ssize_t w = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) return w;
    if (w < 0 && errno == EINTR) continue;
    if (w == 0 || errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *err = errno;
    return -1;
  }
}

// send_some() of a gathered message: the control segments left, then the staged chunk.
int send_gathered(int fd, OutMsg& m, int* err) {
  while (m.sent < m.total) {
    iovec iov[4];
    int n = 0;
    size_t off = m.seg_off;
    for (size_t s = m.seg; s < 3; ++s) {
      const iovec v = m.segment(s);
      if (v.iov_len > off) iov[n++] = {static_cast<char*>(v.iov_base) + off, v.iov_len - off};
      off = 0;
    }
    if (m.stage_off == m.stage_len) m.refill_stage();
    if (m.stage_len > m.stage_off) iov[n++] = {m.stage.get() + m.stage_off, m.stage_len - m.stage_off};
    const ssize_t w = send_iov(fd, iov, n, err);
    if (w <= 0) return static_cast<int>(w);
    m.advance_gathered(static_cast<size_t>(w));
  }
  m.stage.reset();  // sent: the chunk is not kept with a message that waits for nothing
  return 1;
}

}  // namespace

int send_some(int fd, OutMsg& m, int* err) {
  if (m.gather) return send_gathered(fd, m, err);
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
    const ssize_t w = send_iov(fd, iov, n, err);
    if (w <= 0) return static_cast<int>(w);
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
