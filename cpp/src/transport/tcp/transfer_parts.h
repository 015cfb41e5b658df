// What a transfer is inside the tcp transport, from prepare() to the last ack.
//
// prepare() cuts the extents into batches (TcpPrepared: one frame each, reusable);
// post() makes a TcpPost that lives until every batch is resolved; each batch in
// flight is a PendingPart in the table of the connection that carries it, keyed by
// (transfer id, batch), until its ack or read response arrives, the connection dies
// or the transfer is cancelled. PeerConns is the fixed set of connection slots to
// one peer instance.
//
// Thread safety: TcpPrepared is immutable once prepared. The fields of TcpPost and
// PeerConns say what guards them.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/spi/transport.h"
#include "util/socket.h"
#include "transport/tcp/compress.h"
#include "transport/tcp/scatter.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

class TcpConn;

// One frame's worth of a prepared transfer.
struct TcpBatch {
  uint32_t first = 0;  // index into iov (the local pieces), or into runs (TcpPrepared::lazy)
  uint32_t count = 0;  // of those entries
  uint64_t bytes = 0;
  uint32_t desc_first = 0;  // index into descs, sdescs or sdescs2 (the frame's descriptors)
  uint32_t desc_count = 0;
  uint64_t pieces = 0;  // remote pieces the descriptors name (strided: kMaxStridedPieces at most)
  uint64_t extents = 0;  // lazy: local pieces its runs hold (touching pieces count once)
};

struct TcpPrepared final : PreparedOps {
  std::shared_ptr<const Peer> peer;
  OpKind op = OpKind::kWrite;
  std::vector<WireExtent> descs;  // remote side, parallel to iov (plain frames)
  std::vector<iovec> iov;         // local side
  // The peer takes strided frames and the transfer has strided runs: the remote side
  // is sdescs (kFlagStrided frames), not parallel to iov (a run whose local pieces
  // touch is one iovec, one whose local pieces are apart one iovec per piece).
  bool strided = false;
  std::vector<WireStridedExtent> sdescs;
  // The peer takes two-level frames and the transfer has two-level runs: the remote
  // side is sdescs2 (kFlagStrided2 frames; one-level runs as count2 = 1), not sdescs.
  bool two_level = false;
  std::vector<WireStrided2Extent> sdescs2;
  // Strided frames from host memory: the local side is `runs` (one per descriptor),
  // not `iov`; pieces are generated while gathering or landing (scatter.h), so
  // prepare is O(runs). Codecs list a batch's pieces when they need them (iovecs_of).
  bool lazy = false;
  std::vector<PieceRun> runs;
  std::vector<TcpBatch> batches;
  uint64_t total = 0;
  // Local extents in device memory: WRITE batches are gathered into pinned buffers
  // before sending, READ responses are scattered out of them (cuda/staging.h).
  bool staged = false;
  int device = -1;
  // Block generation claim (u32 length + claim) sent at the start of every frame's
  // aux, so the target checks it per frame before its bytes land or are sent.
  std::string claim_aux;
  // This transfer's compression mode (the agent's, or the caller's XferOptions::compress).
  CompressMode zmode = CompressMode::kOff;
  // Compression kAuto: the same extents cut into plain-sized batches, sent instead
  // when the transfer goes plain (these batches are codec chunks).
  std::shared_ptr<TcpPrepared> plain;
};

// The connection slots to one peer instance (replaced when the peer restarts).
struct PeerConns : std::enable_shared_from_this<PeerConns> {
  std::shared_ptr<const Peer> peer;
  util::HostPort hp;
  std::mutex mu;                                // guards conns
  std::vector<std::shared_ptr<TcpConn>> conns;  // [conns_per_peer]; null or dead: dial on next use
  std::atomic<uint32_t> rr{0};                  // round-robin start slot of the next post
  PeerFeatures features;                        // from its tcp metadata extra (compressed writes?)
  LinkChooser chooser;                          // compression kAuto: writes plain or compressed
  LinkChooser read_chooser;                     // ... and reads
  explicit PeerConns(const std::string& name) : chooser(name, "writes to"), read_chooser(name, "reads from") {}
};

// State of one posted transfer inside the transport.
struct TcpPost {
  std::shared_ptr<Transfer> xfer;
  std::shared_ptr<const TcpPrepared> prep;  // null for a notification-only post
  std::shared_ptr<PeerConns> pc;
  std::string notif;
  bool separate_notif = false;  // sent as kNotify after every data batch is acked
  std::atomic<uint32_t> data_left{0};
  std::atomic<bool> data_failed{false};  // a batch failed (or never left): send no notification
  std::mutex mu;
  std::vector<std::weak_ptr<TcpConn>> conns;  // guarded by mu; for cancel
  Status connect_err;                          // guarded by mu: later batches fail fast
  Choice compress;                             // fixed at post: batches go as kWriteZ (reads: ask kReadRespZ)
  ReadZSpec zspec{};                           // compressed read: what its requests ask for
  // A plain kAuto read: samples the codec on the landed bytes before it completes
  // (the read chooser had no figures, or it is time to sample again).
  bool sample_codec = false;
  std::atomic<uint32_t> reads_unsettled{0};  // read: data parts not yet resolved
  std::atomic<bool> read_failed{false};      // read: a data part failed
  uint32_t zbase = 0;                          // compressed: slot of batch 0
  uint32_t znext = 0;                          // guarded by mu: next batch to encode
  uint32_t zinflight = 0;                      // guarded by mu: encoded (or encoding), not yet sent
  Clock::time_point posted = Clock::now();
};

// One batch in flight, in the pending table of the connection carrying it.
struct PendingPart {
  std::shared_ptr<TcpPost> post;
  uint32_t batch = 0;
  uint64_t bytes = 0;
  const iovec* dst = nullptr;  // kReadReq: where the response lands
  uint32_t ndst = 0;
  const PieceRun* runs = nullptr;  // ... or there (a lazy prepared transfer's)
  uint32_t nruns = 0;
  uint64_t extents = 0;  // local extents of dst or runs
};

// The local pieces of batch `b` as iovecs: a pointer into p.iov, or for a lazy
// transfer the pieces listed into `scratch`.
inline const iovec* iovecs_of(const TcpPrepared& p, const TcpBatch& b, std::vector<iovec>& scratch, uint32_t* n) {
  if (!p.lazy) {
    *n = b.count;
    return &p.iov[b.first];
  }
  scratch.clear();
  append_iovecs(&p.runs[b.first], b.count, scratch);
  *n = static_cast<uint32_t>(scratch.size());
  return scratch.data();
}

// Key of a pending part: (transfer id, batch).
inline uint64_t pending_key(uint64_t xfer, uint32_t batch) { return (xfer << 32) ^ batch; }

}  // namespace pdkv::tcp
