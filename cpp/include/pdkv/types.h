// pdkv/types.h: small shared enums and value types.
//
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "pdkv/status.h"

namespace pdkv {

// Where a region's bytes live.
enum class MemKind : uint8_t { kHost = 0, kCuda = 1 };

// Direction of a transfer, seen from the initiator.
enum class OpKind : uint8_t {
  kWrite = 0,  // push local bytes into the peer's memory
  kRead = 1,   // pull the peer's bytes into local memory
};

// Lifecycle of a posted transfer. Separate from StatusCode on purpose:
// "pending" is a state, not an error.
enum class XferState : uint8_t { kPending = 0, kDone = 1, kFailed = 2, kCancelled = 3 };

// Element type of a KV cache. Only the size matters for byte math; the name is
// kept so that two peers can check they agree.
enum class DType : uint8_t {
  kF32 = 0, kF16, kBF16, kF8E4M3, kF8E5M2, kI8, kU8, kF64, kI32, kI64,
};

// Size in bytes of one element.
size_t dtype_size(DType dt);
std::string_view dtype_name(DType dt);
// Parses "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half",
// "float8_e4m3fn", "fp8", "float8_e5m2", "int8", "uint8", "float64", "int32", "int64".
Result<DType> parse_dtype(std::string_view name);

std::string_view mem_kind_name(MemKind k);
std::string_view op_kind_name(OpKind k);
std::string_view xfer_state_name(XferState s);

}  // namespace pdkv
