// One outgoing frame and the cursor that sends it in pieces.
//
// A frame on the wire is header | extent descriptors | aux | payload (wire.h). An
// OutMsg points at those four parts where they already live (the prepared
// transfer's descriptor array, registered memory, a pinned staging buffer) instead
// of copying them, and keeps alive what it points at until the last byte left.
// send_some() writes as much as a non-blocking socket takes and remembers where it
// stopped, so a frame can be finished later by the connection's owner thread.
//
// Small extents are the exception to pointing: the kernel sets up a copy per iovec
// segment, which for extents of a few hundred bytes costs more than the bytes
// (256-byte extents cost the sender ~2x the CPU per byte of gathered ones). A
// payload whose extents average under TcpOptions::gather_below_bytes is gathered, kStageBytes at
// a time, into a staging chunk that stays in cache, and sent from there as one
// segment. The frame on the wire is the same (docs/wire.md); the receiver decides
// on its own whether to land it in a buffer (TcpOptions::land_below_bytes, scatter.h). A payload
// may also be given as strided runs (a heterogeneous transfer's pieces): gathered
// from them piece by piece, or listed as iovecs by finalize when its pieces are large.
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
#include "transport/tcp/scatter.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

// Most iovecs one sendmsg/recvmsg takes (IOV_MAX on Linux).
inline constexpr int kIovMax = 1024;
inline constexpr size_t kHdr = sizeof(FrameHeader);

// The small-extent thresholds (TcpOptions::gather_below_bytes, land_below_bytes,
// pdkv/options/tcp.h, where the measurements behind their defaults are): payloads
// whose extents average fewer bytes than the first are gathered by the sender, fewer
// than the second landed in a buffer by the receiver. 4 KiB extents (block-halves)
// are gathered and stay direct at the receiver.
// The chunk gathered (sent) or landed (received) at a time: small enough to stay
// in the core's cache between the memcpy and the socket copy.
inline constexpr size_t kStageBytes = 256u << 10;
// Most extents in one frame of gathered extents (kMaxExtentsPerFrame bounds it on
// the wire; this keeps one frame's descriptors at 384 KiB).
inline constexpr uint32_t kMaxGatherExtents = 16384;

// False under the benchmark switch BenchSwitch::kTcpPieceIovecs (util/bench_switches.h):
// prepare lists one iovec per local piece of a strided run (as before lazy runs).
bool lazy_runs_allowed();
// False under the benchmark switch BenchSwitch::kTcpOneLevel: tcp does not take
// two-level runs (the agent expands them into one-level runs, as before).
bool two_level_wire_allowed();

// True when the sender gathers a payload of `bytes` over `extents` extents, given
// TcpOptions::gather_below_bytes (`below`).
inline bool gathers(uint64_t bytes, uint64_t extents, uint64_t below) {
  return extents > 1 && bytes < extents * below;
}
// True when the receiver lands a payload of `bytes` over `extents` extents, given
// TcpOptions::land_below_bytes (`below`).
inline bool lands(uint64_t bytes, uint64_t extents, uint64_t below) { return extents > 1 && bytes < extents * below; }

FrameHeader make_hdr(FrameType t, uint64_t xfer, uint32_t batch);

struct OutMsg {
  FrameHeader hdr{};
  const void* descs = nullptr;
  size_t desc_bytes = 0;
  std::string aux;
  const iovec* data = nullptr;
  size_t ndata = 0;
  std::vector<iovec> own_iov;
  // Or the payload as strided runs (a prepared transfer's, or a read request's): walked
  // by the gather when it gathers, else listed into own_iov by finalize.
  const PieceRun* runs = nullptr;
  size_t nruns = 0;
  std::vector<PieceRun> own_runs;
  std::vector<RegionPin> pins;        // released once sent (read responses)
  GenPin gens;                        // blocks checked for this read response, released once sent
  std::shared_ptr<const void> keep;   // keeps descs/data alive
  std::shared_ptr<const void> lease;  // pinned staging buffer holding the data
  uint64_t total = 0;
  uint64_t sent = 0;
  size_t seg = 0;
  size_t seg_off = 0;
  // A payload whose extents average fewer bytes is gathered: TcpOptions::gather_below_bytes,
  // set where a payload of several extents is attached (0: never, as for control frames).
  uint64_t gather_below = 0;
  // Gathered payload (set by finalize): the data goes out through `stage`.
  bool gather = false;
  std::unique_ptr<char[]> stage;  // kStageBytes, allocated when sending starts
  size_t stage_len = 0;           // bytes of the current chunk in stage
  size_t stage_off = 0;           // of which sent
  size_t gather_idx = 0;          // next byte to stage: data[gather_idx] + gather_off
  size_t gather_off = 0;
  RunCursor run_cur;              // ... or, from runs, this one

  size_t nsegs() const { return 3 + ndata; }
  iovec segment(size_t i) const;
  // Memory this message holds besides the registered data it points at (counted
  // against the connection's back-pressure limit; fixed once finalized).
  size_t cost() const {
    return sizeof(OutMsg) + own_iov.size() * sizeof(iovec) + own_runs.size() * sizeof(PieceRun) +
           pins.size() * sizeof(RegionPin) + aux.size() + (gather ? kStageBytes : 0);
  }
  // Fixes aux_len, the total and whether the payload is gathered once every part is
  // set; call before queueing.
  void finalize();
  // Records that `w` more bytes left (segment by segment).
  void advance(size_t w);
  // Gathered: records that `w` more bytes left (control segments, then the stage).
  void advance_gathered(size_t w);
  // Gathered: copies the next chunk of the payload into stage.
  void refill_stage();
};

// Sends as much of `m` as the socket takes. 1: all sent, 0: would block, -1: error (*err).
int send_some(int fd, OutMsg& m, int* err);

// An error frame telling the peer why it is being dropped (message cut to kMaxErrorBytes).
OutMsg error_frame(const Status& st, uint64_t xfer, uint32_t batch);

}  // namespace pdkv::tcp
