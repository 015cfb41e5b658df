// CudaIpcTransport: the cuda_ipc Transport (see cuda_ipc_transport.cc for how it
// works) and the files it is split into, in the roles every transport folder shares
// (docs/architecture.md, "One shape per transport folder"):
//   cuda_ipc_transport.cc  start-up and shutdown, metadata, prepare (mapping) and post
//   conn.h                 a control connection and the mappings opened through one
//   handshake.cc           the importer's side of the control handshake (ctl_to)
//   progress.cc            the control thread (accept, frames, deadlines, revocation)
//                          and the completion thread
//   wire.h                 control frames, their limits and decoders (pure, fuzzed)
// cuda_ipc has no options (its factory registers none), so no options.cc.
//
// Thread safety: see pdkv/spi/transport.h; mu_ guards the shared state (noted below).
#pragma once

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
#include "transport/cuda_ipc/wire.h"
#include "transport/shm/ctl_guard.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

#include "transport/cuda_ipc/conn.h"

namespace pdkv::cuda_ipc {

inline constexpr uint64_t kKernelChunk = 64 << 10;  // extents are split to this for the kernel

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
inline bool is_peer_fault(const Status& st) {
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

// True when an agent of this process has instance id `instance_id` (cuda_ipc_transport.cc).
bool in_this_process(uint64_t instance_id);

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
  Status start(AgentHooks* hooks) override;
  void shutdown() override;
  std::vector<Endpoint> endpoints() const override { return {Endpoint{"cuda_ipc", hooks_->host_id()}}; }
  std::string metadata_extra() const override;
  bool can_reach(const AgentMetadata& peer) const override;
  Result<std::shared_ptr<const PreparedOps>> prepare(std::shared_ptr<const Peer> peer, OpKind op,
                                                     std::vector<ResolvedExtent> extents) override;
  void post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
            std::string notif) override;
  void notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) override {
    hooks_->relay_notification(peer, xfer, std::move(notif), this);
  }
  void drop_peer(const std::string& name) override;
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

}  // namespace pdkv::cuda_ipc
