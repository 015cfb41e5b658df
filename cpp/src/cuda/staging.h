// Device memory through pinned host buffers, for transports that can only touch host
// memory (tcp): GPU pools then work across hosts without RDMA.
//
// Sending side: Stager::gather() copies a batch's scattered device extents into one
// pinned buffer (one launch of the strided-copy kernel over the batch's runs,
// strided_copy.h, on pdkv's own stream, one event wait; pieces outside device memory,
// or every piece where the kernel does not load, by cuMemcpyAsync each); the
// transport sends that buffer while the next batch is being gathered, so the copy and
// the network overlap. Buffers come from a bounded pool (chunk x count pinned bytes,
// allocated on first use), which also bounds how far staging runs ahead of the socket.
//
// Receiving side: ScatterPipe receives a payload into two pinned buffers in turn;
// each full buffer is copied out to its device destinations asynchronously (one
// kernel launch per buffer) while the next one fills (double buffering). finish() waits for every copy before the
// transport acknowledges the batch, so an ack still means "the bytes landed".
//
// Thread safety: Stager is thread-safe. A ScatterPipe belongs to one connection and
// is used under that connection's receive lock.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/driver.h"
#include "cuda/strided_copy.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"

namespace pdkv::cuda {

class Stager;

// `count` pieces of `len` bytes at addr + i * stride (device or host pointers).
struct DeviceRun {
  uint64_t addr;
  uint64_t len;
  uint64_t count;
  uint64_t stride;
};

// Pinned host memory (cuMemHostAlloc). Returned to its pool, or freed, when the last
// reference goes away.
class PinnedBuffer {
 public:
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();
  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend class Stager;

// `count` pieces of `len` bytes at addr + i * stride (device or host pointers).
struct DeviceRun {
  uint64_t addr;
  uint64_t len;
  uint64_t count;
  uint64_t stride;
};
  PinnedBuffer(std::shared_ptr<Stager> owner, char* data, uint64_t size, bool pooled, int device)
      : owner_(std::move(owner)), data_(data), size_(size), pooled_(pooled), device_(device) {}
  std::shared_ptr<Stager> owner_;
  char* data_;
  uint64_t size_;
  bool pooled_;
  int device_;  // context it was allocated in (freeing needs a current context)
};

class Stager : public std::enable_shared_from_this<Stager> {
 public:
  // NotSupported (with the reason) when no CUDA driver/device is usable.
  static Result<std::shared_ptr<Stager>> create(uint64_t chunk_bytes, uint32_t count);
  ~Stager();

  const CudaDriver& driver() const { return *drv_; }
  uint64_t chunk() const { return chunk_; }

  // A pooled chunk-sized buffer. Waits for one to come back until `deadline`
  // (TimeoutError) or until `cancelled()` returns true (Cancelled). Buffers are
  // portable (usable with every device); `device` is the context to allocate in.
  Result<std::shared_ptr<PinnedBuffer>> acquire(int device, Clock::time_point deadline,
                                                const std::function<bool()>& cancelled);
  // A dedicated buffer of `n` bytes (for payloads larger than a chunk), freed on release.
  Result<std::shared_ptr<PinnedBuffer>> allocate(int device, uint64_t n);

  // Copies src[0..n) (device or host pointers of `device`'s address space) back to
  // back into `dst` and waits until the bytes are there. `dst` is pinned memory (a
  // buffer of this stager) unless `dst_pinned` is false (then piece by piece).
  Status gather(int device, const iovec* src, size_t n, char* dst, bool dst_pinned = true);
  // Copies runs[0..n) (device pieces: count x len bytes at addr + i * stride) back to
  // back into the pinned buffer `dst` and waits: no iovec per piece.
  Status gather_runs(int device, const DeviceRun* runs, size_t n, char* dst);
  // The reverse of gather: copies `src` out to dst[0..n) in order and waits.
  Status scatter(int device, const char* src, const iovec* dst, size_t n, bool src_pinned = true);

  // Makes `device`'s primary context current on the calling thread.
  Status bind(int device) const;

 private:
  friend class PinnedBuffer;
  Stager(const CudaDriver* drv, uint64_t chunk, uint32_t count) : drv_(drv), chunk_(chunk), count_(count) {}
  void give_back(char* data);
  // gather (to_device false) or scatter: enqueue_pieces() on this stager's stream of
  // `device`, one wait.
  Status copy_extents(int device, char* host, bool host_pinned, const iovec* ext, size_t n, const DeviceRun* runs,
                      size_t nruns, bool to_device);

  const CudaDriver* drv_;
  const uint64_t chunk_;
  const uint32_t count_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;   // pooled buffers not in use
  uint32_t allocated_ = 0;    // pooled buffers allocated so far (<= count_)
  int pool_device_ = -1;      // context the pooled buffers were allocated in
  std::mutex gather_mu_;      // one gather at a time per stager (its stream and event)
  std::map<int, std::pair<CUstream, CUevent>> copy_;  // per device, guarded by gather_mu_
  std::map<int, PinnedRuns> tables_;                  // per device, guarded by gather_mu_
};

// Enqueues on `stream` the copies between the contiguous host buffer `host` and the
// pieces ext[0..n) (or, with ext null, runs[0..n)), in order: device pieces under a
// MiB with one strided-kernel launch reading its runs from `table` (which must not be
// in use by an earlier launch still running), anything else (pieces of a MiB or more:
// the copy engines; host pieces; everything when the kernel is unavailable or `host`
// is not pinned) by one cuMemcpyAsync per piece.
Status enqueue_pieces(const CudaDriver& d, int device, CUstream stream, PinnedRuns* table, char* host,
                      bool host_pinned, const iovec* ext, const DeviceRun* runs, size_t n, bool to_device);

// Receives one payload at a time into pinned buffers and copies it out to its
// (device) destinations, double buffered. See the file comment.
class ScatterPipe {
 public:
  explicit ScatterPipe(std::shared_ptr<Stager> stager) : st_(std::move(stager)) {}
  ~ScatterPipe();
  ScatterPipe(const ScatterPipe&) = delete;
  ScatterPipe& operator=(const ScatterPipe&) = delete;

  // Starts a payload of `total` bytes for dst[0..n) (kept alive by the caller until
  // finish() or abandon()).
  Status begin(int device, const iovec* dst, size_t n, uint64_t total);
  // The same for the runs `dst` (strided descriptors as they came): no iovec per piece.
  Status begin_runs(int device, std::vector<DeviceRun> dst, uint64_t total);
  // Where the next received bytes go (never more than the payload has left).
  iovec space() const;
  // `n` bytes were received into space(); full buffers are copied out asynchronously.
  Status received(uint64_t n);
  // The whole payload was received: waits until every byte reached its destination.
  Status finish();
  // Drops the payload (the connection died): waits for copies already queued, so
  // nothing writes into the destinations afterwards.
  void abandon();
  bool active() const { return active_; }

 private:
  Status start(int device, uint64_t total);
  Status flush();
  Status flush_iovecs(char* src);
  Status flush_runs(char* src);
  Status wait_slot(int i);

  std::shared_ptr<Stager> st_;
  std::shared_ptr<PinnedBuffer> buf_[2];
  CUevent ev_[2] = {nullptr, nullptr};
  PinnedRuns tables_[2];  // the kernel's run table of each buffer's copy-out
  std::vector<iovec> segs_;
  bool by_runs_ = false;          // begin_runs (else begin: dst_)
  std::vector<DeviceRun> runs_;   // begin_runs: the destinations, walked by (ri_, piece_, poff_)
  std::vector<DeviceRun> rsegs_;  // one buffer's share of them
  size_t ri_ = 0;
  uint64_t piece_ = 0, poff_ = 0;
  bool busy_[2] = {false, false};
  CUstream stream_ = nullptr;
  int device_ = -1;
  int cur_ = 0;
  uint64_t fill_ = 0;
  uint64_t left_ = 0;  // payload bytes not yet received
  const iovec* dst_ = nullptr;
  size_t ndst_ = 0;
  size_t di_ = 0;      // copy-out cursor
  uint64_t doff_ = 0;
  bool active_ = false;
};

}  // namespace pdkv::cuda
