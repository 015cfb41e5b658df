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

Status Stager::gather(int device, const iovec* src, size_t n, char* dst) {
  return copy_extents(device, dst, src, n, false);
}

Status Stager::scatter(int device, const char* src, const iovec* dst, size_t n) {
  return copy_extents(device, const_cast<char*>(src), dst, n, true);
}

Status Stager::copy_extents(int device, char* host, const iovec* ext, size_t n, bool to_device) {
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
  const char* what = to_device ? "cuMemcpyAsync (staging buffer to device)" : "cuMemcpyAsync (device to staging buffer)";
  uint64_t off = 0;
  Status st;
  for (size_t i = 0; i < n && st.ok(); ++i) {
    const CUdeviceptr h = reinterpret_cast<CUdeviceptr>(host + off), e = reinterpret_cast<CUdeviceptr>(ext[i].iov_base);
    st = drv_->check(drv_->cuMemcpyAsync(to_device ? e : h, to_device ? h : e, ext[i].iov_len, stream), what);
    off += ext[i].iov_len;
  }
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
  dst_ = dst;
  ndst_ = n;
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

Status ScatterPipe::flush() {
  const CudaDriver& d = st_->driver();
  PDKV_RETURN_IF_ERROR(st_->bind(device_));
  const char* src = buf_[cur_]->data();
  uint64_t done = 0;
  Status st;
  while (done < fill_ && st.ok()) {
    const uint64_t room = dst_[di_].iov_len - doff_;
    const uint64_t take = std::min(room, fill_ - done);
    st = d.check(d.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst_[di_].iov_base) + doff_,
                                 reinterpret_cast<CUdeviceptr>(src + done), take, stream_),
                 "cuMemcpyAsync (staging buffer to device)");
    done += take;
    doff_ += take;
    if (doff_ == dst_[di_].iov_len) {
      ++di_;
      doff_ = 0;
    }
  }
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
