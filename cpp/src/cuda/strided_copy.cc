#include "cuda/strided_copy.h"

#include <algorithm>
#include <cstring>

#include "util/bench_switches.h"
#include "util/log.h"

extern const unsigned char kPdkvStridedCopyFatbin[];
extern const unsigned long kPdkvStridedCopyFatbinSize;

namespace pdkv::cuda {

void append_run(std::vector<StridedRun>& out, uint64_t src, uint64_t dst, uint64_t len, uint64_t count,
                uint64_t src_stride, uint64_t dst_stride) {
  if (len == 0 || count == 0) return;
  if (count == 1 || (src_stride == len && dst_stride == len)) {  // one piece: cut by bytes
    const uint64_t total = len * count;
    for (uint64_t off = 0; off < total; off += kStridedRunChunk)
      out.push_back(StridedRun{src + off, dst + off, std::min(kStridedRunChunk, total - off), 1, 0, 0});
    return;
  }
  if (len >= kStridedRunChunk) {  // big pieces: each on its own, cut by bytes
    for (uint64_t i = 0; i < count; ++i) append_run(out, src + i * src_stride, dst + i * dst_stride, len, 1, 0, 0);
    return;
  }
  const uint64_t per = kStridedRunChunk / len;  // >= 1 pieces per work unit
  for (uint64_t i = 0; i < count; i += per) {
    const uint64_t k = std::min(per, count - i);
    out.push_back(StridedRun{src + i * src_stride, dst + i * dst_stride, len, k, k > 1 ? src_stride : 0,
                             k > 1 ? dst_stride : 0});
  }
}

bool strided_kernel_enabled() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kDevicePieces, "1");
  return on;
}

StridedKernel& StridedKernel::get() {
  static StridedKernel* k = new StridedKernel();  // never destroyed: modules live as long as the process
  return *k;
}

Result<CUfunction> StridedKernel::function(const CudaDriver& drv, int device) {
  if (!strided_kernel_enabled()) return NotSupported("the strided-copy kernel is off (benchmark switch kDevicePieces is set, util/bench_switches.h)");
  if (kPdkvStridedCopyFatbinSize == 0) return NotSupported("pdkv was built without nvcc: no strided-copy kernel");
  std::lock_guard<std::mutex> lk(mu_);
  auto it = fn_.find(device);
  if (it == fn_.end()) {
    CUmodule mod = nullptr;
    CUfunction fn = nullptr;
    CUresult r = drv.cuModuleLoadData(&mod, kPdkvStridedCopyFatbin);
    if (r == kSuccess) r = drv.cuModuleGetFunction(&fn, mod, kStridedCopyKernel);
    if (r != kSuccess) {
      PDKV_LOG_WARN("strided-copy kernel unavailable on device %d (%s); device memory is copied piece by piece",
                    device, drv.check(r, "cuModuleLoadData").message().c_str());
      fn = nullptr;
    }
    it = fn_.emplace(device, fn).first;
  }
  if (!it->second) return NotSupported("the strided-copy kernel does not load on device " + std::to_string(device));
  return it->second;
}

Status StridedKernel::launch(const CudaDriver& drv, CUfunction fn, CUstream stream, uint64_t runs, size_t n) {
  constexpr size_t kMaxPerLaunch = size_t(1) << 31;
  for (size_t done = 0; done < n;) {
    unsigned k = static_cast<unsigned>(std::min(n - done, kMaxPerLaunch));
    uint64_t table = runs + done * sizeof(StridedRun);
    void* params[] = {&table, &k};
    const unsigned grid = std::min<unsigned>(k, kStridedCopyMaxGrid);
    PDKV_RETURN_IF_ERROR(drv.check(
        drv.cuLaunchKernel(fn, grid, 1, 1, kStridedCopyThreads, 1, 1, 0, stream, params, nullptr),
        "cuLaunchKernel(pdkv_strided_copy)"));
    done += k;
  }
  return Status::Ok();
}

PinnedRuns::~PinnedRuns() {
  if (p_ && drv_->use_device(device_).ok()) drv_->cuMemFreeHost(p_);
}

Status PinnedRuns::reserve(const CudaDriver& drv, int device, size_t n) {
  if (n <= cap_ && device == device_) return Status::Ok();
  if (p_) {
    drv.cuMemFreeHost(p_);
    p_ = nullptr;
    cap_ = 0;
  }
  const size_t want = std::max<size_t>(n + n / 2, 256);
  void* p = nullptr;
  PDKV_RETURN_IF_ERROR(drv.check(drv.cuMemHostAlloc(&p, want * sizeof(StridedRun), kMemHostAllocPortable),
                                 "cuMemHostAlloc (strided-copy run table)"));
  drv_ = &drv;
  device_ = device;
  p_ = static_cast<StridedRun*>(p);
  cap_ = want;
  return Status::Ok();
}

Status PinnedRuns::assign(const CudaDriver& drv, int device, const std::vector<StridedRun>& runs) {
  PDKV_RETURN_IF_ERROR(reserve(drv, device, runs.size()));
  if (!runs.empty()) std::memcpy(p_, runs.data(), runs.size() * sizeof(StridedRun));
  return Status::Ok();
}

bool DeviceRanges::contains(uint64_t ptr, uint64_t span) {
  if (!(ptr >= base_ && ptr - base_ < size_)) {
    CUdeviceptr b = 0;
    size_t s = 0;
    if (drv_.cuMemGetAddressRange(&b, &s, ptr) != kSuccess) return false;
    base_ = b;
    size_ = s;
  }
  return span <= size_ - (ptr - base_);
}

}  // namespace pdkv::cuda
