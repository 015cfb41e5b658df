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

}  // namespace pdkv::tcp
