// Codec: one chunk -> one frame (frame.h) and back. Lossless codecs split the
// elements into byte planes (byte_planes.h) before the entropy coder (entropy.h);
// FP8 quantizes with per-group scales (fp8.h). The checksum covers the uncompressed
// chunk for lossless frames and the codes + scales for FP8 frames.
#include "pdkv/codec.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "codec/byte_planes.h"
#include "codec/entropy.h"
#include "codec/fp8.h"
#include "codec/frame.h"
#include "codec/kernels.h"

namespace pdkv {

using codec::EntropyCoder;

std::string_view codec_kind_name(CodecKind kind) {
  switch (kind) {
    case CodecKind::kRaw: return "raw";
    case CodecKind::kZstd: return "zstd";
    case CodecKind::kLz4: return "lz4";
    case CodecKind::kFp8: return "fp8";
  }
  return "unknown";
}

Result<CodecKind> parse_codec_kind(std::string_view name) {
  for (CodecKind k : {CodecKind::kRaw, CodecKind::kZstd, CodecKind::kLz4, CodecKind::kFp8})
    if (name == codec_kind_name(k)) return k;
  return InvalidArgument("unknown codec '" + std::string(name) + "' (expected raw, zstd, lz4 or fp8)");
}

bool codec_available(CodecKind kind) {
  if (kind == CodecKind::kRaw || kind == CodecKind::kFp8) return true;
  return codec::entropy_available(kind);
}

bool checksum_available() { return codec::xxh3_available(); }

Result<FrameInfo> peek_frame(const uint8_t* frame, size_t n) {
  uint64_t checksum = 0;
  return codec::read_frame_header(frame, n, &checksum);
}

namespace {

bool is_float_for_fp8(DType dt) { return dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kF32; }

}  // namespace

Result<uint64_t> decoded_size(const FrameInfo& info, DType dst_dtype) {
  if (info.kind != CodecKind::kFp8) {
    if (dst_dtype != info.dtype)
      return InvalidArgument("a lossless " + std::string(codec_kind_name(info.kind)) + " frame of " +
                             std::string(dtype_name(info.dtype)) + " decodes only into " +
                             std::string(dtype_name(info.dtype)) + ", not " + std::string(dtype_name(dst_dtype)));
    return info.raw_len;
  }
  if (!is_float_for_fp8(dst_dtype))
    return InvalidArgument("fp8 frames dequantize into bfloat16, float16 or float32, not " +
                           std::string(dtype_name(dst_dtype)));
  return info.raw_len / dtype_size(info.dtype) * dtype_size(dst_dtype);
}

namespace {

// Byte-plane scratch a Codec keeps between chunks; a larger chunk's is released
// after it (a Codec lives as long as its thread, and one huge frame must not pin
// its size for good).
constexpr size_t kKeepScratchBytes = 8u << 20;

// Releases `v`'s memory when it grew past kKeepScratchBytes.
void trim(std::vector<uint8_t>& v) {
  if (v.capacity() > kKeepScratchBytes) std::vector<uint8_t>().swap(v);
}

}  // namespace

struct Codec::Impl {
  CodecOptions options;
  std::unique_ptr<EntropyCoder> coder;  // kZstd / kLz4 only
  std::vector<uint8_t> scratch;         // byte planes of the chunk being encoded or decoded

  Status encode_raw(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out);
  Status encode_entropy(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out);
  Status encode_fp8(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out);
  Status decode_entropy(const FrameInfo& f, const uint8_t* payload, uint8_t* dst);
};

Codec::Codec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Codec::~Codec() = default;

Result<std::unique_ptr<Codec>> Codec::create(const CodecOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.kind > CodecKind::kFp8) return InvalidArgument("unknown codec kind " + std::to_string(int(options.kind)));
  if (options.checksum && !checksum_available())
    return NotSupported("codec checksum needs xxHash, which was not found when pdkv was built "
                        "(install libxxhash-dev and rebuild)");
  if (options.kind == CodecKind::kZstd || options.kind == CodecKind::kLz4) {
    PDKV_ASSIGN_OR_RETURN(impl->coder, codec::make_entropy_coder(options.kind, options.level));
  }
  if (options.kind == CodecKind::kFp8) {
    const Fp8Grouping& g = options.fp8;
    if (g.heads == 0 || g.head_dim == 0 || g.rows_per_group == 0)
      return InvalidArgument("fp8 grouping needs heads, head_dim and rows_per_group >= 1");
  }
  return std::unique_ptr<Codec>(new Codec(std::move(impl)));
}

const CodecOptions& Codec::options() const { return impl_->options; }

size_t Codec::max_frame_size(size_t len, DType dtype) const {
  size_t payload = len;
  if (impl_->coder) payload = std::max(len, impl_->coder->bound(len));
  if (impl_->options.kind == CodecKind::kFp8) {
    const uint64_t elems = len / std::max<size_t>(1, dtype_size(dtype));
    payload = codec::fp8_group_count(elems, impl_->options.fp8) * 4 + elems;
  }
  return kCodecHeaderBytes + payload;
}

Status Codec::encode(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out) {
  if (len > kCodecMaxChunkBytes)
    return InvalidArgument("codec chunk of " + std::to_string(len) + " bytes exceeds the limit " +
                           std::to_string(kCodecMaxChunkBytes) + " (split it)");
  if (len != 0 && src == nullptr) return InvalidArgument("codec encode: null source");
  switch (impl_->options.kind) {
    case CodecKind::kRaw: return impl_->encode_raw(src, len, dtype, out);
    case CodecKind::kZstd:
    case CodecKind::kLz4: return impl_->encode_entropy(src, len, dtype, out);
    case CodecKind::kFp8: return impl_->encode_fp8(src, len, dtype, out);
  }
  return Internal("codec kind unhandled");
}

Status Codec::Impl::encode_raw(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out) {
  FrameInfo f;
  f.kind = CodecKind::kRaw;
  f.dtype = dtype;
  f.has_checksum = options.checksum;
  f.raw_len = f.payload_len = len;
  out.resize(kCodecHeaderBytes + len);
  if (len) std::memcpy(out.data() + kCodecHeaderBytes, src, len);
  codec::write_frame_header(f, f.has_checksum ? codec::xxh3_64(src, len) : 0, out.data());
  return Status::Ok();
}

Status Codec::Impl::encode_entropy(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out) {
  FrameInfo f;
  f.kind = options.kind;
  f.dtype = dtype;
  f.has_checksum = options.checksum;
  f.raw_len = len;
  if (len != 0) {
    const size_t esize = dtype_size(dtype);
    const uint8_t* input = src;
    if (esize > 1) {
      scratch.resize(len);
      codec::split_planes(src, len, esize, scratch.data(), codec::planes_fast());
      input = scratch.data();
    }
    out.resize(kCodecHeaderBytes + coder->bound(len));
    auto compressed = coder->compress(input, len, out.data() + kCodecHeaderBytes, out.size() - kCodecHeaderBytes);
    trim(scratch);
    PDKV_ASSIGN_OR_RETURN(size_t n, std::move(compressed));
    if (n >= len) return encode_raw(src, len, dtype, out);  // incompressible: never bigger than raw
    f.payload_len = n;
  }
  out.resize(kCodecHeaderBytes + f.payload_len);
  codec::write_frame_header(f, f.has_checksum ? codec::xxh3_64(src, len) : 0, out.data());
  return Status::Ok();
}

Status Codec::Impl::encode_fp8(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out) {
  if (!is_float_for_fp8(dtype))
    return InvalidArgument("fp8 codec encodes bfloat16, float16 or float32, not " + std::string(dtype_name(dtype)));
  const size_t esize = dtype_size(dtype);
  if (len % esize != 0)
    return InvalidArgument("fp8 codec: " + std::to_string(len) + " bytes is not a whole number of " +
                           std::string(dtype_name(dtype)) + " elements");
  const uint64_t elems = len / esize;
  const uint64_t groups = codec::fp8_group_count(elems, options.fp8);
  if (elems != 0 && groups == 0)
    return InvalidArgument("fp8 codec: " + std::to_string(elems) + " elements are not whole rows of heads " +
                           std::to_string(options.fp8.heads) + " x head_dim " + std::to_string(options.fp8.head_dim));
  FrameInfo f;
  f.kind = CodecKind::kFp8;
  f.dtype = dtype;
  f.has_checksum = options.checksum;
  f.raw_len = len;
  f.payload_len = groups * 4 + elems;
  f.fp8 = options.fp8;
  out.resize(kCodecHeaderBytes + f.payload_len);
  uint8_t* payload = out.data() + kCodecHeaderBytes;
  if (elems) codec::fp8_quantize(src, elems, dtype, options.fp8, payload, payload + groups * 4);
  codec::write_frame_header(f, f.has_checksum ? codec::xxh3_64(payload, f.payload_len) : 0, out.data());
  return Status::Ok();
}

Status Codec::decode(const uint8_t* frame, size_t frame_len, DType dst_dtype, uint8_t* dst, size_t dst_cap,
                     size_t* written) {
  *written = 0;
  uint64_t checksum = 0;
  PDKV_ASSIGN_OR_RETURN(FrameInfo f, codec::read_frame_header(frame, frame_len, &checksum));
  if (f.frame_len != frame_len)
    return ProtocolError("codec frame: " + std::to_string(frame_len) + " bytes, header says " +
                         std::to_string(f.frame_len));
  PDKV_ASSIGN_OR_RETURN(uint64_t out_len, decoded_size(f, dst_dtype));
  if (out_len > dst_cap)
    return OutOfRange("codec frame decodes to " + std::to_string(out_len) + " bytes; the destination holds " +
                      std::to_string(dst_cap));
  if (out_len != 0 && dst == nullptr) return InvalidArgument("codec decode: null destination");
  const uint8_t* payload = frame + kCodecHeaderBytes;
  auto verify = [&](const uint8_t* p, uint64_t n, const char* what) -> Status {
    if (!f.has_checksum) return Status::Ok();
    if (!checksum_available())
      return NotSupported("codec frame carries a checksum but this build has no xxHash to verify it");
    const uint64_t got = codec::xxh3_64(p, n);
    if (got != checksum)
      return DataCorrupted(std::string("codec frame: checksum of the ") + what + " does not match (sent " +
                           std::to_string(checksum) + ", computed " + std::to_string(got) + ")");
    return Status::Ok();
  };
  switch (f.kind) {
    case CodecKind::kRaw:
      if (f.raw_len) std::memcpy(dst, payload, f.raw_len);
      PDKV_RETURN_IF_ERROR(verify(dst, f.raw_len, "decoded bytes"));
      break;
    case CodecKind::kZstd:
    case CodecKind::kLz4:
      PDKV_RETURN_IF_ERROR(impl_->decode_entropy(f, payload, dst));
      PDKV_RETURN_IF_ERROR(verify(dst, f.raw_len, "decoded bytes"));
      break;
    case CodecKind::kFp8: {
      PDKV_RETURN_IF_ERROR(verify(payload, f.payload_len, "fp8 codes and scales"));
      const uint64_t elems = f.raw_len / dtype_size(f.dtype);
      const uint64_t groups = codec::fp8_group_count(elems, f.fp8);
      if (elems) codec::fp8_dequantize(payload, payload + groups * 4, elems, f.fp8, dst_dtype, dst);
      break;
    }
  }
  *written = out_len;
  return Status::Ok();
}

Status Codec::Impl::decode_entropy(const FrameInfo& f, const uint8_t* payload, uint8_t* dst) {
  if (f.raw_len == 0) return Status::Ok();
  std::unique_ptr<EntropyCoder> own;
  EntropyCoder* c = coder.get();
  if (options.kind != f.kind || !c) {  // a frame of another codec than this Codec encodes
    PDKV_ASSIGN_OR_RETURN(own, codec::make_entropy_coder(f.kind, 1));
    c = own.get();
  }
  const size_t esize = dtype_size(f.dtype);
  if (esize == 1) return c->decompress(payload, f.payload_len, dst, f.raw_len);
  scratch.resize(f.raw_len);
  Status st = c->decompress(payload, f.payload_len, scratch.data(), f.raw_len);
  if (st.ok()) codec::merge_planes(scratch.data(), f.raw_len, esize, dst, codec::planes_fast());
  trim(scratch);
  return st;
}

}  // namespace pdkv
