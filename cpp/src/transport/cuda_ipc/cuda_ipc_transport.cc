// The cuda_ipc transport: GPU pools on the same node (NVLink or PCIe), one copy.
//
// Each agent publishes, for every exported CUDA region, the CUDA IPC handle of the
// allocation holding it (cuMemGetAddressRange + cuIpcGetMemHandle, so tensors from
// torch's caching allocator work) and the region's offset inside it. A peer opens
// each handle once (cuIpcOpenMemHandle, lazy peer access) and a transfer is one
// cuMemcpyAsync per extent on pdkv's own stream; a completion thread waits on an
// event (blocking sync, no spinning) and then resolves the transfer. Notifications
// travel through the agent's tcp/shm transport after the copy completed.
//
// The CUDA driver is loaded at run time (cuda/driver.h); without a GPU this
// transport is simply not viable and never selected.
//
// Limitation: the exporter cannot force peers to close handles; deregister device
// regions only after the peers using them finished (or were removed).
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda/driver.h"
#include "pdkv/registry.h"
#include "util/bytes.h"
#include "util/log.h"

extern const unsigned char kPdkvBatchCopyFatbin[];
extern const unsigned long kPdkvBatchCopyFatbinSize;

namespace pdkv::cuda_ipc {
namespace {

constexpr uint64_t kKernelChunk = 64 << 10;  // extents are split to this for the kernel

using cuda::CudaDriver;
using cuda::CUresult;
using cuda::CUdeviceptr;
using cuda::CUevent;
using cuda::CUipcMemHandle;
using cuda::CUstream;

struct Exported {
  uint64_t id = 0;
  uint64_t len = 0;
  int32_t device = 0;
  uint64_t offset = 0;  // region start minus allocation base
  CUipcMemHandle handle{};
};

struct Opened {
  CUdeviceptr base = 0;  // mapped allocation base in this process
  uint64_t offset = 0;
  uint64_t len = 0;
  int device = 0;  // whose context mapped it
  ~Opened() {
    // The last holder may be any thread (drop_peer from a progress thread, a Python
    // thread dropping a prepared transfer): closing needs the context current there.
    if (base) {
      auto d = CudaDriver::get();
      if (d.ok() && (*d)->use_device(device).ok()) (*d)->cuIpcCloseMemHandle(base);
    }
  }
};

struct Op {
  CUdeviceptr dst;
  CUdeviceptr src;
  uint64_t len;
};

struct CudaPrepared final : PreparedOps {
  ~CudaPrepared() {
    if (d_desc) {
      auto d = CudaDriver::get();
      if (d.ok() && (*d)->use_device(device).ok()) (*d)->cuMemFree(d_desc);
    }
  }
  std::shared_ptr<const Peer> peer;
  std::vector<std::shared_ptr<Opened>> opened;  // keeps the mappings alive
  std::vector<Op> ops;
  int device = 0;
  uint64_t total = 0;
  // Kernel path: src[n], dst[n], len[n] (u64) uploaded once to device memory.
  CUdeviceptr d_desc = 0;
  unsigned n_chunks = 0;
  cuda::CUfunction kernel = nullptr;
};

struct Pending {
  CUevent event = nullptr;
  std::shared_ptr<const CudaPrepared> prep;
  std::shared_ptr<Transfer> xfer;
  std::string notif;
};

std::string encode(const std::vector<Exported>& regions) {
  util::ByteWriter w;
  w.put<uint32_t>(static_cast<uint32_t>(regions.size()));
  for (const auto& r : regions) {
    w.put<uint64_t>(r.id);
    w.put<uint64_t>(r.len);
    w.put<int32_t>(r.device);
    w.put<uint64_t>(r.offset);
    w.put_raw(r.handle.reserved, sizeof r.handle.reserved);
  }
  return w.take();
}

Result<std::vector<Exported>> decode(std::string_view blob) {
  util::ByteReader r(blob);
  uint32_t n = 0;
  PDKV_RETURN_IF_ERROR(r.get_count(&n, "cuda_ipc region count", 92, 1u << 16));
  std::vector<Exported> out(n);
  for (auto& e : out) {
    PDKV_RETURN_IF_ERROR(r.get(&e.id, "region id"));
    PDKV_RETURN_IF_ERROR(r.get(&e.len, "region len"));
    PDKV_RETURN_IF_ERROR(r.get(&e.device, "region device"));
    PDKV_RETURN_IF_ERROR(r.get(&e.offset, "region offset"));
    PDKV_RETURN_IF_ERROR(r.get(&e.handle, "ipc handle"));
  }
  return out;
}

// Instance ids of this process's agents using cuda_ipc. CUDA refuses to open an IPC
// handle in the process that created it, so such a peer is out of cuda_ipc's reach.
// (Comparing pids would not do: containers share a boot id but not a pid namespace.)
std::mutex g_local_mu;
std::set<uint64_t> g_local_agents;

bool in_this_process(uint64_t instance_id) {
  std::lock_guard<std::mutex> lk(g_local_mu);
  return g_local_agents.count(instance_id) != 0;
}

class CudaIpcTransport final : public Transport {
 public:
  explicit CudaIpcTransport(const AgentConfig&) {}
  ~CudaIpcTransport() override { shutdown(); }

  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.cross_host = false;
    c.notify = false;  // relayed through tcp/shm
    c.local_mem_kinds = mem_kind_bit(MemKind::kCuda) | mem_kind_bit(MemKind::kHost);
    c.remote_mem_kinds = mem_kind_bit(MemKind::kCuda);
    return c;
  }
  Status start(AgentHooks* hooks) override {
    hooks_ = hooks;
    PDKV_ASSIGN_OR_RETURN(drv_, CudaDriver::get());
    th_ = std::thread([this] { complete_loop(); });
    std::lock_guard<std::mutex> lk(g_local_mu);
    g_local_agents.insert(hooks_->instance_id());
    return Status::Ok();
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      stop_ = true;
      cv_.notify_all();
    }
    if (hooks_) {
      std::lock_guard<std::mutex> lk(g_local_mu);
      g_local_agents.erase(hooks_->instance_id());
    }
    if (th_.joinable()) th_.join();
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [dev, s] : streams_) drv_->cuStreamDestroy(s);
    streams_.clear();
    opened_.clear();
  }
  std::vector<Endpoint> endpoints() const override { return {Endpoint{"cuda_ipc", hooks_->host_id()}}; }
  std::string metadata_extra() const override;
  bool can_reach(const AgentMetadata& peer) const override {
    if (peer.host_id != hooks_->host_id() || in_this_process(peer.instance_id)) return false;
    for (const auto& [n, b] : peer.extras)
      if (n == "cuda_ipc") return true;
    return false;
  }
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override {
    hooks_->relay_notification(peer, xfer, std::move(notif), this);
  }
  void drop_peer(const std::string& name) override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = opened_.begin(); it != opened_.end();)
      it = it->first.first == name ? opened_.erase(it) : std::next(it);
  }

 private:
  Result<CUstream> stream_for(int device);
  // The batched-copy kernel for `device`, or nullptr when it was not built.
  Result<cuda::CUfunction> kernel_for(int device);
  Status upload_descriptors(CudaPrepared& p);
  void complete_loop();

  AgentHooks* hooks_ = nullptr;
  const CudaDriver* drv_ = nullptr;
  std::thread th_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Pending> pending_;
  std::map<int, CUstream> streams_;
  std::map<int, cuda::CUfunction> kernels_;
  // (peer name, instance<<0 ^ region id) -> opened mapping
  std::map<std::pair<std::string, std::pair<uint64_t, uint64_t>>, std::shared_ptr<Opened>> opened_;
  mutable std::map<uint64_t, Exported> exported_cache_;
};

std::string CudaIpcTransport::metadata_extra() const {
  std::vector<Exported> out;
  std::lock_guard<std::mutex> lk(mu_);
  for (const RegionDesc& r : hooks_->region_table().list()) {
    if (r.kind != MemKind::kCuda || !r.remote_access) continue;
    auto it = exported_cache_.find(r.id);
    if (it == exported_cache_.end()) {
      Exported e;
      e.id = r.id;
      e.len = r.len;
      e.device = r.device;
      CUdeviceptr base = 0;
      size_t size = 0;
      if (!drv_->use_device(r.device).ok() || drv_->cuMemGetAddressRange(&base, &size, r.addr) != cuda::kSuccess ||
          drv_->cuIpcGetMemHandle(&e.handle, base) != cuda::kSuccess) {
        PDKV_LOG_WARN("cuda_ipc: region %llu cannot be exported (not cudaMalloc'ed device memory?)",
                      static_cast<unsigned long long>(r.id));
        continue;
      }
      e.offset = r.addr - base;
      it = exported_cache_.emplace(r.id, e).first;
    }
    out.push_back(it->second);
  }
  // Forget regions that are gone.
  for (auto it = exported_cache_.begin(); it != exported_cache_.end();) {
    bool live = std::any_of(out.begin(), out.end(), [&](const Exported& e) { return e.id == it->first; });
    it = live ? std::next(it) : exported_cache_.erase(it);
  }
  return out.empty() ? std::string() : encode(out);
}

Result<CUstream> CudaIpcTransport::stream_for(int device) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  PDKV_RETURN_IF_ERROR(drv_->use_device(device));
  CUstream s = nullptr;
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuStreamCreate(&s, cuda::kStreamNonBlocking), "cuStreamCreate"));
  streams_[device] = s;
  return s;
}

Result<cuda::CUfunction> CudaIpcTransport::kernel_for(int device) {
  if (kPdkvBatchCopyFatbinSize == 0) return static_cast<cuda::CUfunction>(nullptr);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = kernels_.find(device);
  if (it != kernels_.end()) return it->second;
  PDKV_RETURN_IF_ERROR(drv_->use_device(device));
  cuda::CUmodule mod = nullptr;
  cuda::CUfunction fn = nullptr;
  CUresult r = drv_->cuModuleLoadData(&mod, kPdkvBatchCopyFatbin);
  if (r == cuda::kSuccess) r = drv_->cuModuleGetFunction(&fn, mod, "pdkv_batch_copy");
  if (r != cuda::kSuccess) {
    PDKV_LOG_WARN("cuda_ipc: batched-copy kernel unavailable on device %d (%s); copying extent by extent", device,
                  drv_->check(r, "cuModuleLoadData").message().c_str());
    fn = nullptr;
  }
  kernels_[device] = fn;
  return fn;
}

Status CudaIpcTransport::upload_descriptors(CudaPrepared& p) {
  std::vector<uint64_t> src, dst, len;
  for (const Op& o : p.ops)
    for (uint64_t off = 0; off < o.len; off += kKernelChunk) {
      src.push_back(o.src + off);
      dst.push_back(o.dst + off);
      len.push_back(std::min(kKernelChunk, o.len - off));
    }
  const size_t n = src.size();
  if (n > 0xFFFFFFFFull) return InvalidArgument("too many extents for one kernel launch");
  std::vector<uint64_t> all;
  all.reserve(3 * n);
  all.insert(all.end(), src.begin(), src.end());
  all.insert(all.end(), dst.begin(), dst.end());
  all.insert(all.end(), len.begin(), len.end());
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemAlloc(&p.d_desc, all.size() * 8), "cuMemAlloc"));
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(p.d_desc, all.data(), all.size() * 8), "cuMemcpyHtoD"));
  p.n_chunks = static_cast<unsigned>(n);
  return Status::Ok();
}

Result<std::shared_ptr<const PreparedOps>> CudaIpcTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                     std::vector<ResolvedExtent> extents) {
  std::string blob;
  for (const auto& [n, b] : peer->md.extras)
    if (n == "cuda_ipc") blob = b;
  PDKV_ASSIGN_OR_RETURN(std::vector<Exported> regions, decode(blob));
  auto p = std::make_shared<CudaPrepared>();
  p->peer = peer;
  // The local device: the first local CUDA region's, else device 0 (host-side extents).
  // The kernel can copy only when every local extent is device memory: on a GPU it
  // cannot dereference pageable host memory (an illegal address).
  p->device = -1;
  bool local_all_device = true;
  RegionDesc local{};
  for (const auto& e : extents) {
    if (local.len == 0 || e.local_addr < local.addr || e.local_addr - local.addr + e.len > local.len) {
      PDKV_ASSIGN_OR_RETURN(local, hooks_->region_table().find(e.local_addr, e.len));
    }
    if (local.kind != MemKind::kCuda) {
      local_all_device = false;
    } else if (p->device < 0) {
      p->device = local.device;
    }
  }
  if (p->device < 0) p->device = 0;
  PDKV_RETURN_IF_ERROR(drv_->use_device(p->device));
  std::unordered_map<uint64_t, std::shared_ptr<Opened>> by_id;
  for (const auto& e : extents) {
    auto it = by_id.find(e.remote_region);
    if (it == by_id.end()) {
      auto ex = std::find_if(regions.begin(), regions.end(), [&](const Exported& r) { return r.id == e.remote_region; });
      if (ex == regions.end())
        return NotSupported("peer '" + peer->md.name + "' region " + std::to_string(e.remote_region) +
                            " is not exported through cuda_ipc (is it device memory?)");
      const auto key = std::make_pair(peer->md.name, std::make_pair(peer->md.instance_id, e.remote_region));
      std::shared_ptr<Opened> o;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto oit = opened_.find(key);
        if (oit != opened_.end()) o = oit->second;
      }
      if (!o) {
        o = std::make_shared<Opened>();
        o->offset = ex->offset;
        o->len = ex->len;
        o->device = p->device;
        PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuIpcOpenMemHandle(&o->base, ex->handle, cuda::kIpcLazyEnablePeerAccess),
                                         "cuIpcOpenMemHandle").with_context("opening region " +
                                                                            std::to_string(ex->id) + " of '" +
                                                                            peer->md.name + "'"));
        std::lock_guard<std::mutex> lk(mu_);
        opened_[key] = o;
      }
      it = by_id.emplace(e.remote_region, o).first;
      p->opened.push_back(o);
    }
    const CUdeviceptr remote = it->second->base + it->second->offset + e.remote_offset;
    Op o2 = op == OpKind::kWrite ? Op{remote, e.local_addr, e.len} : Op{e.local_addr, remote, e.len};
    if (!p->ops.empty() && p->ops.back().dst + p->ops.back().len == o2.dst &&
        p->ops.back().src + p->ops.back().len == o2.src) {
      p->ops.back().len += o2.len;
    } else {
      p->ops.push_back(o2);
    }
    p->total += e.len;
  }
  // Many extents: one kernel launch moves them all (device memory only, see above).
  PDKV_ASSIGN_OR_RETURN(p->kernel, kernel_for(p->device));
  if (p->kernel && p->ops.size() > 1 && local_all_device) {
    PDKV_RETURN_IF_ERROR(upload_descriptors(*p));
  } else {
    p->kernel = nullptr;
  }
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

void CudaIpcTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                            std::string notif) {
  auto prep = std::static_pointer_cast<const CudaPrepared>(ops);
  xfer->set_parts(notif.empty() ? 1 : 2);
  auto fail = [&](const Status& st) {
    xfer->resolve_part(0, st);
    if (!notif.empty()) xfer->resolve_part(0, Cancelled("notification not sent: the copy failed"));
  };
  auto stream = stream_for(prep->device);
  if (!stream.ok()) return fail(stream.status());
  Status st = drv_->use_device(prep->device);
  if (st.ok() && prep->kernel) {
    CUdeviceptr src = prep->d_desc, dst = src + 8ull * prep->n_chunks, len = dst + 8ull * prep->n_chunks;
    unsigned n = prep->n_chunks;
    void* params[] = {&src, &dst, &len, &n};
    const unsigned grid = std::min<unsigned>(n, 8192);
    st = drv_->check(drv_->cuLaunchKernel(prep->kernel, grid, 1, 1, 256, 1, 1, 0, *stream, params, nullptr),
                     "cuLaunchKernel(pdkv_batch_copy)");
  } else {
    for (const Op& o : prep->ops) {
      if (!st.ok()) break;
      st = drv_->check(drv_->cuMemcpyAsync(o.dst, o.src, o.len, *stream), "cuMemcpyAsync");
    }
  }
  CUevent ev = nullptr;
  if (st.ok())
    st = drv_->check(drv_->cuEventCreate(&ev, cuda::kEventBlockingSync | cuda::kEventDisableTiming), "cuEventCreate");
  if (st.ok()) st = drv_->check(drv_->cuEventRecord(ev, *stream), "cuEventRecord");
  if (!st.ok()) {
    if (ev) drv_->cuEventDestroy(ev);
    return fail(st);
  }
  std::lock_guard<std::mutex> lk(mu_);
  pending_.push_back(Pending{ev, prep, xfer, std::move(notif)});
  cv_.notify_one();
}

void CudaIpcTransport::complete_loop() {
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;
      p = std::move(pending_.front());
      pending_.pop_front();
    }
    // Copies on one stream complete in order, so waiting FIFO is exact.
    Status st = drv_->check(drv_->cuEventSynchronize(p.event), "cuEventSynchronize");
    drv_->cuEventDestroy(p.event);
    p.xfer->resolve_part(st.ok() ? p.prep->total : 0, st);
    if (p.notif.empty()) continue;
    if (!st.ok()) {
      p.xfer->resolve_part(0, Cancelled("notification not sent: the copy failed"));
      continue;
    }
    hooks_->relay_notification(p.prep->peer, p.xfer, std::move(p.notif), this);
  }
}

bool registered = register_transport(TransportFactory{
    "cuda_ipc", "same-node GPU memory via CUDA IPC (NVLink/PCIe)",
    [] { return CudaDriver::get().status(); },
    [](const AgentConfig& cfg) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(std::make_unique<CudaIpcTransport>(cfg));
    }});

}  // namespace
}  // namespace pdkv::cuda_ipc
