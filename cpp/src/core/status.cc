#include "pdkv/status.h"

#include "pdkv/types.h"

namespace pdkv {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kAuthFailed: return "AuthFailed";
    case StatusCode::kProtocolError: return "ProtocolError";
    case StatusCode::kVersionMismatch: return "VersionMismatch";
    case StatusCode::kStalePeer: return "StalePeer";
    case StatusCode::kConnectionError: return "ConnectionError";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kNotSupported: return "NotSupported";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kInternal: return "Internal";
    case StatusCode::kStaleBlock: return "StaleBlock";
    case StatusCode::kDataCorrupted: return "DataCorrupted";
  }
  return "Unknown";
}

StatusCode status_code_from_wire(uint32_t v) {
  if (v == 0 || v > static_cast<uint32_t>(kLastStatusCode)) return StatusCode::kProtocolError;
  return static_cast<StatusCode>(v);
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string s(status_code_name(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::with_context(std::string_view prefix) const {
  if (ok()) return *this;
  std::string m(prefix);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

#define PDKV_DEFINE_CTOR(fn, code) \
  Status fn(std::string msg) { return Status(StatusCode::code, std::move(msg)); }
PDKV_DEFINE_CTOR(InvalidArgument, kInvalidArgument)
PDKV_DEFINE_CTOR(NotFound, kNotFound)
PDKV_DEFINE_CTOR(AlreadyExists, kAlreadyExists)
PDKV_DEFINE_CTOR(OutOfRange, kOutOfRange)
PDKV_DEFINE_CTOR(AuthFailed, kAuthFailed)
PDKV_DEFINE_CTOR(ProtocolError, kProtocolError)
PDKV_DEFINE_CTOR(VersionMismatch, kVersionMismatch)
PDKV_DEFINE_CTOR(StalePeer, kStalePeer)
PDKV_DEFINE_CTOR(ConnectionError, kConnectionError)
PDKV_DEFINE_CTOR(TimeoutError, kTimeout)
PDKV_DEFINE_CTOR(Cancelled, kCancelled)
PDKV_DEFINE_CTOR(NotSupported, kNotSupported)
PDKV_DEFINE_CTOR(ResourceExhausted, kResourceExhausted)
PDKV_DEFINE_CTOR(Internal, kInternal)
PDKV_DEFINE_CTOR(StaleBlock, kStaleBlock)
PDKV_DEFINE_CTOR(DataCorrupted, kDataCorrupted)
#undef PDKV_DEFINE_CTOR

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kF8E4M3: case DType::kF8E5M2: case DType::kI8: case DType::kU8: return 1;
    case DType::kF64: case DType::kI64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
    case DType::kI8: return "int8";
    case DType::kU8: return "uint8";
    case DType::kF64: return "float64";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

Result<DType> parse_dtype(std::string_view n) {
  if (n == "float32" || n == "fp32" || n == "f32" || n == "float") return DType::kF32;
  if (n == "float16" || n == "fp16" || n == "f16" || n == "half") return DType::kF16;
  if (n == "bfloat16" || n == "bf16") return DType::kBF16;
  if (n == "float8_e4m3fn" || n == "fp8" || n == "fp8_e4m3" || n == "float8_e4m3") return DType::kF8E4M3;
  if (n == "float8_e5m2" || n == "fp8_e5m2") return DType::kF8E5M2;
  if (n == "int8" || n == "i8") return DType::kI8;
  if (n == "uint8" || n == "u8") return DType::kU8;
  if (n == "float64" || n == "fp64" || n == "double") return DType::kF64;
  if (n == "int32") return DType::kI32;
  if (n == "int64") return DType::kI64;
  return InvalidArgument("unknown dtype '" + std::string(n) +
                         "' (expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8, "
                         "float64, int32 or int64)");
}

std::string_view mem_kind_name(MemKind k) { return k == MemKind::kHost ? "host" : "cuda"; }
std::string_view op_kind_name(OpKind k) { return k == OpKind::kWrite ? "write" : "read"; }
std::string_view xfer_state_name(XferState s) {
  switch (s) {
    case XferState::kPending: return "pending";
    case XferState::kDone: return "done";
    case XferState::kFailed: return "failed";
    case XferState::kCancelled: return "cancelled";
  }
  return "unknown";
}

}  // namespace pdkv
