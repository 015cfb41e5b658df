// The entropy coders (zstd, LZ4) and the checksum (xxHash XXH3-64) behind one small
// interface, so codec.cc does not care which libraries this build found. Each is
// compiled only when CMake found its library (PDKV_HAVE_ZSTD / _LZ4 / _XXHASH);
// otherwise available() is false and every call is NotSupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "pdkv/codec.h"
#include "pdkv/status.h"

namespace pdkv::codec {

// One coder with its reusable context. Not thread-safe (one per Codec).
class EntropyCoder {
 public:
  virtual ~EntropyCoder() = default;
  // Worst-case compressed size of `len` bytes.
  virtual size_t bound(size_t len) const = 0;
  // Compresses src[0,len) into dst[0,cap); returns the compressed size.
  virtual Result<size_t> compress(const uint8_t* src, size_t len, uint8_t* dst, size_t cap) = 0;
  // Decompresses exactly `raw_len` bytes from src[0,len) into dst (capacity raw_len);
  // anything else (a short or long result, a malformed stream) is ProtocolError.
  virtual Status decompress(const uint8_t* src, size_t len, uint8_t* dst, size_t raw_len) = 0;
};

bool entropy_available(CodecKind kind);
// kZstd or kLz4; NotSupported if not built, InvalidArgument for a bad zstd level.
Result<std::unique_ptr<EntropyCoder>> make_entropy_coder(CodecKind kind, int level);

bool xxh3_available();
// XXH3-64 of data[0,len); 0 when xxHash is not built (callers check xxh3_available()).
uint64_t xxh3_64(const uint8_t* data, size_t len);

}  // namespace pdkv::codec
