#include "cuda/driver.h"

#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include "util/log.h"

namespace pdkv::cuda {
namespace {

struct Loaded {
  CudaDriver drv{};
  Status status;
};

template <typename F>
bool load(void* lib, const char* name, F* out) {
  void* p = ::dlsym(lib, name);
  *out = reinterpret_cast<F>(p);
  return p != nullptr;
}

std::atomic<bool> g_initialized{false};  // get() ran (the driver is loaded and cuInit was called)

std::string driver_path(bool* overridden) {
  const char* env = std::getenv("PDKV_CUDA_DRIVER");
  *overridden = env != nullptr && env[0] != '\0';
  return *overridden ? env : "libcuda.so.1";
}

// An NVIDIA device node or driver entry exists (containers expose /dev/nvidia*, WSL /dev/dxg).
bool nvidia_device_present() {
  if (::access("/dev/nvidiactl", F_OK) == 0 || ::access("/dev/nvidia0", F_OK) == 0 || ::access("/dev/dxg", F_OK) == 0)
    return true;
  DIR* d = ::opendir("/proc/driver/nvidia/gpus");
  if (!d) return false;
  bool any = false;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') any = true;
  ::closedir(d);
  return any;
}

Loaded load_driver() {
  Loaded l;
  g_initialized = true;
  bool overridden = false;
  const std::string path = driver_path(&overridden);
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = ::dlerror();
    l.status = NotSupported(overridden ? "cannot load the CUDA driver " + path + " (PDKV_CUDA_DRIVER): " + err
                                       : "the CUDA driver (libcuda.so.1) is not installed: " + std::string(err));
    return l;
  }
  if (overridden) PDKV_LOG_INFO("CUDA driver loaded from %s (PDKV_CUDA_DRIVER)", path.c_str());
  CudaDriver& d = l.drv;
  // The _v2 entry points are the 64-bit versions current drivers export.
  bool ok = load(lib, "cuInit", &d.cuInit) && load(lib, "cuDeviceGetCount", &d.cuDeviceGetCount) &&
            load(lib, "cuDeviceGet", &d.cuDeviceGet) &&
            load(lib, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain) &&
            load(lib, "cuCtxSetCurrent", &d.cuCtxSetCurrent) &&
            load(lib, "cuMemGetAddressRange_v2", &d.cuMemGetAddressRange) &&
            load(lib, "cuIpcGetMemHandle", &d.cuIpcGetMemHandle) &&
            load(lib, "cuIpcOpenMemHandle_v2", &d.cuIpcOpenMemHandle) &&
            load(lib, "cuIpcCloseMemHandle", &d.cuIpcCloseMemHandle) &&
            load(lib, "cuMemcpyAsync", &d.cuMemcpyAsync) && load(lib, "cuMemcpyHtoD_v2", &d.cuMemcpyHtoD) &&
            load(lib, "cuMemcpyDtoH_v2", &d.cuMemcpyDtoH) && load(lib, "cuStreamCreate", &d.cuStreamCreate) &&
            load(lib, "cuStreamDestroy_v2", &d.cuStreamDestroy) &&
            load(lib, "cuStreamSynchronize", &d.cuStreamSynchronize) && load(lib, "cuEventCreate", &d.cuEventCreate) &&
            load(lib, "cuEventRecord", &d.cuEventRecord) && load(lib, "cuEventSynchronize", &d.cuEventSynchronize) &&
            load(lib, "cuEventDestroy_v2", &d.cuEventDestroy) &&
            load(lib, "cuPointerGetAttribute", &d.cuPointerGetAttribute) &&
            load(lib, "cuGetErrorString", &d.cuGetErrorString) && load(lib, "cuMemHostAlloc", &d.cuMemHostAlloc) &&
            load(lib, "cuMemFreeHost", &d.cuMemFreeHost) && load(lib, "cuMemAlloc_v2", &d.cuMemAlloc) &&
            load(lib, "cuMemFree_v2", &d.cuMemFree) && load(lib, "cuModuleLoadData", &d.cuModuleLoadData) &&
            load(lib, "cuModuleGetFunction", &d.cuModuleGetFunction) && load(lib, "cuLaunchKernel", &d.cuLaunchKernel);
  if (!ok) {
    l.status = NotSupported("the CUDA driver is too old (missing driver API symbols)");
    return l;
  }
  CUresult r = d.cuInit(0);
  if (r != kSuccess) {
    l.status = d.check(r, "cuInit");
    l.status = NotSupported("no usable CUDA device: " + l.status.message());
    return l;
  }
  int n = 0;
  if (d.cuDeviceGetCount(&n) != kSuccess || n == 0) l.status = NotSupported("no CUDA device found");
  return l;
}

}  // namespace

Result<const CudaDriver*> CudaDriver::get() {
  static Loaded l = load_driver();
  if (!l.status.ok()) return l.status;
  return &l.drv;
}

Status CudaDriver::check(CUresult r, const char* what) const {
  if (r == kSuccess) return Status::Ok();
  const char* s = nullptr;
  if (cuGetErrorString) cuGetErrorString(r, &s);
  return Internal(std::string(what) + " failed: CUDA error " + std::to_string(r) + (s ? std::string(" (") + s + ")" : ""));
}

Status CudaDriver::use_device(int ordinal) const {
  // Each device's primary context is retained once per process and kept; setting it
  // current is cheap, so it is set on every call (the caller's thread may have had
  // its context changed by anyone since).
  static std::mutex mu;
  static std::map<int, CUcontext> retained;
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = retained.find(ordinal);
    if (it != retained.end()) ctx = it->second;
  }
  if (!ctx) {
    CUdevice dev;
    PDKV_RETURN_IF_ERROR(check(cuDeviceGet(&dev, ordinal), "cuDeviceGet"));
    PDKV_RETURN_IF_ERROR(check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain"));
    std::lock_guard<std::mutex> lk(mu);
    ctx = retained.emplace(ordinal, ctx).first->second;  // a racing retain is harmless (same context)
  }
  return check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

Status CudaDriver::probe() {
  if (g_initialized) return get().status();  // already initialized: the real answer
  bool overridden = false;
  const std::string path = driver_path(&overridden);
  void* lib = ::dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (!lib) {
    const char* err = ::dlerror();
    return NotSupported(overridden ? "cannot load the CUDA driver " + path + " (PDKV_CUDA_DRIVER): " + err
                                   : "the CUDA driver (libcuda.so.1) is not installed: " + std::string(err));
  }
  ::dlclose(lib);
  if (!overridden && !nvidia_device_present()) return NotSupported("no NVIDIA GPU found (no /dev/nvidia* device)");
  return Status::Ok();
}

bool CudaDriver::hardware_present() { return nvidia_device_present(); }

bool cuda_available() { return CudaDriver::get().ok(); }

}  // namespace pdkv::cuda
