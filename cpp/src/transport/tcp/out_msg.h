// One outgoing frame and the cursor that sends it in pieces.
//
// A frame on the wire is header | extent descriptors | aux | payload (wire.h). An
// OutMsg points at those four parts where they already live (the prepared
// transfer's descriptor array, registered memory, a pinned staging buffer) instead
// of copying them, and keeps alive what it points at until the last byte left.
// send_some() writes as much as a non-blocking socket takes and remembers where it
// stopped, so a frame can be finished later by the connection's owner thread.
//
// Thread safety: an OutMsg is owned by one send queue (TcpConn::sq_, under smu_).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/status.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

// Most iovecs one sendmsg/recvmsg takes (IOV_MAX on Linux).
inline constexpr int kIovMax = 1024;
inline constexpr size_t kHdr = sizeof(FrameHeader);

FrameHeader make_hdr(FrameType t, uint64_t xfer, uint32_t batch);

struct OutMsg {
  FrameHeader hdr{};
  const void* descs = nullptr;
  size_t desc_bytes = 0;
  std::string aux;
  const iovec* data = nullptr;
  size_t ndata = 0;
  std::vector<iovec> own_iov;
  std::vector<RegionPin> pins;        // released once sent (read responses)
  GenPin gens;                        // blocks checked for this read response, released once sent
  std::shared_ptr<const void> keep;   // keeps descs/data alive
  std::shared_ptr<const void> lease;  // pinned staging buffer holding the data
  uint64_t total = 0;
  uint64_t sent = 0;
  size_t seg = 0;
  size_t seg_off = 0;

  size_t nsegs() const { return 3 + ndata; }
  iovec segment(size_t i) const;
  // Memory this message holds besides the registered data it points at (counted
  // against the connection's back-pressure limit).
  size_t cost() const {
    return sizeof(OutMsg) + own_iov.size() * sizeof(iovec) + pins.size() * sizeof(RegionPin) + aux.size();
  }
  // Fixes aux_len and the total once every part is set; call before queueing.
  void finalize();
  // Records that `w` more bytes left.
  void advance(size_t w);
};

// Sends as much of `m` as the socket takes. 1: all sent, 0: would block, -1: error (*err).
int send_some(int fd, OutMsg& m, int* err);

// An error frame telling the peer why it is being dropped (message cut to kMaxErrorBytes).
OutMsg error_frame(const Status& st, uint64_t xfer, uint32_t batch);

}  // namespace pdkv::tcp
