// Device memory takes strided runs: the strided-copy kernel (strided_copy.cu) and what
// its callers need around it.
//
// A KV transfer between different layouts (TP head splits, NHD<->HND, block sizes;
// docs/architecture.md) is a few strided runs of many small pieces: at llama-3-70b tp8
// a 4K-token TP split is 100k+ pieces of 256-512 bytes. One launch of the kernel
// copies them all, where one cuMemcpyAsync per piece would cost 100k driver calls.
//
//   append_run()      cuts a run into kernel work units (<= kStridedRunChunk bytes)
//   for_each_progression()  finds the runs in a list of pieces (equal lengths at a
//                     constant stride), for callers that still hold iovecs
//   StridedKernel     the kernel, loaded per device from the fatbin on first use
//   PinnedRuns        a growable run table in pinned host memory (the kernel reads it
//                     over the bus; no upload per launch)
//
// The kernel runs wherever the fatbin was built (nvcc at build time) and loads; where it
// does not, callers copy piece by piece with cuMemcpyAsync as before. The benchmark
// switch BenchSwitch::kDevicePieces=1 forces that old path (docs/benchmarks.md).
//
// Thread safety: StridedKernel is thread-safe; a PinnedRuns belongs to one caller.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "cuda/driver.h"
#include "cuda/strided_abi.h"
#include "pdkv/status.h"

namespace pdkv::cuda {

// Appends `count` pieces of `len` bytes (src + i * src_stride -> dst + i * dst_stride)
// to `out` as kernel work units of at most kStridedRunChunk bytes each: runs of small
// pieces are cut between pieces, a piece larger than that into pieces of its own.
// Pieces back to back on both sides become one piece first.
void append_run(std::vector<StridedRun>& out, uint64_t src, uint64_t dst, uint64_t len, uint64_t count,
                uint64_t src_stride, uint64_t dst_stride);

// Calls f(first, k, stride) for each maximal group of iovecs v[first .. first + k)
// of equal length whose bases advance by `stride` (k == 1: stride 0).
template <typename F>
void for_each_progression(const iovec* v, size_t n, F&& f) {
  size_t i = 0;
  while (i < n) {
    size_t k = 1;
    uint64_t stride = 0;
    if (i + 1 < n && v[i + 1].iov_len == v[i].iov_len) {
      const uint64_t a = reinterpret_cast<uint64_t>(v[i].iov_base), b = reinterpret_cast<uint64_t>(v[i + 1].iov_base);
      if (b > a && b - a >= v[i].iov_len) {
        stride = b - a;
        k = 2;
        while (i + k < n && v[i + k].iov_len == v[i].iov_len &&
               reinterpret_cast<uint64_t>(v[i + k].iov_base) == a + k * stride)
          ++k;
      }
    }
    f(i, k, stride);
    i += k;
  }
}

// Whether the strided kernel may be used at all (not forced off by the benchmark switch).
bool strided_kernel_enabled();

class StridedKernel {
 public:
  // The process's kernel (loaded per device on first use).
  static StridedKernel& get();
  // The kernel on `device`, whose context must be current. NotSupported when pdkv was
  // built without nvcc, the module does not load there (logged once) or the benchmark
  // switch turned it off: the caller copies piece by piece.
  Result<CUfunction> function(const CudaDriver& drv, int device);
  // Launches the kernel over runs[0..n) (device-visible memory: device or pinned) on
  // `stream`, in launches of at most 2^31 runs.
  static Status launch(const CudaDriver& drv, CUfunction fn, CUstream stream, uint64_t runs, size_t n);

 private:
  std::mutex mu_;
  std::map<int, CUfunction> fn_;  // nullptr: failed to load there
};

// A run table in pinned host memory, grown on demand. Free with release() while a
// context is current (or let the destructor bind `device`).
class PinnedRuns {
 public:
  PinnedRuns() = default;
  ~PinnedRuns();
  PinnedRuns(const PinnedRuns&) = delete;
  PinnedRuns& operator=(const PinnedRuns&) = delete;
  // Room for n runs (contents not kept). The calling thread has `device` current.
  Status reserve(const CudaDriver& drv, int device, size_t n);
  // Copies `runs` into the table (reserving room first).
  Status assign(const CudaDriver& drv, int device, const std::vector<StridedRun>& runs);
  StridedRun* data() const { return p_; }
  uint64_t device_address() const { return reinterpret_cast<uint64_t>(p_); }

 private:
  const CudaDriver* drv_ = nullptr;
  int device_ = -1;
  StridedRun* p_ = nullptr;
  size_t cap_ = 0;
};

// The device range [base, base + size) holding `ptr`, cached for the next lookups: the
// kernel may only touch device memory (pinned host memory it reaches too, but pageable
// memory is an illegal address), so callers check every run against it.
class DeviceRanges {
 public:
  explicit DeviceRanges(const CudaDriver& drv) : drv_(drv) {}
  // True when [ptr, ptr + span) lies inside one device allocation.
  bool contains(uint64_t ptr, uint64_t span);

 private:
  const CudaDriver& drv_;
  uint64_t base_ = 0, size_ = 0;
};

}  // namespace pdkv::cuda
