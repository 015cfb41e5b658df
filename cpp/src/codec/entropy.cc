#include "codec/entropy.h"

#include <algorithm>
#include <climits>
#include <string>

#ifdef PDKV_HAVE_ZSTD
#include <zstd.h>
#endif
#ifdef PDKV_HAVE_LZ4
#include <lz4.h>
#endif
#ifdef PDKV_HAVE_XXHASH
#include <xxhash.h>
#endif

namespace pdkv::codec {

namespace {

#ifdef PDKV_HAVE_ZSTD
class ZstdCoder final : public EntropyCoder {
 public:
  explicit ZstdCoder(int level) : level_(level), cctx_(ZSTD_createCCtx()), dctx_(ZSTD_createDCtx()) {}
  ~ZstdCoder() override {
    ZSTD_freeCCtx(cctx_);
    ZSTD_freeDCtx(dctx_);
  }
  size_t bound(size_t len) const override { return ZSTD_compressBound(len); }
  Result<size_t> compress(const uint8_t* src, size_t len, uint8_t* dst, size_t cap) override {
    if (!cctx_) return ResourceExhausted("zstd: cannot allocate a compression context");
    const size_t n = ZSTD_compressCCtx(cctx_, dst, cap, src, len, level_);
    if (ZSTD_isError(n)) return Internal(std::string("zstd compress: ") + ZSTD_getErrorName(n));
    return n;
  }
  Status decompress(const uint8_t* src, size_t len, uint8_t* dst, size_t raw_len) override {
    if (!dctx_) return ResourceExhausted("zstd: cannot allocate a decompression context");
    const size_t n = ZSTD_decompressDCtx(dctx_, dst, raw_len, src, len);
    if (ZSTD_isError(n)) return ProtocolError(std::string("codec frame: zstd payload: ") + ZSTD_getErrorName(n));
    if (n != raw_len)
      return ProtocolError("codec frame: zstd payload decodes to " + std::to_string(n) + " bytes, header says " +
                           std::to_string(raw_len));
    return Status::Ok();
  }

 private:
  int level_;
  ZSTD_CCtx* cctx_;
  ZSTD_DCtx* dctx_;
};
#endif

#ifdef PDKV_HAVE_LZ4
class Lz4Coder final : public EntropyCoder {
 public:
  size_t bound(size_t len) const override { return size_t(LZ4_compressBound(int(len))); }
  Result<size_t> compress(const uint8_t* src, size_t len, uint8_t* dst, size_t cap) override {
    // Chunks are at most kCodecMaxChunkBytes (1 GiB), far below LZ4's int limit.
    const int n = LZ4_compress_default(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst), int(len),
                                       int(std::min<size_t>(cap, INT_MAX)));
    if (n <= 0) return Internal("lz4 compress failed");
    return size_t(n);
  }
  Status decompress(const uint8_t* src, size_t len, uint8_t* dst, size_t raw_len) override {
    if (len > size_t(INT_MAX) || raw_len > size_t(INT_MAX))
      return ProtocolError("codec frame: lz4 payload larger than LZ4 allows");
    const int n = LZ4_decompress_safe(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst), int(len),
                                      int(raw_len));
    if (n < 0) return ProtocolError("codec frame: lz4 payload is malformed");
    if (size_t(n) != raw_len)
      return ProtocolError("codec frame: lz4 payload decodes to " + std::to_string(n) + " bytes, header says " +
                           std::to_string(raw_len));
    return Status::Ok();
  }
};
#endif

}  // namespace

bool entropy_available(CodecKind kind) {
#ifdef PDKV_HAVE_ZSTD
  if (kind == CodecKind::kZstd) return true;
#endif
#ifdef PDKV_HAVE_LZ4
  if (kind == CodecKind::kLz4) return true;
#endif
  return false;
}

Result<std::unique_ptr<EntropyCoder>> make_entropy_coder(CodecKind kind, int level) {
  if (!entropy_available(kind))
    return NotSupported("codec '" + std::string(codec_kind_name(kind)) +
                        "' is not in this build (its library was not found when pdkv was built; install "
                        "libzstd-dev / liblz4-dev and rebuild)");
#ifdef PDKV_HAVE_ZSTD
  if (kind == CodecKind::kZstd) {
    if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel())
      return InvalidArgument("zstd level " + std::to_string(level) + " outside [" +
                             std::to_string(ZSTD_minCLevel()) + ", " + std::to_string(ZSTD_maxCLevel()) + "]");
    return std::unique_ptr<EntropyCoder>(new ZstdCoder(level));
  }
#endif
#ifdef PDKV_HAVE_LZ4
  if (kind == CodecKind::kLz4) return std::unique_ptr<EntropyCoder>(new Lz4Coder());
#endif
  return Internal("entropy coder " + std::string(codec_kind_name(kind)) + " unhandled");
}

bool xxh3_available() {
#ifdef PDKV_HAVE_XXHASH
  return true;
#else
  return false;
#endif
}

uint64_t xxh3_64(const uint8_t* data, size_t len) {
#ifdef PDKV_HAVE_XXHASH
  return XXH3_64bits(data, len);
#else
  (void)data;
  (void)len;
  return 0;
#endif
}

}  // namespace pdkv::codec
