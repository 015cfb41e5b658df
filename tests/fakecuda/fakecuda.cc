// fakecuda: the subset of the CUDA driver API that pdkv loads (cpp/src/cuda/driver.cc),
// emulated on host memory, so pdkv's CUDA paths run in CI on machines without a GPU.
// Point pdkv at it with PDKV_CUDA_DRIVER=/path/to/libfakecuda.so.
//
// Faithful where it catches real bugs:
// * Device memory is not host-accessible. cuMemAlloc hands out an address range
//   mapped PROT_NONE; the bytes live in a memfd that only the fake's copy engine
//   reaches (through a second, hidden mapping). A memcpy straight from a device
//   pointer faults (SIGSEGV), a sendmsg/recvmsg fails (EFAULT), as on a GPU.
// * Copies on a stream are asynchronous: each stream is a worker thread running its
//   operations in order; events complete when the stream reaches them.
//   FAKECUDA_COPY_DELAY_US=N delays every stream copy by N us to widen race windows.
// * IPC handles name (pid, memfd); a peer opens /proc/<pid>/fd/<fd>. Opening a handle
//   in the process that made it fails (201), as with real CUDA; opening one twice
//   returns the same pointer (reference counted).
// * A kernel (pdkv_batch_copy, pdkv_fp8_quantize, pdkv_fp8_dequantize; emulated) may
//   only touch device or pinned memory: a pageable host pointer in its descriptors is
//   an illegal address (700).
// * The FP8 kernels (cpp/src/cuda/fp8_codec.cu) are emulated from the rules in
//   docs/compression.md ("Exact rounding"), written independently of pdkv's codec:
//   e4m3 by searching the nearest of the 127 finite magnitudes (ties to the even
//   code), fp16 through the compiler's _Float16, bf16 by comparing the two
//   neighbours. Tests compare what lands with pdkv's host codec, so a rounding slip
//   on either side shows up.
// * The strided-copy kernel (pdkv_strided_copy) is NOT re-implemented: its source
//   (cpp/src/cuda/strided_copy.cu) is compiled in here as host code (host_shim.h) and
//   run over the launched grid, every (block, thread) pair, on the fake's aliases of
//   the runs' memory. Each run is checked whole (first to last piece) against device
//   or pinned memory first, as a GPU would fault on it.
//   FAKECUDA_NO_KERNEL=1 makes cuModuleLoadData fail (209), as on a GPU the fatbin
//   has no code for, so callers take their no-kernel path.
// * Calls that need a context fail with 201 on a thread without a current one.
//
// * Devices: FAKECUDA_DEVICES=N (1..8, default 1) emulated devices, each with its own
//   primary context; an allocation belongs to the device whose context is current, and
//   cuPointerGetAttribute reports it. Every pair can access each other (peer access,
//   P2P attributes) unless FAKECUDA_NO_P2P=1. Name, memory, compute capability (9.0),
//   PCI bus id and driver version (FAKECUDA_DRIVER_VERSION, default 13000) are made up
//   but stable, for `pdkv doctor`. cuGetProcAddress resolves this library's own symbols
//   (newest _vN first), so cuda-python's driver bindings load it; built with the soname
//   libcuda.so.1, a process that loaded it first gets it from a later dlopen("libcuda.so.1").
//
// Not emulated: timing, device memory limits, sticky context errors (an injected 700 is
// reported once, by the next synchronization on that stream, and the context stays
// usable so tests can check recovery).
//
// Test hooks (extern "C"): fakecuda_fail_copies(n) makes the next n copies (stream,
// synchronous or kernel) fail with 700; fakecuda_fail_launches(n) the next n kernel
// launches only (reported by the stream, as a fault inside a kernel is);
// fakecuda_stats(out, n) fills counters, see enum Stat. Build (tests/fakecuda_lib.py):
// g++ -std=c++17 -O2 -shared -fPIC -pthread -I../../cpp/src/cuda fakecuda.cc -o libfakecuda.so
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

using CUresult = int;
using CUdeviceptr = unsigned long long;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUctx_st {};
struct CUmod_st {};
struct CUfunc_st {};
struct CUstream_st;
struct CUevent_st;

namespace {

constexpr CUresult kOk = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidImage = 200;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kNoBinary = 209;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kNotFound = 500;
constexpr CUresult kNotReady = 600;
constexpr CUresult kIllegalAddress = 700;

const char* error_name(CUresult r) {
  switch (r) {
    case kOk: return "CUDA_SUCCESS";
    case kInvalidValue: return "CUDA_ERROR_INVALID_VALUE";
    case kInvalidDevice: return "CUDA_ERROR_INVALID_DEVICE";
    case kInvalidImage: return "CUDA_ERROR_INVALID_IMAGE";
    case kInvalidContext: return "CUDA_ERROR_INVALID_CONTEXT";
    case kNoBinary: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case kInvalidHandle: return "CUDA_ERROR_INVALID_HANDLE";
    case kNotFound: return "CUDA_ERROR_NOT_FOUND";
    case kNotReady: return "CUDA_ERROR_NOT_READY";
    case kIllegalAddress: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    default: return nullptr;
  }
}

// Counters for tests (fakecuda_stats); keep tests/fakecuda_lib.py STATS in sync.
enum Stat {
  kAsyncCopies, kKernelLaunches, kH2D, kD2H, kBytesCopied, kFailedCopies, kModuleLoads, kIpcOpens,
  kIpcCloses, kNoContextErrors, kLiveAllocs, kLiveIpcMappings, kLivePinned, kLiveStreams, kLiveEvents,
  kInits, kStridedLaunches, kStridedRuns, kBatchExtents, kNumStats
};
std::atomic<unsigned long long> g_stats[kNumStats];
void bump(Stat s, unsigned long long by = 1) { g_stats[s].fetch_add(by, std::memory_order_relaxed); }
void drop(Stat s) { g_stats[s].fetch_sub(1, std::memory_order_relaxed); }

std::atomic<int> g_fail_copies{0};
std::atomic<int> g_fail_launches{0};
// Consumes one injected failure of `counter`, if any is left.
bool take_failure(std::atomic<int>& counter = g_fail_copies) {
  int n = counter.load();
  while (n > 0)
    if (counter.compare_exchange_weak(n, n - 1)) {
      bump(kFailedCopies);
      return true;
    }
  return false;
}

unsigned copy_delay_us() {
  static const unsigned v = [] {
    const char* s = std::getenv("FAKECUDA_COPY_DELAY_US");
    return s ? static_cast<unsigned>(std::strtoul(s, nullptr, 10)) : 0u;
  }();
  return v;
}

constexpr int kMaxDevices = 8;
CUctx_st g_ctx[kMaxDevices];

int device_count() {
  static const int n = [] {
    const char* s = std::getenv("FAKECUDA_DEVICES");
    const long v = s ? std::strtol(s, nullptr, 10) : 1;
    return static_cast<int>(std::clamp(v, 1L, static_cast<long>(kMaxDevices)));
  }();
  return n;
}
// The device whose primary context is `ctx`, or -1.
int ctx_device(const CUctx_st* ctx) {
  for (int i = 0; i < device_count(); ++i)
    if (ctx == &g_ctx[i]) return i;
  return -1;
}
bool env_flag(const char* name) {
  const char* s = std::getenv(name);
  return s && *s && std::strcmp(s, "0") != 0;
}
CUmod_st g_module;
CUfunc_st g_batch_copy;
CUfunc_st g_fp8_quantize;
CUfunc_st g_fp8_dequantize;
CUfunc_st g_strided_copy;
thread_local CUctx_st* t_current = nullptr;

// CUDA needs a current context for most calls; a thread that never set one fails.
#define NEED_CONTEXT()             \
  do {                             \
    if (t_current == nullptr) {    \
      bump(kNoContextErrors);      \
      return kInvalidContext;      \
    }                              \
  } while (0)

// The memfd behind a device allocation, mapped read-write where only the fake looks.
struct Backing {
  char* alias = nullptr;
  size_t size = 0;
  int fd = -1;
  ~Backing() {
    if (alias) ::munmap(alias, size);
    if (fd >= 0) ::close(fd);
  }
};

using IpcKey = std::tuple<uint32_t, int32_t, uint64_t>;  // exporter pid, fd, serial

// A device address range: this process's allocation or a mapping of a peer's.
struct DevRange {
  uint64_t base = 0;
  size_t size = 0;
  std::shared_ptr<Backing> mem;
  uint64_t serial = 0;  // ours: the allocation's serial, for handles
  bool imported = false;
  int device = 0;  // the device whose context was current when it was allocated or opened
  IpcKey key{};
  int refs = 1;  // imported: opens of the same handle
};

struct HandleBytes {
  char magic[8];
  uint32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t serial;
  char pad[64 - 32];
};
static_assert(sizeof(HandleBytes) == sizeof(CUipcMemHandle), "IPC handle is 64 bytes");
constexpr char kMagic[8] = {'F', 'A', 'K', 'E', 'C', 'U', 'D', 'A'};

std::mutex g_mu;
std::map<uint64_t, DevRange> g_dev;       // by base address
std::map<uint64_t, size_t> g_pinned;      // cuMemHostAlloc'ed: base -> size
std::map<IpcKey, uint64_t> g_ipc_open;    // imported handle -> base in this process
std::map<CUevent_st*, std::shared_ptr<CUevent_st>> g_events;
std::map<CUstream_st*, std::unique_ptr<CUstream_st>> g_streams;
uint64_t g_next_serial = 1;

// The device range holding ptr, or nullptr (caller holds g_mu).
DevRange* find_dev(uint64_t ptr) {
  auto it = g_dev.upper_bound(ptr);
  if (it == g_dev.begin()) return nullptr;
  --it;
  return ptr < it->first + it->second.size ? &it->second : nullptr;
}

bool in_pinned(uint64_t ptr, size_t len) {
  auto it = g_pinned.upper_bound(ptr);
  if (it == g_pinned.begin()) return false;
  --it;
  return ptr >= it->first && ptr - it->first + len <= it->second;
}

// Where the copy engine reads or writes [ptr, ptr+len): the hidden alias for device
// memory (kept alive in `keep` while the copy runs), ptr itself for host memory.
struct Span {
  char* p = nullptr;
  std::shared_ptr<Backing> keep;
};
enum class Access { kAny, kDevice, kKernel };  // kKernel: device or pinned memory

CUresult translate(uint64_t ptr, size_t len, Access access, Span* out) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (DevRange* d = find_dev(ptr)) {
    if (len > d->size - (ptr - d->base)) return kInvalidValue;  // runs past the allocation
    out->p = d->mem->alias + (ptr - d->base);
    out->keep = d->mem;
    return kOk;
  }
  if (access == Access::kDevice) return kInvalidValue;
  if (access == Access::kKernel && !in_pinned(ptr, len)) return kIllegalAddress;  // pageable: not GPU-visible
  out->p = reinterpret_cast<char*>(ptr);
  return kOk;
}

CUresult copy_now(uint64_t dst, uint64_t src, size_t n, Access da, Access sa) {
  Span d, s;
  CUresult r = translate(dst, n, da, &d);
  if (r == kOk) r = translate(src, n, sa, &s);
  if (r != kOk) return r;
  std::memmove(d.p, s.p, n);
  bump(kBytesCopied, n);
  return kOk;
}

}  // namespace

// A stream: one worker thread running operations in FIFO order. A failing operation
// leaves its error for the next event or synchronization on the stream to report.
struct CUstream_st {
  struct Op {
    bool is_copy;
    std::function<CUresult()> fn;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> q;
  bool busy = false;
  bool stop = false;
  CUresult err = kOk;  // touched by the worker only
  std::thread th;

  CUstream_st() : th([this] { run(); }) {}
  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    th.join();
  }
  void push(bool is_copy, std::function<CUresult()> fn) {
    std::lock_guard<std::mutex> lk(mu);
    q.push_back(Op{is_copy, std::move(fn)});
    cv.notify_all();
  }
  void wait_idle() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return q.empty() && !busy; });
  }
  // The error left by operations since the last call, cleared (worker thread only).
  CUresult take_error() { return std::exchange(err, kOk); }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !q.empty(); });
      if (q.empty()) return;  // stop, drained
      Op op = std::move(q.front());
      q.pop_front();
      busy = true;
      lk.unlock();
      if (op.is_copy && copy_delay_us()) ::usleep(copy_delay_us());
      CUresult r = op.fn();
      if (r != kOk && err == kOk) err = r;
      lk.lock();
      busy = false;
      cv.notify_all();
    }
  }
};

struct CUevent_st {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;  // generation of the last cuEventRecord
  uint64_t reached = 0;   // generation the stream last reached
  CUresult err = kOk;     // error the stream reported at `reached`
};

namespace {

// Stream handles: nullptr and the legacy/per-thread sentinels are the default stream,
// which the fake runs synchronously in the caller.
bool is_default_stream(CUstream_st* s) {
  return s == nullptr || s == reinterpret_cast<CUstream_st*>(0x1) || s == reinterpret_cast<CUstream_st*>(0x2);
}

CUresult lookup_stream(CUstream_st* s, CUstream_st** out) {
  if (is_default_stream(s)) {
    *out = nullptr;
    return kOk;
  }
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_streams.count(s)) return kInvalidHandle;
  *out = s;
  return kOk;
}

// Runs `fn` on stream `s` (or now, on the default stream) as a copy operation.
CUresult submit_copy(CUstream_st* s, std::function<CUresult()> fn) {
  if (s == nullptr) return fn();
  s->push(true, std::move(fn));
  return kOk;
}

void sync_all_streams() {
  std::vector<CUstream_st*> all;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (auto& [p, s] : g_streams) all.push_back(p);
  }
  for (CUstream_st* s : all) s->wait_idle();
}

// Maps `size` bytes of memfd `fd` as device memory: a PROT_NONE range plus the alias.
// Takes ownership of fd, also on failure.
CUresult map_device(int fd, size_t size, uint64_t* base, std::shared_ptr<Backing>* mem) {
  auto b = std::make_shared<Backing>();
  b->fd = fd;
  b->size = size;
  b->alias = nullptr;
  void* alias = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (alias == MAP_FAILED) return kInvalidValue;  // b closes fd
  b->alias = static_cast<char*>(alias);
  void* dev = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (dev == MAP_FAILED) return kInvalidValue;
  *base = reinterpret_cast<uint64_t>(dev);
  *mem = std::move(b);
  return kOk;
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned flags) {
  bump(kInits);
  return flags == 0 ? kOk : kInvalidValue;
}
CUresult cuDeviceGetCount(int* n) {
  if (!n) return kInvalidValue;
  *n = device_count();
  return kOk;
}
CUresult cuDeviceGet(int* dev, int ordinal) {
  if (!dev) return kInvalidValue;
  if (ordinal < 0 || ordinal >= device_count()) return kInvalidDevice;
  *dev = ordinal;
  return kOk;
}
CUresult cuDevicePrimaryCtxRetain(CUctx_st** ctx, int dev) {
  if (!ctx) return kInvalidValue;
  if (dev < 0 || dev >= device_count()) return kInvalidDevice;
  *ctx = &g_ctx[dev];
  return kOk;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
  return dev < 0 || dev >= device_count() ? kInvalidDevice : kOk;
}
CUresult cuCtxSetCurrent(CUctx_st* ctx) {
  if (ctx != nullptr && ctx_device(ctx) < 0) return kInvalidContext;
  t_current = ctx;
  return kOk;
}
CUresult cuCtxGetCurrent(CUctx_st** ctx) {
  if (!ctx) return kInvalidValue;
  *ctx = t_current;
  return kOk;
}
CUresult cuCtxGetDevice(int* dev) {
  NEED_CONTEXT();
  if (!dev) return kInvalidValue;
  *dev = ctx_device(t_current);
  return kOk;
}
CUresult cuCtxSynchronize() {
  NEED_CONTEXT();
  sync_all_streams();
  return kOk;
}

// ---- what `pdkv doctor` asks (made-up, stable answers) ----

CUresult cuDriverGetVersion(int* v) {
  if (!v) return kInvalidValue;
  const char* s = std::getenv("FAKECUDA_DRIVER_VERSION");
  *v = s ? static_cast<int>(std::strtol(s, nullptr, 10)) : 13000;
  return kOk;
}
CUresult cuDeviceGetName(char* name, int len, int dev) {
  if (!name || len <= 0) return kInvalidValue;
  if (dev < 0 || dev >= device_count()) return kInvalidDevice;
  std::snprintf(name, static_cast<size_t>(len), "pdkv fakecuda device %d", dev);
  return kOk;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) {
  if (!bytes) return kInvalidValue;
  if (dev < 0 || dev >= device_count()) return kInvalidDevice;
  *bytes = size_t{16} << 30;
  return kOk;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  NEED_CONTEXT();
  if (free_bytes) *free_bytes = size_t{15} << 30;
  if (total) *total = size_t{16} << 30;
  return kOk;
}
CUresult cuDeviceGetAttribute(int* out, int attr, int dev) {
  if (!out) return kInvalidValue;
  if (dev < 0 || dev >= device_count()) return kInvalidDevice;
  switch (attr) {
    case 16: *out = 4; return kOk;                        // MULTIPROCESSOR_COUNT
    case 33: *out = 0x10 + dev; return kOk;               // PCI_BUS_ID
    case 34: *out = 0; return kOk;                        // PCI_DEVICE_ID
    case 50: *out = 0; return kOk;                        // PCI_DOMAIN_ID
    case 41: *out = 1; return kOk;                        // UNIFIED_ADDRESSING
    case 75: *out = 9; return kOk;                        // COMPUTE_CAPABILITY_MAJOR
    case 76: *out = 0; return kOk;                        // COMPUTE_CAPABILITY_MINOR
    case 83: *out = 1; return kOk;                        // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    default: return kInvalidValue;
  }
}
CUresult cuDeviceGetPCIBusId(char* out, int len, int dev) {
  if (!out || len <= 0) return kInvalidValue;
  if (dev < 0 || dev >= device_count()) return kInvalidDevice;
  std::snprintf(out, static_cast<size_t>(len), "0000:%02x:00.0", 0x10 + dev);
  return kOk;
}
CUresult cuDeviceCanAccessPeer(int* can, int dev, int peer) {
  if (!can) return kInvalidValue;
  if (dev < 0 || dev >= device_count() || peer < 0 || peer >= device_count()) return kInvalidDevice;
  *can = dev != peer && !env_flag("FAKECUDA_NO_P2P");
  return kOk;
}
CUresult cuDeviceGetP2PAttribute(int* out, int attr, int src, int dst) {
  if (!out) return kInvalidValue;
  if (src < 0 || src >= device_count() || dst < 0 || dst >= device_count() || src == dst) return kInvalidDevice;
  const int p2p = !env_flag("FAKECUDA_NO_P2P");
  switch (attr) {
    case 1: *out = 0; return kOk;    // PERFORMANCE_RANK
    case 2: *out = p2p; return kOk;  // ACCESS_SUPPORTED
    case 3: *out = p2p; return kOk;  // NATIVE_ATOMIC_SUPPORTED
    case 4: *out = p2p; return kOk;  // CUDA_ARRAY_ACCESS_SUPPORTED
    default: return kInvalidValue;
  }
}

// This library's own symbol `name`, newest version first (cuMemAlloc -> cuMemAlloc_v2),
// as the real driver maps a name to the ABI of the requested version.
CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status) {
  if (!symbol || !pfn) return kInvalidValue;
  Dl_info self{};
  void* handle = nullptr;
  if (::dladdr(reinterpret_cast<void*>(&cuGetProcAddress_v2), &self) && self.dli_fname)
    handle = ::dlopen(self.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  void* f = nullptr;
  if (handle) {
    for (const char* suffix : {"_v3", "_v2", ""}) {
      f = ::dlsym(handle, (std::string(symbol) + suffix).c_str());
      if (f) break;
    }
    ::dlclose(handle);
  }
  *pfn = f;
  if (status) *status = f ? 0 : 1;  // CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND
  return f ? kOk : kNotFound;
}
CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}
CUresult cuGetErrorString(CUresult r, const char** out) {
  if (!out) return kInvalidValue;
  *out = error_name(r);
  return *out ? kOk : kInvalidValue;
}

// ---- memory ----

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t n) {
  NEED_CONTEXT();
  if (!out || n == 0) return kInvalidValue;
  int fd = ::memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0) return kInvalidValue;
  if (::ftruncate(fd, static_cast<off_t>(n)) != 0) {
    ::close(fd);
    return kInvalidValue;
  }
  DevRange d;
  d.size = n;
  d.device = ctx_device(t_current);
  CUresult r = map_device(fd, n, &d.base, &d.mem);
  if (r != kOk) return r;
  std::lock_guard<std::mutex> lk(g_mu);
  d.serial = g_next_serial++;
  *out = d.base;
  g_dev.emplace(d.base, std::move(d));
  bump(kLiveAllocs);
  return kOk;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  NEED_CONTEXT();
  sync_all_streams();  // cuMemFree synchronizes, as cudaFree does
  DevRange d;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_dev.find(ptr);
    if (it == g_dev.end() || it->second.imported) return kInvalidValue;
    d = std::move(it->second);
    g_dev.erase(it);
  }
  ::munmap(reinterpret_cast<void*>(d.base), d.size);
  drop(kLiveAllocs);
  return kOk;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  std::lock_guard<std::mutex> lk(g_mu);
  DevRange* d = find_dev(ptr);
  if (!d) return kInvalidValue;
  if (base) *base = d->base;
  if (size) *size = d->size;
  return kOk;
}

CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  if (!data) return kInvalidValue;
  std::lock_guard<std::mutex> lk(g_mu);
  const DevRange* range = find_dev(ptr);
  const bool dev = range != nullptr;
  const bool pinned = !dev && in_pinned(ptr, 1);
  switch (attr) {
    case 1:  // CU_POINTER_ATTRIBUTE_CONTEXT
      if (!dev && !pinned) return kInvalidValue;
      *static_cast<CUctx_st**>(data) = &g_ctx[dev ? range->device : 0];
      return kOk;
    case 2:  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE: 1 host, 2 device
      if (!dev && !pinned) return kInvalidValue;
      *static_cast<unsigned*>(data) = dev ? 2 : 1;
      return kOk;
    case 9:  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
      if (!dev) return kInvalidValue;
      *static_cast<int*>(data) = range->device;
      return kOk;
    default:
      return kInvalidValue;
  }
}

CUresult cuMemHostAlloc(void** out, size_t n, unsigned flags) {
  NEED_CONTEXT();
  if (!out || n == 0) return kInvalidValue;
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return kInvalidValue;
  std::lock_guard<std::mutex> lk(g_mu);
  g_pinned[reinterpret_cast<uint64_t>(p)] = n;
  *out = p;
  bump(kLivePinned);
  return kOk;
}

CUresult cuMemFreeHost(void* p) {
  NEED_CONTEXT();
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_pinned.find(reinterpret_cast<uint64_t>(p));
    if (it == g_pinned.end()) return kInvalidValue;
    n = it->second;
    g_pinned.erase(it);
  }
  ::munmap(p, n);
  drop(kLivePinned);
  return kOk;
}

// ---- IPC ----

CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr) {
  NEED_CONTEXT();
  if (!handle) return kInvalidValue;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_dev.find(ptr);
  if (it == g_dev.end() || it->second.imported) return kInvalidValue;  // not an allocation base
  HandleBytes h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.pid = static_cast<uint32_t>(::getpid());
  h.fd = it->second.mem->fd;
  h.size = it->second.size;
  h.serial = it->second.serial;
  std::memcpy(handle, &h, sizeof h);
  return kOk;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, CUipcMemHandle handle, unsigned flags) {
  NEED_CONTEXT();
  if (!out || (flags & ~1u)) return kInvalidValue;
  HandleBytes h;
  std::memcpy(&h, &handle, sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.size == 0) return kInvalidHandle;
  if (h.pid == static_cast<uint32_t>(::getpid())) return kInvalidContext;  // CUDA refuses own handles
  const IpcKey key{h.pid, h.fd, h.serial};
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_ipc_open.find(key);
    if (it != g_ipc_open.end()) {
      g_dev.at(it->second).refs++;
      *out = it->second;
      return kOk;
    }
  }
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidHandle;  // the exporter is gone
  off_t sz = ::lseek(fd, 0, SEEK_END);
  if (sz != static_cast<off_t>(h.size)) {
    ::close(fd);
    return kInvalidHandle;
  }
  DevRange d;
  d.size = h.size;
  d.imported = true;
  d.device = ctx_device(t_current);
  d.key = key;
  CUresult r = map_device(fd, h.size, &d.base, &d.mem);
  if (r != kOk) return r;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_ipc_open.find(key);
  if (it != g_ipc_open.end()) {  // another thread opened it meanwhile: use that one
    ::munmap(reinterpret_cast<void*>(d.base), d.size);
    g_dev.at(it->second).refs++;
    *out = it->second;
    return kOk;
  }
  *out = d.base;
  g_ipc_open[key] = d.base;
  g_dev.emplace(d.base, std::move(d));
  bump(kIpcOpens);
  bump(kLiveIpcMappings);
  return kOk;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  NEED_CONTEXT();
  DevRange d;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_dev.find(ptr);
    if (it == g_dev.end() || !it->second.imported) return kInvalidValue;
    if (--it->second.refs > 0) return kOk;
    d = std::move(it->second);
    g_ipc_open.erase(d.key);
    g_dev.erase(it);
  }
  ::munmap(reinterpret_cast<void*>(d.base), d.size);  // the alias goes with the last copy using it
  bump(kIpcCloses);
  drop(kLiveIpcMappings);
  return kOk;
}

// ---- copies ----

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  NEED_CONTEXT();
  bump(kH2D);
  if (take_failure()) return kIllegalAddress;
  return copy_now(dst, reinterpret_cast<uint64_t>(src), n, Access::kDevice, Access::kAny);
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  NEED_CONTEXT();
  bump(kD2H);
  if (take_failure()) return kIllegalAddress;
  return copy_now(reinterpret_cast<uint64_t>(dst), src, n, Access::kAny, Access::kDevice);
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream_st* stream) {
  NEED_CONTEXT();
  CUstream_st* s = nullptr;
  CUresult r = lookup_stream(stream, &s);
  if (r != kOk) return r;
  {  // ranges are checked at the call, addresses resolved when the copy runs
    Span a, b;
    if (translate(dst, n, Access::kAny, &a) != kOk || translate(src, n, Access::kAny, &b) != kOk)
      return kInvalidValue;
  }
  bump(kAsyncCopies);
  const bool fail = take_failure();
  return submit_copy(s, [=]() -> CUresult {
    if (fail) return kIllegalAddress;
    return copy_now(dst, src, n, Access::kAny, Access::kAny) == kOk ? kOk : kIllegalAddress;
  });
}

// ---- streams and events ----

CUresult cuStreamCreate(CUstream_st** out, unsigned flags) {
  NEED_CONTEXT();
  if (!out) return kInvalidValue;
  auto s = std::make_unique<CUstream_st>();
  std::lock_guard<std::mutex> lk(g_mu);
  *out = s.get();
  g_streams.emplace(s.get(), std::move(s));
  bump(kLiveStreams);
  return kOk;
}

CUresult cuStreamDestroy_v2(CUstream_st* stream) {
  std::unique_ptr<CUstream_st> s;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_streams.find(stream);
    if (it == g_streams.end()) return kInvalidHandle;
    s = std::move(it->second);
    g_streams.erase(it);
  }
  s.reset();  // runs what was queued, then joins the worker
  drop(kLiveStreams);
  return kOk;
}

CUresult cuStreamSynchronize(CUstream_st* stream) {
  CUstream_st* s = nullptr;
  CUresult r = lookup_stream(stream, &s);
  if (r != kOk || s == nullptr) return r;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  CUresult err = kOk;
  s->push(false, [&, s] {
    CUresult e = s->take_error();
    std::lock_guard<std::mutex> lk(mu);
    err = e;
    done = true;
    cv.notify_all();
    return kOk;
  });
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done; });
  return err;
}

CUresult cuEventCreate(CUevent_st** out, unsigned flags) {
  NEED_CONTEXT();
  if (!out) return kInvalidValue;
  auto e = std::make_shared<CUevent_st>();
  std::lock_guard<std::mutex> lk(g_mu);
  *out = e.get();
  g_events.emplace(e.get(), std::move(e));
  bump(kLiveEvents);
  return kOk;
}

static std::shared_ptr<CUevent_st> lookup_event(CUevent_st* e) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_events.find(e);
  return it == g_events.end() ? nullptr : it->second;
}

CUresult cuEventRecord(CUevent_st* event, CUstream_st* stream) {
  auto e = lookup_event(event);
  if (!e) return kInvalidHandle;
  CUstream_st* s = nullptr;
  CUresult r = lookup_stream(stream, &s);
  if (r != kOk) return r;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    gen = ++e->recorded;
  }
  auto reach = [e, gen](CUresult err) {
    std::lock_guard<std::mutex> lk(e->mu);
    e->reached = gen;
    e->err = err;
    e->cv.notify_all();
  };
  if (s == nullptr) {
    reach(kOk);
  } else {
    s->push(false, [s, reach] {
      reach(s->take_error());
      return kOk;
    });
  }
  return kOk;
}

CUresult cuEventSynchronize(CUevent_st* event) {
  auto e = lookup_event(event);
  if (!e) return kInvalidHandle;
  std::unique_lock<std::mutex> lk(e->mu);
  const uint64_t want = e->recorded;
  e->cv.wait(lk, [&] { return e->reached >= want; });
  return e->err;
}

CUresult cuEventQuery(CUevent_st* event) {
  auto e = lookup_event(event);
  if (!e) return kInvalidHandle;
  std::lock_guard<std::mutex> lk(e->mu);
  return e->reached < e->recorded ? kNotReady : e->err;
}

CUresult cuEventDestroy_v2(CUevent_st* event) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_events.erase(event)) return kInvalidHandle;  // a pending record keeps its own reference
  drop(kLiveEvents);
  return kOk;
}

// ---- the batched-copy kernel ----

CUresult cuModuleLoadData(CUmod_st** out, const void* image) {
  NEED_CONTEXT();
  if (!out || !image) return kInvalidValue;
  const char* v = std::getenv("FAKECUDA_NO_KERNEL");
  if (v && *v && std::strcmp(v, "0") != 0) return kNoBinary;
  uint32_t magic;
  std::memcpy(&magic, image, sizeof magic);
  const bool fatbin = magic == 0xBA55ED50u, elf = std::memcmp(image, "\x7f" "ELF", 4) == 0;
  if (!fatbin && !elf) return kInvalidImage;
  bump(kModuleLoads);
  *out = &g_module;
  return kOk;
}

CUresult cuModuleGetFunction(CUfunc_st** out, CUmod_st* mod, const char* name) {
  if (!out || !name) return kInvalidValue;
  if (mod != &g_module) return kInvalidHandle;
  if (std::strcmp(name, "pdkv_batch_copy") == 0) *out = &g_batch_copy;
  else if (std::strcmp(name, "pdkv_fp8_quantize") == 0) *out = &g_fp8_quantize;
  else if (std::strcmp(name, "pdkv_fp8_dequantize") == 0) *out = &g_fp8_dequantize;
  else if (std::strcmp(name, "pdkv_strided_copy") == 0) *out = &g_strided_copy;
  else return kNotFound;
  return kOk;
}


}  // extern "C"

// ---- the FP8 kernels, emulated from docs/compression.md ----
//
// Arguments (cpp/src/cuda/fp8_abi.h; a copy: this file is built alone).
struct Fp8Piece {
  uint64_t addr, first_row, rows;
};
struct Fp8FrameDesc {
  uint64_t first_group, first_row, rows, scales_off, codes_off;
};
struct Fp8Launch {
  uint64_t pieces, frames, buf, total_groups;
  uint32_t npieces, nframes, heads, head_dim, rows_per_group, dtype;
};
static_assert(sizeof(Fp8Piece) == 24 && sizeof(Fp8FrameDesc) == 40 && sizeof(Fp8Launch) == 56,
              "keep in sync with cpp/src/cuda/fp8_abi.h");

namespace {

uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The value of an e4m3fn code by its definition (0x7F / 0xFF are NaN).
double e4m3_value(unsigned c) {
  const unsigned e = (c >> 3) & 15, m = c & 7;
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, int(e) - 7);
  return (c & 0x80) ? -mag : mag;
}

// Nearest e4m3 code, ties to the even code, saturating at 448; NaN keeps its sign.
uint8_t e4m3_of(float y) {
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  if (std::isnan(y)) return sign | 0x7F;
  const double a = std::fabs(double(y));
  if (a >= 448.0) return sign | 0x7E;
  unsigned best = 0;
  double best_d = a;
  for (unsigned c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(a - e4m3_value(c));
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return uint8_t(sign | best);
}

float read_elem(const char* p, uint32_t dtype) {
  if (dtype == 0) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (dtype == 2) return u2f(uint32_t(h) << 16);
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}

// bf16 nearest to v: of the two neighbours of its truncation, the closer; a tie to
// the even one. (The step past the largest finite bf16 stands for infinity.)
uint16_t bf16_of(float v) {
  const uint32_t x = f2u(v);
  if (std::isnan(v)) return uint16_t((x >> 16) | 0x40);
  const uint16_t lo = uint16_t(x >> 16);
  if ((x & 0xFFFF) == 0) return lo;
  const uint16_t hi = uint16_t(lo + 1);
  auto mag = [](uint16_t b) {
    const uint32_t e = (b >> 7) & 0xFF, m = b & 0x7F;
    return e == 0 ? std::ldexp(double(m), -133) : std::ldexp(1.0 + m / 128.0, int(e) - 127);
  };
  const double a = std::fabs(double(v)), dlo = a - mag(lo & 0x7FFF), dhi = mag(hi & 0x7FFF) - a;
  return dlo < dhi || (dlo == dhi && (lo & 1) == 0) ? lo : hi;
}

void write_elem(char* p, uint32_t dtype, float v) {
  if (dtype == 0) {
    std::memcpy(p, &v, 4);
    return;
  }
  uint16_t h;
  if (dtype == 2) {
    h = bf16_of(v);
  } else if (std::isnan(v)) {
    h = std::signbit(v) ? 0xFE00 : 0x7E00;
  } else {
    const _Float16 x = static_cast<_Float16>(v);
    std::memcpy(&h, &x, 2);
  }
  std::memcpy(p, &h, 2);
}

// The emulated kernels' view of one launch: its tables, read through the fake's
// device mappings (device or pinned memory only, as a kernel).
struct Fp8View {
  Fp8Launch a;
  std::vector<Fp8Piece> pieces;
  std::vector<Fp8FrameDesc> frames;
  Span buf;
  uint64_t row_elems = 0;
  size_t esize = 0;

  CUresult load(const Fp8Launch& launch) {
    a = launch;
    if (a.npieces == 0 || a.nframes == 0 || a.heads == 0 || a.head_dim == 0 || a.rows_per_group == 0 || a.dtype > 2)
      return kInvalidValue;
    esize = a.dtype == 0 ? 4 : 2;
    row_elems = uint64_t(a.heads) * a.head_dim;
    pieces.resize(a.npieces);
    frames.resize(a.nframes);
    Span p, f;
    if (translate(a.pieces, pieces.size() * sizeof(Fp8Piece), Access::kKernel, &p) != kOk ||
        translate(a.frames, frames.size() * sizeof(Fp8FrameDesc), Access::kKernel, &f) != kOk)
      return kIllegalAddress;
    std::memcpy(pieces.data(), p.p, pieces.size() * sizeof(Fp8Piece));
    std::memcpy(frames.data(), f.p, frames.size() * sizeof(Fp8FrameDesc));
    return kOk;
  }
  // Element (row, head, d) of the extents, or nullptr if it is not in device memory.
  char* elem(uint64_t row, uint32_t head, uint32_t d, std::vector<Span>& keep) {
    const Fp8Piece* p = nullptr;
    for (const Fp8Piece& q : pieces)
      if (row >= q.first_row && row < q.first_row + q.rows) p = &q;
    if (!p) return nullptr;
    const uint64_t addr = p->addr + ((row - p->first_row) * row_elems + uint64_t(head) * a.head_dim + d) * esize;
    Span s;
    if (translate(addr, esize, Access::kKernel, &s) != kOk) return nullptr;
    keep.push_back(s);
    return s.p;
  }
  // Byte `off` of buf (the scales and codes), or nullptr.
  char* at(uint64_t off, size_t n, std::vector<Span>& keep) {
    Span s;
    if (translate(a.buf + off, n, Access::kKernel, &s) != kOk) return nullptr;
    keep.push_back(s);
    return s.p;
  }
};

// Calls f(frame, k, head, r0, r1) for every scale group (group k of its frame).
template <typename F>
void for_each_fp8_group(const Fp8View& v, F&& f) {
  for (const Fp8FrameDesc& fr : v.frames) {
    uint64_t k = 0;
    for (uint64_t r0 = fr.first_row; r0 < fr.first_row + fr.rows; r0 += v.a.rows_per_group)
      for (uint32_t h = 0; h < v.a.heads; ++h, ++k)
        f(fr, k, h, r0, std::min<uint64_t>(r0 + v.a.rows_per_group, fr.first_row + fr.rows));
  }
}

CUresult fp8_quantize(const Fp8Launch& launch) {
  Fp8View v;
  CUresult r = v.load(launch);
  if (r != kOk) return r;
  CUresult err = kOk;
  for_each_fp8_group(v, [&](const Fp8FrameDesc& fr, uint64_t k, uint32_t h, uint64_t r0, uint64_t r1) {
    if (err != kOk) return;
    std::vector<Span> keep;
    float amax = 0;
    for (uint64_t row = r0; row < r1; ++row)
      for (uint32_t d = 0; d < v.a.head_dim; ++d) {
        const char* p = v.elem(row, h, d, keep);
        if (!p) {
          err = kIllegalAddress;
          return;
        }
        const float x = std::fabs(read_elem(p, v.a.dtype));
        if (std::isfinite(x) && x > amax) amax = x;
      }
    float scale = amax / 448.0f, inv = 448.0f / amax;
    if (scale == 0.0f || !std::isfinite(inv)) scale = inv = 1.0f;
    char* sp = v.at(fr.scales_off + 4 * k, 4, keep);
    if (!sp) {
      err = kIllegalAddress;
      return;
    }
    std::memcpy(sp, &scale, 4);
    for (uint64_t row = r0; row < r1; ++row)
      for (uint32_t d = 0; d < v.a.head_dim; ++d) {
        const float x = read_elem(v.elem(row, h, d, keep), v.a.dtype);
        char* cp = v.at(fr.codes_off + (row - fr.first_row) * v.row_elems + uint64_t(h) * v.a.head_dim + d, 1, keep);
        if (!cp) {
          err = kIllegalAddress;
          return;
        }
        *cp = char(e4m3_of(x * inv));
      }
  });
  return err;
}

CUresult fp8_dequantize(const Fp8Launch& launch) {
  Fp8View v;
  CUresult r = v.load(launch);
  if (r != kOk) return r;
  CUresult err = kOk;
  for_each_fp8_group(v, [&](const Fp8FrameDesc& fr, uint64_t k, uint32_t h, uint64_t r0, uint64_t r1) {
    if (err != kOk) return;
    std::vector<Span> keep;
    const char* sp = v.at(fr.scales_off + 4 * k, 4, keep);
    if (!sp) {
      err = kIllegalAddress;
      return;
    }
    float scale;
    std::memcpy(&scale, sp, 4);
    for (uint64_t row = r0; row < r1; ++row)
      for (uint32_t d = 0; d < v.a.head_dim; ++d) {
        const char* cp = v.at(fr.codes_off + (row - fr.first_row) * v.row_elems + uint64_t(h) * v.a.head_dim + d, 1, keep);
        char* out = v.elem(row, h, d, keep);
        if (!cp || !out) {
          err = kIllegalAddress;
          return;
        }
        const uint8_t c = uint8_t(*cp);
        // NaN codes decode to a quiet NaN of their sign; the rest to value x scale.
        const float val = (c & 0x7F) == 0x7F ? u2f((c & 0x80 ? 0x80000000u : 0u) | 0x7FC00000u)
                                             : float(e4m3_value(c)) * scale;
        write_elem(out, v.a.dtype, val);
      }
  });
  return err;
}

}  // namespace

// ---- the strided-copy kernel: pdkv's own source, run as host code ----

#include "host_shim.h"
#include "strided_copy.cu"

namespace {

// pdkv_strided_copy(const StridedRun* runs, unsigned n): reads the run table through
// the fake's mappings, replaces every run's addresses by the fake's aliases (a run
// reaching outside device or pinned memory is an illegal address, nothing copied),
// then runs the kernel for every (block, thread) of the launched grid.
CUresult strided_copy(uint64_t table, unsigned n, unsigned grid, unsigned block) {
  using pdkv::cuda::StridedRun;
  if (n == 0) return kOk;
  Span t;
  if (translate(table, size_t(n) * sizeof(StridedRun), Access::kKernel, &t) != kOk) return kIllegalAddress;
  std::vector<StridedRun> runs(n);
  std::memcpy(runs.data(), t.p, runs.size() * sizeof(StridedRun));
  std::vector<Span> keep;
  for (StridedRun& r : runs) {
    if (r.len == 0 || r.count == 0) continue;
    // [first byte, last byte] of each side; the kernel reads and writes inside it.
    const uint64_t sspan = (r.count - 1) * r.src_stride + r.len, dspan = (r.count - 1) * r.dst_stride + r.len;
    Span s, d;
    if (translate(r.src, sspan, Access::kKernel, &s) != kOk || translate(r.dst, dspan, Access::kKernel, &d) != kOk)
      return kIllegalAddress;
    r.src = reinterpret_cast<uint64_t>(s.p);
    r.dst = reinterpret_cast<uint64_t>(d.p);
    bump(kBytesCopied, r.len * r.count);
    keep.push_back(std::move(s));
    keep.push_back(std::move(d));
  }
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b)
    for (unsigned th = 0; th < block; ++th) {
      blockIdx.x = b;
      threadIdx.x = th;
      pdkv_strided_copy(runs.data(), n);
    }
  return kOk;
}

}  // namespace

extern "C" {

// pdkv_batch_copy(const u64* src, const u64* dst, const u64* len, unsigned n): copies
// extent i from src[i] to dst[i]; the arrays and every extent must be device-visible.
CUresult cuLaunchKernel(CUfunc_st* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, CUstream_st* stream, void** params, void** extra) {
  if (f != &g_batch_copy && f != &g_fp8_quantize && f != &g_fp8_dequantize && f != &g_strided_copy)
    return kInvalidHandle;
  if (!params || extra || gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024 ||
      gy > 65535 || gz > 65535)
    return kInvalidValue;
  CUstream_st* s = nullptr;
  CUresult r = lookup_stream(stream, &s);
  if (r != kOk) return r;
  if (f == &g_strided_copy) {
    const uint64_t table = *static_cast<uint64_t*>(params[0]);  // copied at launch, as CUDA does
    const unsigned n = *static_cast<unsigned*>(params[1]);
    bump(kKernelLaunches);
    bump(kStridedLaunches);
    bump(kStridedRuns, n);
    const bool fail = take_failure() || take_failure(g_fail_launches);
    return submit_copy(s, [=]() -> CUresult { return fail ? kIllegalAddress : strided_copy(table, n, gx, bx); });
  }
  if (f != &g_batch_copy) {
    Fp8Launch a;
    std::memcpy(&a, params[0], sizeof a);  // copied at launch, as CUDA does
    bump(kKernelLaunches);
    const bool fail = take_failure() || take_failure(g_fail_launches);
    const bool quantize = f == &g_fp8_quantize;
    return submit_copy(s, [=]() -> CUresult {
      if (fail) return kIllegalAddress;
      return quantize ? fp8_quantize(a) : fp8_dequantize(a);
    });
  }
  // Arguments are copied at launch, as CUDA does: params may point at the caller's stack.
  const CUdeviceptr src = *static_cast<CUdeviceptr*>(params[0]), dst = *static_cast<CUdeviceptr*>(params[1]),
                    len = *static_cast<CUdeviceptr*>(params[2]);
  const unsigned n = *static_cast<unsigned*>(params[3]);
  bump(kKernelLaunches);
  bump(kBatchExtents, n);
  const bool fail = take_failure();
  return submit_copy(s, [=]() -> CUresult {
    if (fail) return kIllegalAddress;
    Span S, D, L;
    const size_t bytes = 8ull * n;
    if (n == 0) return kOk;
    if (translate(src, bytes, Access::kKernel, &S) != kOk || translate(dst, bytes, Access::kKernel, &D) != kOk ||
        translate(len, bytes, Access::kKernel, &L) != kOk)
      return kIllegalAddress;
    for (unsigned i = 0; i < n; ++i) {
      uint64_t si, di, li;
      std::memcpy(&si, S.p + 8ull * i, 8);
      std::memcpy(&di, D.p + 8ull * i, 8);
      std::memcpy(&li, L.p + 8ull * i, 8);
      if (li == 0) continue;
      if (copy_now(di, si, li, Access::kKernel, Access::kKernel) != kOk) return kIllegalAddress;
    }
    return kOk;
  });
}

// ---- test hooks ----

// The next `n` copies (cuMemcpyAsync, cuMemcpyHtoD/DtoH, kernel launches) fail with
// CUDA_ERROR_ILLEGAL_ADDRESS without moving bytes; n <= 0 clears.
void fakecuda_fail_copies(int n) { g_fail_copies.store(n > 0 ? n : 0); }

// The next `n` kernel launches fail with CUDA_ERROR_ILLEGAL_ADDRESS when they run
// (the launch call itself succeeds); n <= 0 clears.
void fakecuda_fail_launches(int n) { g_fail_launches.store(n > 0 ? n : 0); }

// Copies up to `n` counters (enum Stat order) into out; returns how many exist.
int fakecuda_stats(unsigned long long* out, int n) {
  for (int i = 0; i < n && i < kNumStats; ++i) out[i] = g_stats[i].load();
  return kNumStats;
}

}  // extern "C"
