// TcpTransport::prepare (tcp_transport_impl.h): a transfer's resolved extents cut
// into batches of at most TcpOptions::batch_bytes / batch_extents, each with its wire
// descriptors (plain, strided or two-level), once; every post() reuses them. Posting
// is post.cc; the rest of the transport tcp_transport.cc.
#include <algorithm>
#include <cstring>

#include "transport/tcp/tcp_transport_impl.h"
#include "util/log.h"

namespace pdkv::tcp {
namespace {

// Raw bytes per batch of a write that may be compressed: the codec chunk, in whole
// FP8 scale groups (or rows) when FP8 may be chosen, so every frame is whole rows.
// At most `cap` bytes (device memory: a staging chunk); 0 when a row does not fit.
uint64_t compressed_batch_bytes(const TcpCompression& o, uint64_t cap = UINT64_MAX) {
  const uint64_t chunk = std::min<uint64_t>(o.chunk_bytes, cap);
  const bool fp8 = o.mode == CompressMode::kFp8 || (o.mode == CompressMode::kAuto && o.policy == CompressPolicy::kLossyAllowed);
  if (!fp8) return chunk;
  const uint64_t row = uint64_t(o.fp8.heads) * o.fp8.head_dim * dtype_size(o.dtype);
  const uint64_t group = row * o.fp8.rows_per_group;
  const uint64_t unit = group <= chunk ? group : row;  // validate() keeps row <= chunk_bytes
  return chunk / unit * unit;
}

}  // namespace

// ---------------------------------------------------------------- prepare

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                 std::vector<ResolvedExtent> extents) {
  return prepare_with(std::move(peer), op, std::move(extents), nullptr, TransferHints{});
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare_with(std::shared_ptr<const Peer> peer, OpKind op,
                                                                      std::vector<ResolvedExtent> extents,
                                                                      std::shared_ptr<const GenClaim> claim,
                                                                      const TransferHints& hints) {
  if (!peer->md.find_endpoint("tcp"))
    return NotSupported("peer '" + peer->md.name + "' publishes no tcp endpoint");
  TcpCompression z = opts_.compress;
  if (hints.compress) {
    z.mode = *hints.compress;
    // The agent's codec options were checked for its own mode, not this one (FP8 rows
    // against chunk_bytes).
    Status valid = z.validate();
    if (!valid.ok())
      return InvalidArgument("compress='" + std::string(compress_mode_name(z.mode)) +
                             "' does not fit the agent's tcp.compress options: " + valid.message());
  }
  auto p = std::make_shared<TcpPrepared>();
  p->peer = std::move(peer);
  p->op = op;
  p->zmode = z.mode;
  uint64_t batch_bytes = opts_.batch_bytes;
  for (const auto& e : extents)
    if (e.local_kind == MemKind::kCuda) {
      p->staged = true;
      p->device = e.local_device;
      break;
    }
  if (p->staged) {
    // Batches are staged through pinned chunks: no batch may exceed one.
    PDKV_ASSIGN_OR_RETURN(auto st, staging_.stager());
    batch_bytes = std::min(batch_bytes, st->chunk());
    if (z.mode != CompressMode::kOff && device_may_compress(z, p->device)) {
      // A compressed write's frames, or a compressed read's responses: codec chunks of
      // whole fp8 groups.
      batch_bytes = compressed_batch_bytes(z, st->chunk());
      if (batch_bytes == 0)
        return InvalidArgument("tcp stage_chunk_bytes (" + std::to_string(st->chunk()) +
                               ") is smaller than one fp8 row of the compressed device " +
                               (op == OpKind::kWrite ? "write" : "read"));
    }
  } else if (z.mode != CompressMode::kOff) {
    // Batches of a transfer that may be compressed are codec chunks: the pipeline
    // unit (a write's frames; a read's requests, each answered by one response).
    const uint64_t chunked = std::min(batch_bytes, compressed_batch_bytes(z));
    if (z.mode == CompressMode::kAuto && chunked < batch_bytes) {
      // auto may send it plain: then in plain-sized batches (1 MiB batches cost a
      // loopback write a third of its speed in acks and frames).
      auto plain = std::make_shared<TcpPrepared>();
      plain->peer = p->peer;
      plain->op = op;
      plain->zmode = z.mode;
      PDKV_RETURN_IF_ERROR(cut_batches(*plain, extents, batch_bytes));
      p->plain = std::move(plain);
    }
    batch_bytes = chunked;
  }
  PDKV_RETURN_IF_ERROR(cut_batches(*p, extents, batch_bytes));
  if (claim) {
    p->claim_aux = encode_claim_aux(encode_claim(*claim));
    if (p->plain) p->plain->claim_aux = p->claim_aux;
  }
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

// Strided runs go out as strided descriptors to a peer that takes them, two-level
// runs as two-level descriptors to a peer that takes those (else one one-level
// descriptor per repetition); to an older peer each run is expanded into one plain
// descriptor per piece.
Status TcpTransport::cut_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                 uint64_t batch_bytes) const {
  bool has_runs = false, has_two_level = false;
  for (const ResolvedExtent& e : extents) {
    has_runs |= e.count > 1 || e.count2 > 1;
    has_two_level |= e.count2 > 1;
  }
  const PeerFeatures f = peer_features(*p.peer);
  p.strided = has_runs && f.strided_extents;
  p.two_level = p.strided && has_two_level && f.two_level_extents && two_level_wire_allowed();
  if (p.strided && has_two_level && !p.two_level)
    cut_strided_batches(p, expand_two_level(extents), batch_bytes);
  else if (p.strided)
    cut_strided_batches(p, extents, batch_bytes);
  else if (has_runs)
    cut_plain_batches(p, expand_strided(extents), batch_bytes);
  else
    cut_plain_batches(p, extents, batch_bytes);
  constexpr uint64_t kMaxEntries = 0xFFFFFFFFull;  // batches index them with u32
  if (p.iov.size() > kMaxEntries || p.runs.size() > kMaxEntries || p.descs.size() > kMaxEntries ||
      p.sdescs.size() > kMaxEntries || p.sdescs2.size() > kMaxEntries)
    return InvalidArgument("transfer has too many extents");
  return Status::Ok();
}

PeerFeatures TcpTransport::peer_features(const Peer& peer) {
  for (const auto& [transport, extra] : peer.md.extras)
    if (transport == "tcp") return decode_extra(extra);
  return PeerFeatures{};
}

// A batch of small extents is gathered into one segment (out_msg.h), so it is not
// bound by the iovec limit behind batch_extents: it may grow to kMaxGatherExtents.
// Staged (device) batches go through one pinned buffer either way.
bool TcpTransport::batch_full(const TcpPrepared& p, const TcpBatch& cur) const {
  const uint64_t n = p.lazy && !p.staged ? cur.extents : cur.count;  // staged: gathered by runs
  if (n == 0) return false;
  if (n < opts_.batch_extents) return false;
  return p.staged || !gathers(cur.bytes, n, opts_.gather_below_bytes) || n >= kMaxGatherExtents;
}

void TcpTransport::cut_plain_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                     uint64_t batch_bytes) const {
  size_t n = 0;
  for (const auto& e : extents) n += (e.len + batch_bytes - 1) / batch_bytes;
  p.descs.reserve(n);
  p.iov.reserve(n);
  TcpBatch cur;
  auto close_batch = [&] {
    if (cur.count) p.batches.push_back(cur);
    const auto at = static_cast<uint32_t>(p.descs.size());
    cur = TcpBatch{at, 0, 0, at, 0, 0};
  };
  for (const auto& e : extents) {
    uint64_t off = 0;
    while (off < e.len) {
      uint64_t room = batch_bytes - cur.bytes;
      if (room == 0 || batch_full(p, cur)) {
        close_batch();
        room = batch_bytes;
      }
      uint64_t len = std::min(e.len - off, room);
      p.descs.push_back(WireExtent{e.remote_region, e.remote_offset + off, len});
      p.iov.push_back({reinterpret_cast<void*>(e.local_addr + off), len});
      ++cur.count;
      ++cur.desc_count;
      ++cur.pieces;
      cur.bytes += len;
      p.total += len;
      off += len;
    }
  }
  close_batch();
}

// Strided runs become strided descriptors, cut between batches at piece boundaries
// (a piece larger than a batch is cut like a plain extent). From host memory the
// local side stays a run per descriptor (p.lazy): prepare is O(runs). So does device
// memory: the strided-copy kernel gathers a write's runs into the pinned buffer and
// copies a read response out to them (cuda/strided_copy.h). Compressed device writes
// (their encoder walks iovecs) keep one iovec per piece.
void TcpTransport::cut_strided_batches(TcpPrepared& p, const std::vector<ResolvedExtent>& extents,
                                       uint64_t batch_bytes) const {
  p.lazy = lazy_runs_allowed() &&
           (!p.staged || (cuda::strided_kernel_enabled() && (p.op == OpKind::kRead || p.zmode == CompressMode::kOff)));
  if (p.two_level) {
    p.sdescs2.reserve(extents.size());
  } else {
    p.sdescs.reserve(extents.size());
  }
  if (p.lazy) {
    p.runs.reserve(extents.size());
  } else {
    p.iov.reserve(extents.size());
  }
  auto ndescs = [&] { return p.two_level ? p.sdescs2.size() : p.sdescs.size(); };
  TcpBatch cur;
  auto close_batch = [&] {
    if (cur.count) p.batches.push_back(cur);
    const size_t local = p.lazy ? p.runs.size() : p.iov.size();
    cur = TcpBatch{static_cast<uint32_t>(local), 0, 0, static_cast<uint32_t>(ndescs()), 0, 0};
  };
  auto full = [&] {
    return cur.count > 0 && (batch_full(p, cur) || cur.pieces >= kMaxStridedPieces ||
                             cur.desc_count >= kMaxExtentsPerFrame);
  };
  // Repetitions [rep, rep + k2) of pieces [first, first + k) of `e` (each piece from
  // byte `off`, `len` bytes) as one descriptor of the current batch.
  auto add = [&](const ResolvedExtent& e, uint64_t first, uint64_t k, uint64_t off, uint64_t len, uint64_t rep,
                 uint64_t k2) {
    const uint64_t rstride = k > 1 ? e.remote_stride : 0;
    const uint64_t rstride2 = k2 > 1 ? e.remote_stride2 : 0;
    const uint64_t roff = e.remote_offset + rep * e.remote_stride2 + first * e.remote_stride + off;
    if (p.two_level) {
      p.sdescs2.push_back(WireStrided2Extent{e.remote_region, roff, len, k, rstride, k2, rstride2});
    } else {
      p.sdescs.push_back(WireStridedExtent{e.remote_region, roff, len, k, rstride});
    }
    const uint64_t local = e.local_addr + rep * e.local_stride2 + first * e.local_stride + off;
    const PieceRun run = make_run(reinterpret_cast<char*>(local), len, k, e.local_stride, k2, e.local_stride2);
    if (p.lazy) {
      p.runs.push_back(run);
      ++cur.count;
      cur.extents += run.extents();
    } else {
      const size_t before = p.iov.size();
      append_iovecs(&run, 1, p.iov);
      cur.count += static_cast<uint32_t>(p.iov.size() - before);
    }
    ++cur.desc_count;
    cur.pieces += k * k2;
    cur.bytes += k * k2 * len;
    p.total += k * k2 * len;
  };
  // Repetition `rep` of `e` as one-level descriptors.
  auto add_level = [&](const ResolvedExtent& e, uint64_t rep) {
    if (e.len > batch_bytes || e.count == 1) {  // piece by piece, each cut by bytes like a plain extent
      for (uint64_t i = 0; i < e.count; ++i)
        for (uint64_t off = 0; off < e.len;) {
          if (cur.bytes == batch_bytes || full()) close_batch();
          const uint64_t len = std::min(e.len - off, batch_bytes - cur.bytes);
          add(e, i, 1, off, len, rep, 1);
          off += len;
        }
      return;
    }
    for (uint64_t done = 0; done < e.count;) {
      if (batch_bytes - cur.bytes < e.len || full()) close_batch();
      const uint64_t k = std::min({e.count - done, (batch_bytes - cur.bytes) / e.len, kMaxStridedPieces - cur.pieces});
      add(e, done, k, 0, e.len, rep, 1);
      done += k;
    }
  };
  for (const auto& e : extents) {
    const uint64_t rep_bytes = e.count * e.len;  // no overflow: the agent checked the run's span
    if (e.count2 == 1 || rep_bytes > batch_bytes || e.count > kMaxStridedPieces) {
      for (uint64_t j = 0; j < e.count2; ++j) add_level(e, j);
      continue;
    }
    // Whole repetitions at a time: as many as the batch has room for.
    for (uint64_t j = 0; j < e.count2;) {
      if (batch_bytes - cur.bytes < rep_bytes || kMaxStridedPieces - cur.pieces < e.count || full()) close_batch();
      const uint64_t k2 = std::min({e.count2 - j, (batch_bytes - cur.bytes) / rep_bytes,
                                    (kMaxStridedPieces - cur.pieces) / e.count});
      add(e, 0, e.count, 0, e.len, j, k2);
      j += k2;
    }
  }
  close_batch();
}

Result<std::shared_ptr<const PreparedOps>> TcpTransport::prepare_checked(std::shared_ptr<const Peer> peer, OpKind op,
                                                                         std::vector<ResolvedExtent> extents,
                                                                         std::shared_ptr<const GenClaim> claim) {
  return prepare_with(std::move(peer), op, std::move(extents), std::move(claim), TransferHints{});
}

}  // namespace pdkv::tcp
