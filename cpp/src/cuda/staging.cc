#include "cuda/staging.h"

#include <algorithm>
#include <utility>

namespace pdkv::cuda {

PinnedBuffer::~PinnedBuffer() {
  if (pooled_) {
    owner_->give_back(data_);
  } else if (owner_->bind(device_).ok()) {
    owner_->drv_->cuMemFreeHost(data_);
  }
}

Result<std::shared_ptr<Stager>> Stager::create(uint64_t chunk_bytes, uint32_t count) {
  if (chunk_bytes < 4096 || count < 2)
    return InvalidArgument("staging needs chunks of at least 4096 bytes and at least 2 of them (got " +
                           std::to_string(chunk_bytes) + " x " + std::to_string(count) + ")");
  PDKV_ASSIGN_OR_RETURN(const CudaDriver* drv, CudaDriver::get());
  return std::shared_ptr<Stager>(new Stager(drv, chunk_bytes, count));
}

Stager::~Stager() {
  // Every PinnedBuffer holds a reference to its Stager, so all pooled buffers are back.
  if (!free_.empty() && bind(pool_device_).ok())
    for (char* p : free_) drv_->cuMemFreeHost(p);
  for (auto& [dev, se] : copy_) {
    if (bind(dev).ok()) {
      drv_->cuEventDestroy(se.second);
      drv_->cuStreamDestroy(se.first);
    }
  }
}

Status Stager::bind(int device) const { return drv_->use_device(device); }

Result<std::shared_ptr<PinnedBuffer>> Stager::acquire(int device, Clock::time_point deadline,
                                                      const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      return std::shared_ptr<PinnedBuffer>(new PinnedBuffer(shared_from_this(), p, chunk_, true, pool_device_));
    }
    if (allocated_ < count_) {
      ++allocated_;
      lk.unlock();
      void* p = nullptr;
      Status st = bind(device);
      if (st.ok()) st = drv_->check(drv_->cuMemHostAlloc(&p, chunk_, kMemHostAllocPortable), "cuMemHostAlloc");
      lk.lock();
      if (!st.ok()) {
        --allocated_;
        return st.with_context("allocating a " + std::to_string(chunk_) + "-byte pinned staging buffer");
      }
      if (pool_device_ < 0) pool_device_ = device;  // portable memory: any context frees it
      return std::shared_ptr<PinnedBuffer>(
          new PinnedBuffer(shared_from_this(), static_cast<char*>(p), chunk_, true, pool_device_));
    }
    if (cancelled && cancelled()) return Cancelled("cancelled while waiting for a staging buffer");
    const auto now = Clock::now();
    if (now >= deadline) return TimeoutError("timed out waiting for a pinned staging buffer (all in use)");
    // Wake up now and then to notice cancellation.
    cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(20)));
  }
}

Result<std::shared_ptr<PinnedBuffer>> Stager::allocate(int device, uint64_t n) {
  void* p = nullptr;
  PDKV_RETURN_IF_ERROR(bind(device));
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemHostAlloc(&p, std::max<uint64_t>(n, 1), kMemHostAllocPortable),
                                   "cuMemHostAlloc")
                           .with_context("allocating a " + std::to_string(n) + "-byte pinned staging buffer"));
  return std::shared_ptr<PinnedBuffer>(new PinnedBuffer(shared_from_this(), static_cast<char*>(p), n, false, device));
}

void Stager::give_back(char* data) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(data);
  }
  cv_.notify_one();
}

Status Stager::gather(int device, const iovec* src, size_t n, char* dst, bool dst_pinned) {
  return copy_extents(device, dst, dst_pinned, src, n, nullptr, 0, false);
}

Status Stager::gather_runs(int device, const DeviceRun* runs, size_t n, char* dst) {
  return copy_extents(device, dst, true, nullptr, 0, runs, n, false);
}

Status Stager::scatter(int device, const char* src, const iovec* dst, size_t n, bool src_pinned) {
  return copy_extents(device, const_cast<char*>(src), src_pinned, dst, n, nullptr, 0, true);
}

namespace {
constexpr uint64_t kDmaPieceBytes = 1 << 20;
}  // namespace

Status enqueue_pieces(const CudaDriver& d, int device, CUstream stream, PinnedRuns* table, char* host,
                      bool host_pinned, const iovec* ext, const DeviceRun* runs, size_t n, bool to_device) {
  const char* what = to_device ? "cuMemcpyAsync (staging buffer to device)" : "cuMemcpyAsync (device to staging buffer)";
  CUfunction fn = nullptr;
  if (table && host_pinned) {
    auto f = StridedKernel::get().function(d, device);
    if (f.ok()) fn = *f;
  }
  thread_local std::vector<StridedRun> work;
  work.clear();
  DeviceRanges ranges(d);
  uint64_t off = 0;
  Status st;
  // count pieces of len bytes at a + i * stride, against host + off onwards.
  auto add = [&](uint64_t a, uint64_t len, uint64_t count, uint64_t stride) {
    const uint64_t h = reinterpret_cast<uint64_t>(host + off);
    if (count > 1 && stride == len) {  // touching pieces: one
      len *= count;
      count = 1;
      stride = 0;
    }
    // Pieces of a MiB or more go to the copy engines (few calls, DMA bandwidth to
    // and from pinned memory); smaller ones to the kernel.
    if (fn && len > 0 && len < kDmaPieceBytes && ranges.contains(a, (count - 1) * stride + len)) {
      if (to_device)
        append_run(work, h, a, len, count, len, stride);
      else
        append_run(work, a, h, len, count, stride, len);
    } else {
      for (uint64_t j = 0; j < count && st.ok(); ++j) {
        const CUdeviceptr hp = h + j * len, e = a + j * stride;
        st = d.check(d.cuMemcpyAsync(to_device ? e : hp, to_device ? hp : e, len, stream), what);
      }
    }
    off += count * len;
  };
  if (ext) {
    if (fn) {
      for_each_progression(ext, n, [&](size_t first, size_t k, uint64_t stride) {
        if (st.ok()) add(reinterpret_cast<uint64_t>(ext[first].iov_base), ext[first].iov_len, k, stride);
      });
    } else {
      for (size_t i = 0; i < n && st.ok(); ++i) add(reinterpret_cast<uint64_t>(ext[i].iov_base), ext[i].iov_len, 1, 0);
    }
  } else {
    for (size_t i = 0; i < n && st.ok(); ++i) add(runs[i].addr, runs[i].len, runs[i].count, runs[i].stride);
  }
  if (st.ok() && !work.empty()) {
    st = table->assign(d, device, work);
    if (st.ok()) st = StridedKernel::launch(d, fn, stream, table->device_address(), work.size());
  }
  if (work.capacity() > (1u << 16)) std::vector<StridedRun>().swap(work);
  return st;
}

Status Stager::copy_extents(int device, char* host, bool host_pinned, const iovec* ext, size_t n,
                            const DeviceRun* runs, size_t nruns, bool to_device) {
  std::lock_guard<std::mutex> lk(gather_mu_);
  PDKV_RETURN_IF_ERROR(bind(device));
  auto it = copy_.find(device);
  if (it == copy_.end()) {
    CUstream s = nullptr;
    CUevent e = nullptr;
    PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuStreamCreate(&s, kStreamNonBlocking), "cuStreamCreate"));
    Status st = drv_->check(drv_->cuEventCreate(&e, kEventBlockingSync | kEventDisableTiming), "cuEventCreate");
    if (!st.ok()) {
      drv_->cuStreamDestroy(s);
      return st;
    }
    it = copy_.emplace(device, std::make_pair(s, e)).first;
  }
  const auto [stream, event] = it->second;
  Status st = enqueue_pieces(*drv_, device, stream, &tables_[device], host, host_pinned, ext, runs,
                             ext ? n : nruns, to_device);
  // Wait even after a failed enqueue: copies already queued must not outlive `host`.
  Status rec = drv_->check(drv_->cuEventRecord(event, stream), "cuEventRecord");
  Status sync = rec.ok() ? drv_->check(drv_->cuEventSynchronize(event), to_device
                                           ? "cuEventSynchronize (staging buffer to device)"
                                           : "cuEventSynchronize (device to staging buffer)")
                         : rec;
  return st.ok() ? sync : st;
}

// ---------------------------------------------------------------- ScatterPipe

ScatterPipe::~ScatterPipe() {
  abandon();
  if (device_ < 0) return;
  const CudaDriver& d = st_->driver();
  if (!st_->bind(device_).ok()) return;
  for (CUevent e : ev_)
    if (e) d.cuEventDestroy(e);
  if (stream_) d.cuStreamDestroy(stream_);
}

Status ScatterPipe::begin(int device, const iovec* dst, size_t n, uint64_t total) {
  PDKV_RETURN_IF_ERROR(start(device, total));
  dst_ = dst;
  ndst_ = n;
  by_runs_ = false;
  return Status::Ok();
}

Status ScatterPipe::begin_runs(int device, std::vector<DeviceRun> dst, uint64_t total) {
  PDKV_RETURN_IF_ERROR(start(device, total));
  runs_ = std::move(dst);
  by_runs_ = true;
  ri_ = 0;
  piece_ = poff_ = 0;
  return Status::Ok();
}

Status ScatterPipe::start(int device, uint64_t total) {
  const CudaDriver& d = st_->driver();
  abandon();
  PDKV_RETURN_IF_ERROR(st_->bind(device));
  if (device != device_) {
    if (device_ >= 0) {
      // Streams and events belong to a device's context: start over on the new one.
      PDKV_RETURN_IF_ERROR(st_->bind(device_));
      for (CUevent& e : ev_)
        if (e) d.cuEventDestroy(std::exchange(e, nullptr));
      if (stream_) d.cuStreamDestroy(std::exchange(stream_, nullptr));
      device_ = -1;
      PDKV_RETURN_IF_ERROR(st_->bind(device));
    }
    PDKV_RETURN_IF_ERROR(d.check(d.cuStreamCreate(&stream_, kStreamNonBlocking), "cuStreamCreate"));
    device_ = device;
    for (CUevent& e : ev_)
      PDKV_RETURN_IF_ERROR(d.check(d.cuEventCreate(&e, kEventBlockingSync | kEventDisableTiming), "cuEventCreate"));
  }
  for (auto& b : buf_) {
    if (!b) {
      PDKV_ASSIGN_OR_RETURN(b, st_->allocate(device, st_->chunk()));
    }
  }
  dst_ = nullptr;
  ndst_ = 0;
  runs_.clear();
  di_ = 0;
  doff_ = 0;
  left_ = total;
  fill_ = 0;
  cur_ = 0;
  active_ = true;
  return Status::Ok();
}

iovec ScatterPipe::space() const {
  const uint64_t room = std::min<uint64_t>(buf_[cur_]->size() - fill_, left_);
  return iovec{buf_[cur_]->data() + fill_, static_cast<size_t>(room)};
}

Status ScatterPipe::wait_slot(int i) {
  if (!busy_[i]) return Status::Ok();
  busy_[i] = false;
  const CudaDriver& d = st_->driver();
  return d.check(d.cuEventSynchronize(ev_[i]), "cuEventSynchronize (staging buffer to device)");
}

Status ScatterPipe::received(uint64_t n) {
  fill_ += n;
  left_ -= n;
  if (fill_ == buf_[cur_]->size() || left_ == 0) return flush();
  return Status::Ok();
}

// This buffer's share of the iovec destinations (the first and last may be partial).
Status ScatterPipe::flush_iovecs(char* src) {
  segs_.clear();
  uint64_t done = 0;
  while (done < fill_) {
    const uint64_t take = std::min(dst_[di_].iov_len - doff_, fill_ - done);
    segs_.push_back(iovec{static_cast<char*>(dst_[di_].iov_base) + doff_, static_cast<size_t>(take)});
    done += take;
    doff_ += take;
    if (doff_ == dst_[di_].iov_len) {
      ++di_;
      doff_ = 0;
    }
  }
  Status st = enqueue_pieces(st_->driver(), device_, stream_, &tables_[cur_], src, true, segs_.data(), nullptr,
                             segs_.size(), true);
  if (segs_.capacity() > (1u << 16)) std::vector<iovec>().swap(segs_);
  return st;
}

// This buffer's share of the run destinations: a partial piece where the buffer starts
// or ends inside one, whole pieces as one run between.
Status ScatterPipe::flush_runs(char* src) {
  rsegs_.clear();
  uint64_t done = 0;
  while (done < fill_ && ri_ < runs_.size()) {
    const DeviceRun& r = runs_[ri_];
    const uint64_t left = fill_ - done;
    if (poff_ > 0 || left < r.len) {
      const uint64_t take = std::min(r.len - poff_, left);
      rsegs_.push_back(DeviceRun{r.addr + piece_ * r.stride + poff_, take, 1, 0});
      done += take;
      poff_ += take;
      if (poff_ == r.len) {
        poff_ = 0;
        ++piece_;
      }
    } else {
      const uint64_t k = std::min(r.count - piece_, left / r.len);
      rsegs_.push_back(DeviceRun{r.addr + piece_ * r.stride, r.len, k, r.stride});
      done += k * r.len;
      piece_ += k;
    }
    if (piece_ == r.count) {
      ++ri_;
      piece_ = 0;
    }
  }
  if (done != fill_) return Internal("staged payload is longer than its destination runs");
  return enqueue_pieces(st_->driver(), device_, stream_, &tables_[cur_], src, true, nullptr, rsegs_.data(),
                        rsegs_.size(), true);
}

Status ScatterPipe::flush() {
  const CudaDriver& d = st_->driver();
  PDKV_RETURN_IF_ERROR(st_->bind(device_));
  char* src = buf_[cur_]->data();
  Status st = by_runs_ ? flush_runs(src) : flush_iovecs(src);
  // Record even after a failed enqueue so abandon() can wait for what was queued.
  Status rec = d.check(d.cuEventRecord(ev_[cur_], stream_), "cuEventRecord");
  if (rec.ok()) busy_[cur_] = true;
  if (!st.ok()) return st;
  PDKV_RETURN_IF_ERROR(rec);
  fill_ = 0;
  cur_ ^= 1;
  return wait_slot(cur_);  // the other buffer is refilled next: its copy-out must be done
}

Status ScatterPipe::finish() {
  Status a = wait_slot(0);
  Status b = wait_slot(1);
  active_ = false;
  dst_ = nullptr;
  return a.ok() ? b : a;
}

void ScatterPipe::abandon() {
  if (device_ >= 0 && (busy_[0] || busy_[1]) && st_->bind(device_).ok()) {
    (void)wait_slot(0);
    (void)wait_slot(1);
  }
  active_ = false;
  dst_ = nullptr;
}

}  // namespace pdkv::cuda
