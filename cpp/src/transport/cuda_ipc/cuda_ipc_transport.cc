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
#include "transport/cuda_ipc/cuda_ipc_transport_impl.h"

#include <poll.h>

extern const unsigned char kPdkvBatchCopyFatbin[];
extern const unsigned long kPdkvBatchCopyFatbinSize;

namespace pdkv::cuda_ipc {
namespace {

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
}  // namespace

namespace {
std::mutex g_local_mu;
std::set<uint64_t> g_local_agents;

// Whether the exporter's end of a control connection already hung up (it died or
// closed it) though the progress thread has not read that yet: a post racing the
// exporter's death checks here, without consuming anything, so it fails instead of
// writing into memory nobody owns any more.
bool ctl_hung_up(const std::weak_ptr<CtlConn>& w) {
  const auto c = w.lock();
  if (!c) return false;
  struct pollfd p {c->fd.get(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
}
}  // namespace

bool in_this_process(uint64_t instance_id) {
  std::lock_guard<std::mutex> lk(g_local_mu);
  return g_local_agents.count(instance_id) != 0;
}

Status CudaIpcTransport::start(AgentHooks* hooks) {
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

void CudaIpcTransport::shutdown() {
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

bool CudaIpcTransport::can_reach(const AgentMetadata& peer) const {
  if (peer.host_id != hooks_->host_id() || in_this_process(peer.instance_id)) return false;
  for (const auto& [n, b] : peer.extras)
    if (n == "cuda_ipc") return true;
  return false;
}

void CudaIpcTransport::drop_peer(const std::string& name) {
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
    if (o->revoked || o->gone || ctl_hung_up(o->ctl)) {
      const bool gone = o->gone || !o->revoked;
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

namespace {

bool registered = register_transport(TransportFactory{
    "cuda_ipc", "same-node GPU memory via CUDA IPC (NVLink/PCIe)",
    [] { return CudaDriver::probe(); },
    [](const AgentConfig&, const TransportOptions*) -> Result<std::unique_ptr<Transport>> {
      return std::unique_ptr<Transport>(std::make_unique<CudaIpcTransport>());
    },
    /*priority=*/300});

}  // namespace
}  // namespace pdkv::cuda_ipc
