// TcpOptions::validate (pdkv/options/tcp.h): the limits the tcp transport's wire
// format and syscalls impose.
#include "pdkv/options/tcp.h"

#include <algorithm>

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
constexpr uint32_t kMaxInboundConns = 65536;
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
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.max_inbound_conns", max_inbound_conns, 1, kMaxInboundConns));
  PDKV_RETURN_IF_ERROR(
      check_in_range<uint32_t>("tcp.max_inbound_per_peer", max_inbound_per_peer, 1, kMaxInboundConns));
  PDKV_RETURN_IF_ERROR(check_in_range<uint64_t>("tcp.gather_below_bytes", gather_below_bytes, 0, 1ull << 30));
  PDKV_RETURN_IF_ERROR(check_in_range<uint64_t>("tcp.land_below_bytes", land_below_bytes, 0, 1ull << 30));
  PDKV_RETURN_IF_ERROR(compress.validate());
  if (listen_host.empty()) return InvalidArgument("tcp.listen_host is empty (use an address such as 127.0.0.1)");
  // TCP_CA_NAME_MAX is 16 with the terminating NUL; kernel names are lower-case words.
  if (congestion_control.size() > 15 ||
      !std::all_of(congestion_control.begin(), congestion_control.end(),
                   [](char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_'; }))
    return InvalidArgument("tcp.congestion_control must be a kernel congestion control name (a-z, 0-9, _; at most "
                           "15 characters) or empty for the system's, got '" + congestion_control + "'");
  return Status::Ok();
}

std::string_view compress_mode_name(CompressMode m) {
  switch (m) {
    case CompressMode::kOff: return "off";
    case CompressMode::kLossless: return "lossless";
    case CompressMode::kFp8: return "fp8";
    case CompressMode::kAuto: return "auto";
  }
  return "?";
}

Result<CompressMode> parse_compress_mode(std::string_view s, std::string_view what) {
  for (auto m : {CompressMode::kOff, CompressMode::kLossless, CompressMode::kFp8, CompressMode::kAuto})
    if (s == compress_mode_name(m)) return m;
  return InvalidArgument(std::string(what) + " must be off, lossless, fp8 or auto, got '" + std::string(s) + "'");
}

std::string_view compress_policy_name(CompressPolicy p) {
  return p == CompressPolicy::kLossless ? "lossless" : "lossy-allowed";
}

Result<CompressPolicy> parse_compress_policy(std::string_view s) {
  for (auto p : {CompressPolicy::kLossless, CompressPolicy::kLossyAllowed})
    if (s == compress_policy_name(p)) return p;
  return InvalidArgument("tcp.compress.policy must be lossless or lossy-allowed, got '" + std::string(s) + "'");
}

Status TcpCompression::validate() const {
  using util::check_in_range;
  if (codec != CodecKind::kZstd && codec != CodecKind::kLz4)
    return InvalidArgument("tcp.compress.codec must be zstd or lz4, got " + std::string(codec_kind_name(codec)));
  PDKV_RETURN_IF_ERROR(check_in_range<int32_t>("tcp.compress.level", level, -7, 9));
  PDKV_RETURN_IF_ERROR(check_in_range<uint64_t>("tcp.compress.chunk_bytes", chunk_bytes, 4096, tcp::kMaxCompressedChunk));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.compress.threads", threads, 0, 16));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.compress.fp8_heads", fp8.heads, 1, 1u << 16));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.compress.fp8_head_dim", fp8.head_dim, 1, 1u << 16));
  PDKV_RETURN_IF_ERROR(check_in_range<uint32_t>("tcp.compress.fp8_rows_per_group", fp8.rows_per_group, 1, 1u << 16));
  const bool fp8_possible = mode == CompressMode::kFp8 ||
                            (mode == CompressMode::kAuto && policy == CompressPolicy::kLossyAllowed);
  if (fp8_possible && dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    return InvalidArgument("tcp.compress.dtype must be bfloat16, float16 or float32 for fp8, got " +
                           std::string(dtype_name(dtype)));
  if (fp8_possible && uint64_t(fp8.heads) * fp8.head_dim * dtype_size(dtype) > chunk_bytes)
    return InvalidArgument("tcp.compress.chunk_bytes (" + std::to_string(chunk_bytes) +
                           ") is smaller than one fp8 row (fp8_heads x fp8_head_dim elements)");
  if ((mode == CompressMode::kLossless || mode == CompressMode::kAuto) && !codec_available(codec))
    return NotSupported("tcp.compress.codec " + std::string(codec_kind_name(codec)) +
                        " is not in this build (its library was not found at configure time)");
  if (checksum && mode != CompressMode::kOff && !checksum_available())
    return NotSupported("tcp.compress.checksum needs xxHash, which is not in this build");
  return Status::Ok();
}

}  // namespace pdkv
