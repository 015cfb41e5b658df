// TcpOptions::validate (pdkv/options/tcp.h): the limits the tcp transport's wire
// format and syscalls impose.
#include "pdkv/options/tcp.h"

#include "transport/tcp/wire.h"
#include "util/option_check.h"

namespace pdkv {

namespace {
constexpr uint32_t kMaxConnsPerPeer = 64;
constexpr uint32_t kMaxProgressThreads = 64;
// One batch is one sendmsg: IOV_MAX (1024) iovecs, less the frame header's.
constexpr uint32_t kMaxBatchExtents = 1020;
constexpr uint64_t kMinStageChunkBytes = 4096;
constexpr uint32_t kMinStageBuffers = 2;  // one filling while one is on the wire
constexpr uint32_t kMaxStageBuffers = 1024;
constexpr double kMaxTimeoutS = 86400;
}  // namespace

Status TcpOptions::validate() const {
  using util::check_in_range;
  using util::check_seconds;
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.conns_per_peer", conns_per_peer, 1, kMaxConnsPerPeer));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.progress_threads", progress_threads, 1, kMaxProgressThreads));
  PDKV_RETURN_IF_ERROR(check_in_range<uint64_t>("tcp.batch_bytes", batch_bytes, 1, tcp::kMaxPayloadPerFrame));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.batch_extents", batch_extents, 1, kMaxBatchExtents));
  PDKV_RETURN_IF_ERROR(check_seconds("tcp.connect_timeout_s", connect_timeout_s, kMaxTimeoutS));
  PDKV_RETURN_IF_ERROR(check_seconds("tcp.handshake_timeout_s", handshake_timeout_s, kMaxTimeoutS));
  PDKV_RETURN_IF_ERROR(check_seconds("tcp.frame_timeout_s", frame_timeout_s, kMaxTimeoutS));
  PDKV_RETURN_IF_ERROR(
      check_in_range<uint64_t>("tcp.stage_chunk_bytes", stage_chunk_bytes, kMinStageChunkBytes, tcp::kMaxPayloadPerFrame));
  PDKV_RETURN_IF_ERROR(
      check_in_range<uint32_t>("tcp.stage_buffers", stage_buffers, kMinStageBuffers, kMaxStageBuffers));
  if (listen_host.empty()) return InvalidArgument("tcp.listen_host is empty (use an address such as 127.0.0.1)");
  return Status::Ok();
}

}  // namespace pdkv
