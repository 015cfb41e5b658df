// cuda_ipc's control connections (a Unix socket from an importer to an exporter,
// which the exporter uses to revoke mappings) and what an importer opened through
// one: the exported regions as published, the mappings this process opened (Opened),
// the connection itself (CtlConn) and the two calls that write or dial one. Frames:
// wire.h; the handshake: handshake.cc; the thread that reads them: progress.cc.
//
// Thread safety: a CtlConn's writes are serialized by its wmu; its read state is the
// control thread's; the rest is guarded by the transport's mu_ (noted per field).
#pragma once

#include <sys/un.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "cuda/driver.h"
#include "pdkv/spi/auth.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "transport/cuda_ipc/wire.h"
#include "util/socket.h"

namespace pdkv::cuda_ipc {

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

// Sends one control frame (serialized with the connection's other writes).
Status send_ctl(CtlConn& c, Ctl type, uint64_t id, std::string_view aux = {}, uint32_t status = 0);
// Connects to an exporter's control socket by `deadline` (util::connect_unix does not
// block on a frozen exporter's full backlog).
Result<util::ScopedFd> dial_ctl(const std::string& path, Clock::time_point deadline);

}  // namespace pdkv::cuda_ipc
