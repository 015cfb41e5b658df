#include "transport/tcp/scatter.h"

#include <algorithm>
#include <cstring>

#include "util/piece_copy.h"

namespace pdkv::tcp {

void scatter_to_iov(const iovec* dst, size_t ndst, IovCursor& cur, const char* from, uint64_t n) {
  while (n > 0 && cur.idx < ndst) {
    const iovec& d = dst[cur.idx];
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, d.iov_len - cur.off));
    util::stream_piece(static_cast<char*>(d.iov_base) + cur.off, from, step);
    from += step;
    n -= step;
    cur.off += step;
    if (cur.off == d.iov_len) {
      ++cur.idx;
      cur.off = 0;
    }
  }
  util::stream_fence();
}

size_t gather_from_iov(const iovec* src, size_t nsrc, IovCursor& cur, char* to, size_t cap) {
  size_t done = 0;
  while (done < cap && cur.idx < nsrc) {
    if (cur.off == 0 && cur.idx + util::kPiecePrefetchAhead < nsrc)
      __builtin_prefetch(src[cur.idx + util::kPiecePrefetchAhead].iov_base);
    const iovec& s = src[cur.idx];
    const size_t step = std::min(cap - done, s.iov_len - cur.off);
    std::memcpy(to + done, static_cast<const char*>(s.iov_base) + cur.off, step);
    done += step;
    cur.off += step;
    if (cur.off == s.iov_len) {
      ++cur.idx;
      cur.off = 0;
    }
  }
  return done;
}

PieceRun make_run(char* base, uint64_t len, uint64_t count, uint64_t stride, uint64_t count2, uint64_t stride2) {
  if (count > 1 && stride == len) {  // the inner pieces touch: one piece per repetition
    len *= count;
    count = 1;
  }
  if (count == 1 && count2 > 1) {  // one piece per repetition: the repetitions are the pieces
    count = count2;
    stride = stride2;
    count2 = 1;
  }
  if (count > 1 && count2 == 1 && stride == len) {
    len *= count;
    count = 1;
  }
  if (count == 1) stride = 0;
  if (count2 == 1) stride2 = 0;
  return PieceRun{base, len, count, stride, count2, stride2};
}

namespace {

// Moves `cur` `n` bytes on within the current repetition of run `r` (n never passes
// its end).
void step_run(const PieceRun& r, RunCursor& cur, uint64_t n) {
  const uint64_t at = cur.off + n;
  cur.piece += at / r.len;
  cur.off = at % r.len;
  if (cur.piece == r.count) {
    cur.piece = 0;
    cur.off = 0;
    if (++cur.rep == r.count2) {
      ++cur.idx;
      cur.rep = 0;
    }
  }
}

}  // namespace

void scatter_to_runs(const PieceRun* dst, size_t ndst, RunCursor& cur, const char* from, uint64_t n) {
  while (n > 0 && cur.idx < ndst) {
    const PieceRun& r = dst[cur.idx];
    char* to = r.base + cur.rep * r.stride2 + cur.piece * r.stride + cur.off;
    if (cur.off == 0 && n >= r.len) {  // whole pieces of this repetition: the tight loop
      const uint64_t k = std::min(n / r.len, r.count - cur.piece);
      const size_t len = static_cast<size_t>(r.len);
      for (uint64_t j = 0; j < k; ++j) util::stream_piece(to + j * r.stride, from + j * r.len, len);
      from += k * r.len;
      n -= k * r.len;
      step_run(r, cur, k * r.len);
      continue;
    }
    const uint64_t step = std::min(n, r.len - cur.off);  // a piece cut by the chunk's edge
    util::stream_piece(to, from, static_cast<size_t>(step));
    from += step;
    n -= step;
    step_run(r, cur, step);
  }
  util::stream_fence();
}

size_t gather_from_runs(const PieceRun* src, size_t nsrc, RunCursor& cur, char* to, size_t cap) {
  size_t done = 0;
  while (done < cap && cur.idx < nsrc) {
    const PieceRun& r = src[cur.idx];
    const char* from = r.base + cur.rep * r.stride2 + cur.piece * r.stride + cur.off;
    if (cur.off == 0 && cap - done >= r.len) {  // whole pieces, prefetching the scattered sources ahead
      const uint64_t k = std::min<uint64_t>((cap - done) / r.len, r.count - cur.piece);
      const size_t len = static_cast<size_t>(r.len);
      for (uint64_t j = 0; j < k; ++j) {
        if (j + util::kPiecePrefetchAhead < k) __builtin_prefetch(from + (j + util::kPiecePrefetchAhead) * r.stride, 0);
        std::memcpy(to + done + j * len, from + j * r.stride, len);
      }
      done += static_cast<size_t>(k * r.len);
      step_run(r, cur, k * r.len);
      continue;
    }
    const size_t step = static_cast<size_t>(std::min<uint64_t>(cap - done, r.len - cur.off));
    std::memcpy(to + done, from, step);
    done += step;
    step_run(r, cur, step);
  }
  return done;
}

void append_iovecs(const PieceRun* runs, size_t n, std::vector<iovec>& out) {
  for (size_t i = 0; i < n; ++i) {
    const PieceRun& r = runs[i];
    for (uint64_t j = 0; j < r.count2; ++j) {
      char* const rep = r.base + j * r.stride2;
      if (r.count == 1 || r.stride == r.len) {
        out.push_back({rep, static_cast<size_t>(r.len * r.count)});
        continue;
      }
      for (uint64_t k = 0; k < r.count; ++k) out.push_back({rep + k * r.stride, static_cast<size_t>(r.len)});
    }
  }
}

}  // namespace pdkv::tcp
