#include "transport/shm/copy_ops.h"

#include <algorithm>
#include <optional>

namespace pdkv::shm {

namespace {

// Appends one CopyOp, merged into the previous one when both sides continue it.
void push_op(Binding& b, const CopyOp& op) {
  b.total += op.count2 * op.count * op.len;
  b.cma |= !op.mapped;
  if (!b.ops.empty()) {
    CopyOp& o = b.ops.back();
    if (o.count == 1 && op.count == 1 && o.count2 == 1 && op.count2 == 1 && o.region == op.region &&
        o.mapped == op.mapped && o.local + o.len == op.local && o.remote + o.len == op.remote) {
      o.len += op.len;
      return;
    }
  }
  b.ops.push_back(op);
}

// Bytes from a run's first byte to the end of its last piece on the peer's side, or
// nullopt past 2^64.
std::optional<uint64_t> remote_span(const ResolvedExtent& e) {
  uint64_t a = 0, b = 0, span = 0;
  if (__builtin_mul_overflow(e.count - 1, e.remote_stride, &a) ||
      __builtin_mul_overflow(e.count2 - 1, e.remote_stride2, &b) || __builtin_add_overflow(a, b, &span) ||
      __builtin_add_overflow(span, e.len, &span))
    return std::nullopt;
  return span;
}

// The copies of remote bytes [off, off + len) of r (checked inside it): memcpy where
// r's shared window is mapped, cross-memory attach before and after it.
Status add_span_ops(Binding& b, const RemoteRegion& r, uint32_t idx, char* local, uint64_t off, uint64_t len) {
  const uint64_t win_lo = r.base ? r.shared_offset : 0, win_hi = r.base ? r.shared_offset + r.shared_len : 0;
  const uint64_t end = off + len;
  while (off < end) {
    const bool in_window = off >= win_lo && off < win_hi;
    const uint64_t stop = in_window ? std::min(end, win_hi) : (off < win_lo ? std::min(end, win_lo) : end);
    const uint64_t n = stop - off;
    if (in_window) {
      push_op(b, CopyOp{local, reinterpret_cast<uint64_t>(r.base) + (off - r.shared_offset), n, idx, true});
    } else {
      if (!r.cma_denied.empty()) return NotSupported(r.cma_denied);
      push_op(b, CopyOp{local, r.remote_addr + off, n, idx, false});
    }
    local += n;
    off = stop;
  }
  return Status::Ok();
}

// Run `e` (remote bytes [e.remote_offset, + span), checked inside r) as one op when
// it lies wholly inside or wholly outside r's mapped window.
std::optional<CopyOp> whole_run_op(const RemoteRegion& r, uint32_t idx, const ResolvedExtent& e, uint64_t span) {
  const uint64_t lo = e.remote_offset, hi = e.remote_offset + span;  // hi <= r.len: no overflow
  const bool mapped = r.base && lo >= r.shared_offset && hi <= r.shared_offset + r.shared_len;
  const bool outside = !r.base || hi <= r.shared_offset || lo >= r.shared_offset + r.shared_len;
  if (!mapped && !(outside && r.cma_denied.empty())) return std::nullopt;
  const uint64_t remote = mapped ? reinterpret_cast<uint64_t>(r.base) + (lo - r.shared_offset) : r.remote_addr + lo;
  CopyOp op{reinterpret_cast<char*>(e.local_addr), remote, e.len, idx, mapped};
  op.count = e.count;
  op.local_stride = e.local_stride;
  op.remote_stride = e.remote_stride;
  op.count2 = e.count2;
  op.local_stride2 = e.local_stride2;
  op.remote_stride2 = e.remote_stride2;
  return op;
}

}  // namespace

Status add_run_ops(Binding& b, const RemoteRegion& r, uint32_t idx, const ResolvedExtent& e, const std::string& peer) {
  if (e.len == 0 || e.count == 0 || e.count2 == 0)
    return InvalidArgument("an empty run (" + std::to_string(e.count2) + " x " + std::to_string(e.count) + " x " +
                           std::to_string(e.len) + " bytes) for region " + std::to_string(r.id) + " of peer '" +
                           peer + "'");
  const auto span = remote_span(e);
  if (!span || e.remote_offset > r.len || *span > r.len - e.remote_offset)
    return OutOfRange("remote bytes [" + std::to_string(e.remote_offset) + ", +" +
                      (span ? std::to_string(*span) : std::string("more than 2^64")) + ") fall outside region " +
                      std::to_string(r.id) + " of peer '" + peer + "' (" + std::to_string(r.len) +
                      " bytes as the peer confirms it)");
  if (auto op = whole_run_op(r, idx, e, *span)) {
    push_op(b, *op);
    return Status::Ok();
  }
  // Straddles the window's edge: repetition by repetition (each one op where it lies
  // wholly on one side: a run repeated across a pool's layers crosses the edge in
  // few of them), the others piece by piece, each cut at the edge.
  for (uint64_t j = 0; j < e.count2; ++j) {
    const ResolvedExtent rep = e.repetition(j);
    if (e.count2 > 1) {
      const auto rep_span = remote_span(rep);  // inside the run's checked span
      if (auto op = whole_run_op(r, idx, rep, *rep_span)) {
        push_op(b, *op);
        continue;
      }
    }
    for (uint64_t i = 0; i < rep.count; ++i) {
      const ResolvedExtent p = rep.piece(i);
      PDKV_RETURN_IF_ERROR(add_span_ops(b, r, idx, reinterpret_cast<char*>(p.local_addr), p.remote_offset, p.len));
    }
  }
  return Status::Ok();
}

}  // namespace pdkv::shm
