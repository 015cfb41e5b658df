// The cuda_ipc transport: GPU pools on the same node (NVLink or PCIe), one copy.
//
// Each agent publishes, for every exported CUDA region, the CUDA IPC handle of the
// allocation holding it (cuMemGetAddressRange + cuIpcGetMemHandle, so tensors from
// torch's caching allocator work) and the region's offset inside it. A peer opens
// each handle once (cuIpcOpenMemHandle, lazy peer access) and a transfer is one
// launch of the strided-copy kernel on pdkv's own stream for all extents, strided
// runs as they are (TransportCaps::strided_extents; cuda/strided_copy.h: a TP split
// is a few runs, not 100k extents), or where the kernel does not load (or a local
// extent is pageable host memory) one cuMemcpyAsync per piece; a completion thread waits on an
// event (blocking sync, no spinning) and then resolves the transfer. Notifications
// travel through the agent's tcp/shm transport after the copy completed.
//
// The CUDA driver is loaded at run time (cuda/driver.h); without a GPU this
// transport is simply not viable and never selected. Viability is a probe that does
// not initialize CUDA; the driver is initialized on the first CUDA export or
// transfer, so creating an agent never calls cuInit (a process may still fork).
//
// Revocation and liveness: every agent listens on a Unix socket (its path is in the
// cuda_ipc metadata); an importer connects to the exporter and authenticates with
// the exporter's secret before opening its first handle. When the exporter
// deregisters a device region it sends kRevoke to every connected importer and
// waits for kRevokeAck: the importer refuses new posts touching the region, lets the
// copies in flight finish, closes its mapping, then acknowledges. If the control
// connection drops (the exporter died), transfers to that peer fail at once with
// PeerConnectionError instead of writing into orphaned memory.
//
// Faults (docs/faults.md): prepare() raises only the caller's errors. When the
// exporter cannot be dialed then (dead, frozen, restarted, refusing), prepare()
// returns a transfer whose mapping is deferred: each post() dials and maps again,
// within the control timeout and the transfer's deadline, and on failure fails just
// that transfer with the dial's error. Nothing is mapped before the dial succeeded.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "cuda/strided_copy.h"
#include "pdkv/spi/registry.h"
#include "transport/cuda_ipc/cuda_ipc_ctl.h"
#include "transport/shm/ctl_guard.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

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

struct CtlConn;

struct Opened {
  CUdeviceptr base = 0;  // mapped allocation base in this process
  uint64_t offset = 0;
  uint64_t len = 0;
  int device = 0;  // whose context mapped it
  uint64_t region = 0;
  std::string peer;
  std::weak_ptr<CtlConn> ctl;      // control connection to the exporter
  std::atomic<int> inflight{0};    // posted copies not yet completed
  std::atomic<bool> revoked{false};
  std::atomic<bool> gone{false};   // the exporter's control connection dropped
  std::atomic<bool> released{false};
  std::mutex close_mu;
  // The last holder may be any thread (drop_peer from a progress thread, a Python
  // thread dropping a prepared transfer): closing needs the context current there.
  void close() {
    std::lock_guard<std::mutex> lk(close_mu);
    if (!base) return;
    auto d = CudaDriver::get();
    if (d.ok() && (*d)->use_device(device).ok()) (*d)->cuIpcCloseMemHandle(base);
    base = 0;
  }
  ~Opened() { close(); }
};

// Control frames: cuda_ipc_ctl.h.

struct CtlConn {
  CtlConn(util::ScopedFd f, bool out) : fd(std::move(f)), outbound(out) {}
  util::ScopedFd fd;
  const bool outbound;          // we are the importer
  std::string peer;             // the other agent's name (once known)
  uint64_t peer_instance = 0;   // outbound: the exporter's instance
  Clock::time_point hs_deadline = Clock::time_point::max();
  Clock::time_point frame_deadline = Clock::time_point::max();  // a started frame must end by then
  Clock::time_point reject_at = Clock::time_point::max();       // a refusal held back (back-off)
  Status reject;
  std::mutex wmu;               // serializes writes
  // Guarded by the transport's mu_.
  bool authed = false;
  bool dead = false;
  std::set<uint64_t> acks;      // inbound: regions the importer acknowledged
  // Inbound, between our challenge and the importer's proof (control thread only).
  std::unique_ptr<auth::TargetHandshake> hs;
  // Read state (control thread only).
  CtlHdr hdr{};
  size_t hdr_got = 0;
  std::string aux;
  size_t aux_got = 0;
};

Status send_ctl(CtlConn& c, Ctl type, uint64_t id, std::string_view aux = {}, uint32_t status = 0) {
  CtlHdr h{kCtlMagic, static_cast<uint16_t>(type), 0, id, static_cast<uint32_t>(aux.size()), status};
  std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
  frame.append(aux);
  std::lock_guard<std::mutex> lk(c.wmu);
  return util::send_all(c.fd.get(), frame.data(), frame.size(), util::deadline_after(kCtlTimeoutS));
}

// Connects to an exporter's control socket by `deadline` (util::connect_unix does not
// block on a frozen exporter's full backlog).
Result<util::ScopedFd> dial_ctl(const std::string& path, Clock::time_point deadline) {
  // The path comes from the peer's metadata: a bad one is the peer's protocol error.
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path))
    return ProtocolError("bad control socket path '" + path + "'");
  return util::connect_unix(path, deadline);
}

struct Op {
  CUdeviceptr dst;
  CUdeviceptr src;
  uint64_t len;
};

// The peer's regions a prepared transfer touches, mapped, and the copies between them.
struct Mapped {
  ~Mapped() {
    if (d_desc) {
      auto d = CudaDriver::get();
      if (d.ok() && (*d)->use_device(device).ok()) (*d)->cuMemFree(d_desc);
    }
  }
  std::vector<std::shared_ptr<Opened>> opened;  // keeps the mappings alive
  std::vector<Op> ops;
  int device = 0;
  uint64_t total = 0;
  // Kernel path: src[n], dst[n], len[n] (u64) uploaded once to device memory.
  CUdeviceptr d_desc = 0;
  unsigned n_chunks = 0;
  cuda::CUfunction kernel = nullptr;
  // Strided path: the cut runs (cuda::StridedRun[n_runs]) uploaded to d_desc instead.
  cuda::CUfunction strided = nullptr;
  size_t n_runs = 0;
};

// A prepared transfer: what the caller asked for, checked, plus its mapping. The
// mapping is made by prepare(); when the exporter could not be reached then (dead,
// frozen, restarted: a fault of the peer, not of the caller, docs/faults.md), the
// request is kept and every post() tries to map it again, failing only that transfer.
struct CudaPrepared final : PreparedOps {
  std::shared_ptr<const Peer> peer;
  OpKind op = OpKind::kWrite;
  std::vector<Exported> regions;  // the peer's cuda_ipc metadata
  std::string ctl_path;           // the exporter's control socket
  int device = 0;                 // the local device the copies run on
  bool local_all_device = true;   // the kernel may copy (no pageable host extent)
  mutable std::mutex setup_mu;    // one post at a time maps a deferred transfer
  // Guarded by setup_mu. While `mapped` is null, `extents` holds the request.
  mutable std::shared_ptr<const Mapped> mapped;
  mutable std::vector<ResolvedExtent> extents;
};

// Faults of the exporter itself, as met while dialing its control socket: prepare()
// leaves the mapping to post() on these. Anything else is the caller's or local.
bool is_peer_fault(const Status& st) {
  switch (st.code()) {
    case StatusCode::kConnectionError:
    case StatusCode::kTimeout:
    case StatusCode::kAuthFailed:
    case StatusCode::kStalePeer:
    case StatusCode::kProtocolError:
      return true;
    default:
      return false;
  }
}

struct Pending {
  CUevent event = nullptr;
  std::shared_ptr<const Peer> peer;
  std::shared_ptr<const Mapped> mapped;
  std::shared_ptr<Transfer> xfer;
  std::string notif;
  Status err;  // an enqueue failed: report it once the copies queued before it are done
};

// The cuda_ipc metadata: the exported regions and the control socket's path.
std::string encode(const std::vector<Exported>& regions, const std::string& ctl_path) {
  util::ByteWriter w;
  w.put<uint32_t>(static_cast<uint32_t>(regions.size()));
  for (const auto& r : regions) {
    w.put<uint64_t>(r.id);
    w.put<uint64_t>(r.len);
    w.put<int32_t>(r.device);
    w.put<uint64_t>(r.offset);
    w.put_raw(r.handle.reserved, sizeof r.handle.reserved);
  }
  w.put_str(ctl_path);
  return w.take();
}

Result<std::vector<Exported>> decode(std::string_view blob, std::string* ctl_path) {
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
  PDKV_RETURN_IF_ERROR(r.get_str(ctl_path, "cuda_ipc control socket", 4096));
  if (ctl_path->empty() || ctl_path->size() >= sizeof(sockaddr_un::sun_path))
    return ProtocolError("cuda_ipc control socket path is empty or longer than a Unix socket path may be");
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
  CudaIpcTransport() = default;
  ~CudaIpcTransport() override { shutdown(); }

  std::string_view name() const override { return "cuda_ipc"; }
  TransportCaps caps() const override {
    TransportCaps c;
    c.cross_host = false;
    c.notify = false;  // relayed through tcp/shm
    c.local_mem_kinds = mem_kind_bit(MemKind::kCuda) | mem_kind_bit(MemKind::kHost);
    c.remote_mem_kinds = mem_kind_bit(MemKind::kCuda);
    c.strided_extents = true;  // one strided-kernel launch (pieces one by one without it)
    return c;
  }
  Status start(AgentHooks* hooks) override {
    hooks_ = hooks;
    // The driver is initialized on first use (a CUDA region exported or transferred),
    // not here: an agent in a process that later forks must not have called cuInit.
    PDKV_ASSIGN_OR_RETURN(listen_fd_,
                          util::listen_unix(hooks->agent_name(), hooks->instance_id(), ".cuda.sock", &ctl_path_));
    evfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (evfd_ < 0) return Internal("eventfd: " + util::errno_str(errno));
    th_ = std::thread([this] { complete_loop(); });
    ctl_th_ = std::thread([this] { ctl_loop(); });
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
      ctl_cv_.notify_all();
    }
    if (hooks_) {
      std::lock_guard<std::mutex> lk(g_local_mu);
      g_local_agents.erase(hooks_->instance_id());
    }
    wake_ctl();
    if (ctl_th_.joinable()) ctl_th_.join();
    if (th_.joinable()) th_.join();
    if (evfd_ >= 0) ::close(evfd_);
    if (!ctl_path_.empty()) ::unlink(ctl_path_.c_str());
    std::lock_guard<std::mutex> lk(mu_);
    ctl_.clear();  // peers see the control connections close
    for (auto& [dev, s] : streams_) drv_->cuStreamDestroy(s);  // non-empty only once drv_ is set
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
    // A prepared transfer may still hold a mapping of the dropped peer: mark it gone
    // (as ctl_closed does) so that posting it fails instead of writing through it.
    std::vector<std::shared_ptr<Opened>> dropped;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = opened_.begin(); it != opened_.end();) {
        if (it->first.first == name) {
          dropped.push_back(it->second);
          it = opened_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& c : ctl_)
        if (c->outbound && c->peer == name) ::shutdown(c->fd.get(), SHUT_RDWR);  // the control thread reaps it
    }
    for (auto& o : dropped) o->gone.store(true);
    wake_ctl();
  }
  void region_removed(const RegionDesc& region) override;

 private:
  // Control channel (see the file comment).
  void ctl_loop();
  void wake_ctl() {
    uint64_t one = 1;
    if (evfd_ >= 0 && ::write(evfd_, &one, sizeof one) < 0) {
    }
  }
  // The authenticated control connection to `peer` (dialed on first use; the
  // handshake ends by `deadline`).
  Result<std::shared_ptr<CtlConn>> ctl_to(const Peer& peer, const std::string& path, Clock::time_point deadline);
  // Maps the peer's regions `p.extents` touch, the control connection first (the
  // exporter must be able to revoke anything mapped), and builds the copies.
  // Call with p.setup_mu held.
  Result<std::shared_ptr<const Mapped>> map_extents(const CudaPrepared& p, Clock::time_point deadline);
  // `p`'s mapping, made now if prepare() had to defer it (bounded by the control
  // timeout and the transfer's deadline).
  Result<std::shared_ptr<const Mapped>> mapping_for(const CudaPrepared& p, const Transfer& xfer);
  void on_ctl_readable(const std::shared_ptr<CtlConn>& c);
  // Handles one complete frame; false when the connection must close.
  bool on_ctl_frame(const std::shared_ptr<CtlConn>& c);
  void ctl_closed(const std::shared_ptr<CtlConn>& c);
  void on_revoke(const std::shared_ptr<CtlConn>& c, uint64_t region);
  // Closes a revoked mapping and acknowledges once no copy uses it any more.
  void maybe_release(const std::shared_ptr<Opened>& o);

  Result<CUstream> stream_for(int device);
  // The batched-copy kernel for `device`, or nullptr when it was not built.
  Result<cuda::CUfunction> kernel_for(int device);
  Status upload_descriptors(Mapped& m);
  // Uploads the strided runs to device memory (the kernel's table) and finishes `m`.
  Result<std::shared_ptr<const Mapped>> upload_runs(std::shared_ptr<Mapped> m, const std::vector<cuda::StridedRun>& runs);
  void complete_loop();

  AgentHooks* hooks_ = nullptr;
  // The CUDA driver, loaded on first use (driver()). Set once under drv_mu_; read by
  // post() and the completion thread only for work a successful prepare() created.
  Result<const CudaDriver*> driver() const;
  mutable std::mutex drv_mu_;
  mutable const CudaDriver* drv_ = nullptr;
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
  // Control channel; ctl_ and revoked_ guarded by mu_.
  std::string ctl_path_;
  util::ScopedFd listen_fd_;
  int evfd_ = -1;
  std::thread ctl_th_;
  std::condition_variable ctl_cv_;
  std::vector<std::shared_ptr<CtlConn>> ctl_;
  std::set<std::pair<uint64_t, uint64_t>> revoked_;  // (exporter instance, region) we were told to drop
  util::HandshakeThrottle throttle_;
  util::LogLimiter refusal_log_;
  void log_refusal(const Status& st);
  void check_ctl_deadlines(const std::vector<std::shared_ptr<CtlConn>>& conns);
};

void CudaIpcTransport::log_refusal(const Status& st) {
  uint64_t suppressed = 0;
  if (!refusal_log_.allow(Clock::now(), &suppressed)) return;
  if (suppressed)
    PDKV_LOG_WARN("cuda_ipc: refusing a control connection: %s (and %llu similar in the last second)",
                  st.to_string().c_str(), static_cast<unsigned long long>(suppressed));
  else
    PDKV_LOG_WARN("cuda_ipc: refusing a control connection: %s", st.to_string().c_str());
}

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
      auto drv = driver();
      if (!drv.ok()) {
        PDKV_LOG_WARN("cuda_ipc: region %llu cannot be exported: %s", static_cast<unsigned long long>(r.id),
                      drv.status().to_string().c_str());
        continue;
      }
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
  return out.empty() ? std::string() : encode(out, ctl_path_);
}

Result<const CudaDriver*> CudaIpcTransport::driver() const {
  std::lock_guard<std::mutex> lk(drv_mu_);
  if (!drv_) {
    PDKV_ASSIGN_OR_RETURN(drv_, CudaDriver::get());
  }
  return drv_;
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

Status CudaIpcTransport::upload_descriptors(Mapped& m) {
  std::vector<uint64_t> src, dst, len;
  for (const Op& o : m.ops)
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
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemAlloc(&m.d_desc, all.size() * 8), "cuMemAlloc"));
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(m.d_desc, all.data(), all.size() * 8), "cuMemcpyHtoD"));
  m.n_chunks = static_cast<unsigned>(n);
  return Status::Ok();
}

Result<std::shared_ptr<const Mapped>> CudaIpcTransport::upload_runs(std::shared_ptr<Mapped> m,
                                                                     const std::vector<cuda::StridedRun>& runs) {
  m->n_runs = runs.size();
  if (!runs.empty()) {
    const size_t bytes = runs.size() * sizeof(cuda::StridedRun);
    PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemAlloc(&m->d_desc, bytes), "cuMemAlloc"));
    PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(m->d_desc, runs.data(), bytes), "cuMemcpyHtoD"));
  }
  return std::shared_ptr<const Mapped>(std::move(m));
}

Result<std::shared_ptr<const PreparedOps>> CudaIpcTransport::prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                                     std::vector<ResolvedExtent> extents) {
  std::string blob;
  for (const auto& [n, b] : peer->md.extras)
    if (n == "cuda_ipc") blob = b;
  auto p = std::make_shared<CudaPrepared>();
  PDKV_ASSIGN_OR_RETURN(p->regions, decode(blob, &p->ctl_path));
  PDKV_RETURN_IF_ERROR(driver().status());
  p->peer = peer;
  p->op = op;
  // The local device: the first local CUDA region's, else device 0 (host-side extents).
  // The kernel can copy only when every local extent is device memory: on a GPU it
  // cannot dereference pageable host memory (an illegal address).
  p->device = -1;
  for (const auto& e : extents) {
    if (e.local_kind != MemKind::kCuda) {
      p->local_all_device = false;
    } else if (p->device < 0) {
      p->device = e.local_device;
    }
  }
  if (p->device < 0) p->device = 0;
  PDKV_RETURN_IF_ERROR(drv_->use_device(p->device));
  // Caller errors first: they must not depend on whether the peer answers.
  for (const auto& e : extents) {
    if (std::none_of(p->regions.begin(), p->regions.end(), [&](const Exported& r) { return r.id == e.remote_region; }))
      return NotSupported("peer '" + peer->md.name + "' region " + std::to_string(e.remote_region) +
                          " is not exported through cuda_ipc (is it device memory?)");
  }
  p->extents = std::move(extents);
  std::lock_guard<std::mutex> lk(p->setup_mu);
  auto mapped = map_extents(*p, util::deadline_after(kCtlTimeoutS));
  if (mapped.ok()) {
    p->mapped = std::move(mapped).value();
    p->extents = {};
  } else if (is_peer_fault(mapped.status())) {
    PDKV_LOG_DEBUG("cuda_ipc: mapping for '%s' deferred to post(): %s", peer->md.name.c_str(),
                   mapped.status().to_string().c_str());
  } else {
    return mapped.status();
  }
  return std::shared_ptr<const PreparedOps>(std::move(p));
}

Result<std::shared_ptr<const Mapped>> CudaIpcTransport::map_extents(const CudaPrepared& p, Clock::time_point deadline) {
  const Peer& peer = *p.peer;
  PDKV_RETURN_IF_ERROR(drv_->use_device(p.device));
  // Before mapping anything of the peer: the control connection that lets it revoke.
  PDKV_ASSIGN_OR_RETURN(std::shared_ptr<CtlConn> ctl, ctl_to(peer, p.ctl_path, deadline));
  auto m = std::make_shared<Mapped>();
  m->device = p.device;
  // The strided kernel takes the runs as they are when there are runs, every local
  // extent is device memory and it loads; else each piece is an Op (the batched-copy
  // kernel or one cuMemcpyAsync each, as before strided runs: plain extents only, a
  // homogeneous transfer, go that way too).
  cuda::CUfunction strided_fn = nullptr;
  if (p.local_all_device &&
      std::any_of(p.extents.begin(), p.extents.end(), [](const ResolvedExtent& e) { return e.count > 1; })) {
    auto f = cuda::StridedKernel::get().function(*drv_, p.device);
    if (f.ok()) strided_fn = *f;
  }
  const bool use_strided = strided_fn != nullptr;
  std::vector<cuda::StridedRun> runs;
  if (use_strided) runs.reserve(p.extents.size());
  Op plain{0, 0, 0};  // plain extents are merged while they touch, then cut into runs
  auto flush_plain = [&] {
    if (plain.len) cuda::append_run(runs, plain.src, plain.dst, plain.len, 1, 0, 0);
    plain.len = 0;
  };
  std::unordered_map<uint64_t, std::shared_ptr<Opened>> by_id;
  for (const auto& e : p.extents) {
    auto it = by_id.find(e.remote_region);
    if (it == by_id.end()) {
      auto ex = std::find_if(p.regions.begin(), p.regions.end(), [&](const Exported& r) { return r.id == e.remote_region; });
      if (ex == p.regions.end())  // prepare() checked
        return Internal("peer '" + peer.md.name + "' region " + std::to_string(e.remote_region) + " vanished");
      const auto key = std::make_pair(peer.md.name, std::make_pair(peer.md.instance_id, e.remote_region));
      std::shared_ptr<Opened> o;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (revoked_.count({peer.md.instance_id, e.remote_region}))
          return NotFound("peer '" + peer.md.name + "' deregistered its region " + std::to_string(e.remote_region) +
                          "; fetch its metadata again (connect() or add_peer())");
        auto oit = opened_.find(key);
        if (oit != opened_.end()) o = oit->second;
      }
      if (!o) {
        o = std::make_shared<Opened>();
        o->offset = ex->offset;
        o->len = ex->len;
        o->device = p.device;
        o->region = e.remote_region;
        o->peer = peer.md.name;
        o->ctl = ctl;
        PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuIpcOpenMemHandle(&o->base, ex->handle, cuda::kIpcLazyEnablePeerAccess),
                                         "cuIpcOpenMemHandle").with_context("opening region " +
                                                                            std::to_string(ex->id) + " of '" +
                                                                            peer.md.name + "'"));
        std::lock_guard<std::mutex> lk(mu_);
        if (revoked_.count({peer.md.instance_id, e.remote_region}))
          return NotFound("peer '" + peer.md.name + "' deregistered its region " + std::to_string(e.remote_region) +
                          " while it was being mapped");
        if (ctl->dead)
          return ConnectionError("peer '" + peer.md.name + "' went away (its cuda_ipc control connection closed) " +
                                 "while its region " + std::to_string(e.remote_region) + " was being mapped");
        opened_[key] = o;
      }
      it = by_id.emplace(e.remote_region, o).first;
      m->opened.push_back(o);
    }
    // Every run is checked whole (first to last piece) against the region the peer
    // exported here, whatever the agent checked against its metadata.
    const Opened& reg = *it->second;
    uint64_t span = 0;
    if (e.count == 0 || e.count2 != 1 || __builtin_mul_overflow(e.count - 1, e.remote_stride, &span) ||
        __builtin_add_overflow(span, e.len, &span) || e.remote_offset > reg.len || span > reg.len - e.remote_offset)
      return OutOfRange("peer '" + peer.md.name + "' region " + std::to_string(e.remote_region) + ": bytes [" +
                        std::to_string(e.remote_offset) + ", +" + std::to_string(e.len) + " x " +
                        std::to_string(e.count) + " pieces, stride " + std::to_string(e.remote_stride) +
                        ") fall outside the " + std::to_string(reg.len) + " bytes it exports through cuda_ipc");
    const CUdeviceptr remote = reg.base + reg.offset + e.remote_offset;
    if (use_strided) {
      const bool w = p.op == OpKind::kWrite;
      const uint64_t src = w ? e.local_addr : remote, dst = w ? remote : e.local_addr;
      if (e.count == 1 && plain.len > 0 && plain.src + plain.len == src && plain.dst + plain.len == dst) {
        plain.len += e.len;  // touching plain extents: one piece
      } else {
        flush_plain();
        if (e.count == 1)
          plain = Op{dst, src, e.len};
        else
          cuda::append_run(runs, src, dst, e.len, e.count, w ? e.local_stride : e.remote_stride,
                           w ? e.remote_stride : e.local_stride);
      }
    } else {
      for (uint64_t i = 0; i < e.count; ++i) {
        const CUdeviceptr r = remote + i * e.remote_stride, l = e.local_addr + i * e.local_stride;
        Op o2 = p.op == OpKind::kWrite ? Op{r, l, e.len} : Op{l, r, e.len};
        if (!m->ops.empty() && m->ops.back().dst + m->ops.back().len == o2.dst &&
            m->ops.back().src + m->ops.back().len == o2.src) {
          m->ops.back().len += o2.len;
        } else {
          m->ops.push_back(o2);
        }
      }
    }
    m->total += e.len * e.count;
  }
  if (use_strided) {  // one launch of the strided kernel moves every run
    flush_plain();
    m->strided = strided_fn;
    return upload_runs(std::move(m), runs);
  }
  // Many extents: one kernel launch moves them all (device memory only, see prepare()).
  PDKV_ASSIGN_OR_RETURN(m->kernel, kernel_for(p.device));
  if (m->kernel && m->ops.size() > 1 && p.local_all_device) {
    PDKV_RETURN_IF_ERROR(upload_descriptors(*m));
  } else {
    m->kernel = nullptr;
  }
  return std::shared_ptr<const Mapped>(std::move(m));
}

Result<std::shared_ptr<const Mapped>> CudaIpcTransport::mapping_for(const CudaPrepared& p, const Transfer& xfer) {
  std::lock_guard<std::mutex> lk(p.setup_mu);
  if (p.mapped) return p.mapped;
  PDKV_ASSIGN_OR_RETURN(p.mapped, map_extents(p, std::min(util::deadline_after(kCtlTimeoutS), xfer.deadline())));
  p.extents = {};
  return p.mapped;
}

void CudaIpcTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                            std::string notif) {
  const auto& prep = static_cast<const CudaPrepared&>(*ops);
  spi::TransferControl(xfer).set_parts(notif.empty() ? 1 : 2);
  auto fail = [&](const Status& st) {
    spi::TransferControl(xfer).resolve_part(0, st);
    if (!notif.empty()) spi::TransferControl(xfer).resolve_part(0, Cancelled("notification not sent: the copy failed"));
  };
  auto mapped = mapping_for(prep, *xfer);
  if (!mapped.ok()) return fail(mapped.status());
  const std::shared_ptr<const Mapped> m = std::move(mapped).value();
  // Claim the mappings first, then check they are still valid: a revocation either
  // sees the claim (and waits for the copies) or this post sees the revocation.
  for (const auto& o : m->opened) o->inflight.fetch_add(1);
  auto unclaim = [&] {
    for (const auto& o : m->opened)
      if (o->inflight.fetch_sub(1) == 1) maybe_release(o);
  };
  for (const auto& o : m->opened) {
    if (o->revoked || o->gone) {
      const bool gone = o->gone;
      const std::string who = o->peer;
      const uint64_t region = o->region;
      unclaim();
      return fail(gone ? ConnectionError("peer '" + who + "' is gone (its cuda_ipc control connection closed)")
                       : NotFound("peer '" + who + "' deregistered its region " + std::to_string(region) +
                                  "; fetch its metadata again (connect() or add_peer())"));
    }
  }
  auto stream = stream_for(m->device);
  if (!stream.ok()) {
    unclaim();
    return fail(stream.status());
  }
  Status st = drv_->use_device(m->device);
  if (st.ok() && m->strided) {
    st = cuda::StridedKernel::launch(*drv_, m->strided, *stream, m->d_desc, m->n_runs);
  } else if (st.ok() && m->kernel) {
    CUdeviceptr src = m->d_desc, dst = src + 8ull * m->n_chunks, len = dst + 8ull * m->n_chunks;
    unsigned n = m->n_chunks;
    void* params[] = {&src, &dst, &len, &n};
    const unsigned grid = std::min<unsigned>(n, 8192);
    st = drv_->check(drv_->cuLaunchKernel(m->kernel, grid, 1, 1, 256, 1, 1, 0, *stream, params, nullptr),
                     "cuLaunchKernel(pdkv_batch_copy)");
  } else {
    for (const Op& o : m->ops) {
      if (!st.ok()) break;
      st = drv_->check(drv_->cuMemcpyAsync(o.dst, o.src, o.len, *stream), "cuMemcpyAsync");
    }
  }
  // Even when an enqueue failed, copies queued before it may still run: record an
  // event and let the completion thread report the failure once they are done, so
  // nothing (pins, mappings) is released under a running copy.
  CUevent ev = nullptr;
  Status ev_st = drv_->check(drv_->cuEventCreate(&ev, cuda::kEventBlockingSync | cuda::kEventDisableTiming),
                             "cuEventCreate");
  if (ev_st.ok()) ev_st = drv_->check(drv_->cuEventRecord(ev, *stream), "cuEventRecord");
  if (!ev_st.ok()) {
    // Cannot track the queued copies: wait for the whole stream instead.
    if (ev) drv_->cuEventDestroy(ev);
    ev = nullptr;
    drv_->cuStreamSynchronize(*stream);
    unclaim();
    return fail(st.ok() ? ev_st : st);
  }
  std::lock_guard<std::mutex> lk(mu_);
  pending_.push_back(Pending{ev, prep.peer, m, xfer, std::move(notif), st});
  cv_.notify_one();
}

void CudaIpcTransport::complete_loop() {
  util::name_this_thread("pdkv-ipc-done");
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
    if (st.ok()) st = p.err;
    for (const auto& o : p.mapped->opened)
      if (o->inflight.fetch_sub(1) == 1) maybe_release(o);
    spi::TransferControl(p.xfer).resolve_part(st.ok() ? p.mapped->total : 0, st);
    if (p.notif.empty()) continue;
    if (!st.ok()) {
      spi::TransferControl(p.xfer).resolve_part(0, Cancelled("notification not sent: the copy failed"));
      continue;
    }
    hooks_->relay_notification(p.peer, p.xfer, std::move(p.notif), this);
  }
}

// ---------------------------------------------------------------- control channel

void CudaIpcTransport::region_removed(const RegionDesc& region) {
  if (region.kind != MemKind::kCuda || !region.remote_access) return;
  std::vector<std::shared_ptr<CtlConn>> importers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    exported_cache_.erase(region.id);
    for (auto& c : ctl_)
      if (!c->outbound && c->authed && !c->dead) {
        c->acks.erase(region.id);
        importers.push_back(c);
      }
  }
  std::vector<std::shared_ptr<CtlConn>> told;
  for (auto& c : importers)
    if (send_ctl(*c, Ctl::kRevoke, region.id).ok()) told.push_back(c);
  const auto deadline = util::deadline_after(kRevokeTimeoutS);
  std::unique_lock<std::mutex> lk(mu_);
  for (auto& c : told) {
    if (!ctl_cv_.wait_until(lk, deadline, [&] { return stop_ || c->dead || c->acks.count(region.id); })) {
      PDKV_LOG_WARN("cuda_ipc: peer '%s' did not release region %llu within %.0f s; deregistering anyway",
                    c->peer.c_str(), static_cast<unsigned long long>(region.id), kRevokeTimeoutS);
    }
    c->acks.erase(region.id);
  }
}

void CudaIpcTransport::maybe_release(const std::shared_ptr<Opened>& o) {
  if (!o->revoked.load() || o->inflight.load() != 0 || o->released.exchange(true)) return;
  o->close();
  if (auto c = o->ctl.lock()) {
    Status st = send_ctl(*c, Ctl::kRevokeAck, o->region);
    if (!st.ok()) PDKV_LOG_DEBUG("cuda_ipc: revoke ack to '%s' failed: %s", o->peer.c_str(), st.to_string().c_str());
  }
}

void CudaIpcTransport::on_revoke(const std::shared_ptr<CtlConn>& c, uint64_t region) {
  std::shared_ptr<Opened> o;
  {
    std::lock_guard<std::mutex> lk(mu_);
    revoked_.insert({c->peer_instance, region});
    auto it = opened_.find({c->peer, {c->peer_instance, region}});
    if (it != opened_.end()) {
      o = it->second;
      opened_.erase(it);
    }
  }
  if (!o) {
    (void)send_ctl(*c, Ctl::kRevokeAck, region);  // never mapped here
    return;
  }
  o->revoked.store(true);
  maybe_release(o);  // at once, or when the last copy in flight completes
}

Result<std::shared_ptr<CtlConn>> CudaIpcTransport::ctl_to(const Peer& peer, const std::string& path,
                                                          Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& c : ctl_)
      if (c->outbound && c->peer == peer.md.name && c->peer_instance == peer.md.instance_id && !c->dead) return c;
  }
  auto fd = dial_ctl(path, deadline);
  if (!fd.ok())
    return Status(fd.status().code(), "cuda_ipc control connection to peer '" + peer.md.name + "': " +
                                          fd.status().message());
  auto c = std::make_shared<CtlConn>(std::move(fd).value(), true);
  c->peer = peer.md.name;
  c->peer_instance = peer.md.instance_id;
  const std::string where = "peer '" + peer.md.name + "' (cuda_ipc control " + path + ")";
  PDKV_ASSIGN_OR_RETURN(auth::InitiatorHandshake hs,
                        auth::InitiatorHandshake::begin("cuda_ipc", kCtlVersion, hooks_->agent_name()));
  PDKV_RETURN_IF_ERROR(
      send_ctl(*c, Ctl::kHello, 0,
               encode_hello(Hello{kCtlVersion, peer.md.instance_id, hooks_->agent_name(), hs.nonce(), hs.pub()}))
          .with_context("hello to " + where));
  // The exporter's next handshake frame, checked before its aux is read.
  auto next = [&](Ctl want, std::string* aux) -> Status {
    CtlHdr r{};
    PDKV_RETURN_IF_ERROR(util::recv_all(c->fd.get(), &r, sizeof r, deadline).with_context("handshake with " + where));
    PDKV_RETURN_IF_ERROR(check_ctl_header(r, CtlSide::kImporterHello).with_context("handshake with " + where));
    aux->assign(r.aux_len, '\0');  // bounded by check_ctl_header
    PDKV_RETURN_IF_ERROR(
        util::recv_all(c->fd.get(), aux->data(), aux->size(), deadline).with_context("handshake with " + where));
    if (r.type == static_cast<uint16_t>(Ctl::kError))
      return Status(status_code_from_wire(r.status), where + " refused the connection: " + *aux);
    if (r.type != static_cast<uint16_t>(want)) return ProtocolError(where + " answered the handshake out of order");
    return Status::Ok();
  };
  std::string aux;
  PDKV_RETURN_IF_ERROR(next(Ctl::kChallenge, &aux));
  PDKV_ASSIGN_OR_RETURN(Challenge ch, parse_challenge(aux));
  if (ch.instance != peer.md.instance_id || ch.name != peer.md.name)
    return StalePeer(where + " is agent '" + ch.name + "' instance " + std::to_string(ch.instance) +
                     ", not the one in its metadata (restarted?)");
  auth::Mac proof{};
  PDKV_RETURN_IF_ERROR(
      hs.answer(ch.name, ch.instance, ch.nonce, ch.pub, auth::derive_key(peer.secret), &proof).with_context(where));
  PDKV_RETURN_IF_ERROR(send_ctl(*c, Ctl::kProof, 0, encode_mac(proof)).with_context("proof to " + where));
  PDKV_RETURN_IF_ERROR(next(Ctl::kHelloAck, &aux));
  PDKV_ASSIGN_OR_RETURN(auth::Mac ack, parse_mac(aux));
  PDKV_RETURN_IF_ERROR(hs.check_accept(ack).with_context(where));
  PDKV_RETURN_IF_ERROR(util::set_nonblocking(c->fd.get(), true));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return ConnectionError("agent is shutting down");
    c->authed = true;
    // Another thread may have dialed concurrently: keep one.
    for (auto& o : ctl_)
      if (o->outbound && o->peer == c->peer && o->peer_instance == c->peer_instance && !o->dead) return o;
    ctl_.push_back(c);
  }
  wake_ctl();
  return c;
}

void CudaIpcTransport::ctl_loop() {
  util::name_this_thread("pdkv-ipc-ctl");
  std::vector<pollfd> pfds;
  std::vector<std::shared_ptr<CtlConn>> conns;
  for (;;) {
    pfds.clear();
    conns.clear();
    bool handshaking = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      for (auto& c : ctl_) {
        conns.push_back(c);
        handshaking |= !c->authed || c->frame_deadline != Clock::time_point::max();
      }
    }
    pfds.push_back({evfd_, POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (auto& c : conns) {
      std::lock_guard<std::mutex> lk(mu_);
      // A held-back refusal is not read any more; its fd stays in the set, unpolled.
      pfds.push_back({c->fd.get(), static_cast<short>(c->reject_at == Clock::time_point::max() ? POLLIN | POLLRDHUP : 0), 0});
    }
    const int n = ::poll(pfds.data(), pfds.size(), handshaking ? 200 : -1);
    if (n < 0 && errno != EINTR) {
      PDKV_LOG_ERROR("cuda_ipc: poll: %s", util::errno_str(errno).c_str());
      return;
    }
    if (pfds[0].revents) {
      uint64_t v;
      if (::read(evfd_, &v, sizeof v) < 0) {
      }
    }
    if (pfds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          break;
        }
        auto c = std::make_shared<CtlConn>(util::ScopedFd(fd), false);
        c->hs_deadline = util::deadline_after(kCtlTimeoutS);
        std::lock_guard<std::mutex> lk(mu_);
        size_t pending = 0;
        for (auto& o : ctl_) pending += !o->outbound && !o->authed;
        if (pending >= kMaxPendingConns) {
          log_refusal(ResourceExhausted(std::to_string(kMaxPendingConns) + " control connections are already handshaking"));
          continue;  // c closes its fd
        }
        ctl_.push_back(c);
      }
    }
    for (size_t i = 0; i < conns.size(); ++i)
      if (pfds[i + 2].revents) on_ctl_readable(conns[i]);
    check_ctl_deadlines(conns);
  }
}

// Handshakes, frames started and not finished, refusals held back.
void CudaIpcTransport::check_ctl_deadlines(const std::vector<std::shared_ptr<CtlConn>>& conns) {
  const auto now = Clock::now();
  for (auto& c : conns) {
    Status why;
    bool answer = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (c->dead) continue;
      if (c->reject_at != Clock::time_point::max()) {
        if (now < c->reject_at) continue;
        why = c->reject;
        answer = true;
      } else if (!c->authed && now >= c->hs_deadline) {
        why = TimeoutError("a control connection did not complete its hello in time");
      } else if (now >= c->frame_deadline) {
        why = TimeoutError("a control frame from '" + c->peer + "' stalled mid-frame");
      } else {
        continue;
      }
    }
    if (answer) (void)send_ctl(*c, Ctl::kError, 0, why.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(why.code()));
    log_refusal(why);
    ctl_closed(c);
  }
}

void CudaIpcTransport::on_ctl_readable(const std::shared_ptr<CtlConn>& c) {
  for (;;) {
    ssize_t r;
    if (c->hdr_got < sizeof c->hdr) {
      r = ::recv(c->fd.get(), reinterpret_cast<char*>(&c->hdr) + c->hdr_got, sizeof c->hdr - c->hdr_got,
                 MSG_DONTWAIT);
      if (r > 0) {
        if (c->hdr_got == 0) {
          std::lock_guard<std::mutex> lk(mu_);
          c->frame_deadline = util::deadline_after(kCtlTimeoutS);
        }
        c->hdr_got += static_cast<size_t>(r);
        if (c->hdr_got < sizeof c->hdr) continue;
        bool authed;
        {
          std::lock_guard<std::mutex> lk(mu_);
          authed = c->authed;
        }
        const CtlSide side = c->outbound ? CtlSide::kImporter
                             : authed    ? CtlSide::kExporter
                             : c->hs     ? CtlSide::kExporterProof
                                         : CtlSide::kExporterPreHello;
        Status st = check_ctl_header(c->hdr, side);
        if (!st.ok()) {
          // Garbage (bad magic) and oversized frames are dropped without an answer, as before.
          if (!c->outbound && c->hdr.magic == kCtlMagic && c->hdr.aux_len <= kMaxHelloAux)
            (void)send_ctl(*c, Ctl::kError, 0, st.message(), static_cast<uint32_t>(StatusCode::kProtocolError));
          log_refusal(st.with_context(c->peer.empty() ? "an unauthenticated client" : "'" + c->peer + "'"));
          return ctl_closed(c);
        }
        c->aux.assign(c->hdr.aux_len, '\0');  // bounded by check_ctl_header
        c->aux_got = 0;
        if (c->hdr.aux_len > 0) continue;
      }
    } else {
      r = ::recv(c->fd.get(), c->aux.data() + c->aux_got, c->aux.size() - c->aux_got, MSG_DONTWAIT);
      if (r > 0) c->aux_got += static_cast<size_t>(r);
    }
    if (c->hdr_got == sizeof c->hdr && c->aux_got == c->aux.size()) {
      c->hdr_got = 0;
      {
        std::lock_guard<std::mutex> lk(mu_);
        c->frame_deadline = Clock::time_point::max();
      }
      if (!on_ctl_frame(c)) return ctl_closed(c);
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (c->reject_at != Clock::time_point::max()) return;  // answer held back; not read any more
      }
      continue;
    }
    if (r == 0) return ctl_closed(c);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    return ctl_closed(c);
  }
}

bool CudaIpcTransport::on_ctl_frame(const std::shared_ptr<CtlConn>& c) {
  const CtlHdr h = c->hdr;
  const auto type = static_cast<Ctl>(h.type);
  bool authed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    authed = c->authed;
  }
  if (!c->outbound && !authed) {
    auto refuse = [&](const Status& st) {
      log_refusal(st);
      (void)send_ctl(*c, Ctl::kError, 0, st.message().substr(0, kMaxErrorAux), static_cast<uint32_t>(st.code()));
      return false;
    };
    auto refuse_auth = [&](const Status& st) {
      const auto delay = throttle_.on_failure(Clock::now());
      if (delay == Clock::duration::zero()) return refuse(st);
      log_refusal(st);
      std::lock_guard<std::mutex> lk(mu_);
      c->reject_at = Clock::now() + delay;  // answered (and closed) by check_ctl_deadlines
      c->reject = st;
      return true;
    };
    if (type == Ctl::kProof) {  // check_ctl_header admitted only a proof after our challenge
      std::unique_ptr<auth::TargetHandshake> hs = std::move(c->hs);
      auto proof = parse_mac(c->aux);
      if (!proof.ok()) return refuse(ProtocolError("malformed proof: " + proof.status().message()));
      auth::Mac ack{};
      auto matched = hs->check(*proof, hooks_->accepted_keys(), &ack);
      if (!matched.ok()) return refuse_auth(matched.status());
      {
        std::lock_guard<std::mutex> lk(mu_);
        c->peer = hs->initiator();
        c->authed = true;
      }
      return send_ctl(*c, Ctl::kHelloAck, 0, encode_mac(ack)).ok();
    }
    auto hello = parse_hello(c->aux);  // check_ctl_header admitted only a hello
    if (!hello.ok())
      return refuse(Status(hello.status().code(), "malformed hello: " + hello.status().message()));
    if (hello->expect_instance != hooks_->instance_id())
      return refuse(StalePeer("agent '" + hooks_->agent_name() + "' restarted since its metadata was fetched"));
    // The importer proves first; we prove ourselves only after its proof checked.
    auto hs = auth::TargetHandshake::begin("cuda_ipc", kCtlVersion, hello->from, hooks_->agent_name(),
                                           hooks_->instance_id(), hello->nonce, hello->pub);
    if (!hs.ok()) return refuse(hs.status());
    const std::string body =
        encode_challenge(Challenge{hooks_->instance_id(), hooks_->agent_name(), hs->nonce(), hs->pub()});
    c->hs = std::make_unique<auth::TargetHandshake>(std::move(hs).value());
    return send_ctl(*c, Ctl::kChallenge, 0, body).ok();
  }
  switch (type) {
    case Ctl::kRevoke:
      if (!c->outbound) return false;
      on_revoke(c, h.id);
      return true;
    case Ctl::kRevokeAck: {
      if (c->outbound) return false;
      std::lock_guard<std::mutex> lk(mu_);
      c->acks.insert(h.id);
      ctl_cv_.notify_all();
      return true;
    }
    default:
      PDKV_LOG_WARN("cuda_ipc: unexpected control frame type %u from '%s'; closing", h.type, c->peer.c_str());
      return false;
  }
}

void CudaIpcTransport::ctl_closed(const std::shared_ptr<CtlConn>& c) {
  std::vector<std::shared_ptr<Opened>> orphaned;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (c->dead) return;
    c->dead = true;
    ctl_.erase(std::remove(ctl_.begin(), ctl_.end(), c), ctl_.end());
    ctl_cv_.notify_all();
    if (c->outbound) {
      // The exporter is gone (or dropped): its mappings must not be written any more.
      for (auto it = opened_.begin(); it != opened_.end();) {
        if (it->first.first == c->peer && it->first.second.first == c->peer_instance) {
          orphaned.push_back(it->second);
          it = opened_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  for (auto& o : orphaned) o->gone.store(true);
  ::shutdown(c->fd.get(), SHUT_RDWR);
}

bool registered = register_transport(TransportFactory{
    "cuda_ipc", "same-node GPU memory via CUDA IPC (NVLink/PCIe)",
    [] { return CudaDriver::probe(); },
    [](const AgentConfig&, const TransportOptions*) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(std::make_unique<CudaIpcTransport>());
    },
    /*priority=*/300});

}  // namespace
}  // namespace pdkv::cuda_ipc
