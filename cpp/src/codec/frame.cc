#include "codec/frame.h"

#include <cstring>
#include <string>
#include <string_view>

#include "codec/entropy.h"
#include "codec/fp8.h"
#include "util/bytes.h"

namespace pdkv::codec {

namespace {

template <typename T>
void put(uint8_t* out, size_t off, T v) {
  std::memcpy(out + off, &v, sizeof v);
}

bool is_fp8_input(DType dt) { return dt == DType::kBF16 || dt == DType::kF16 || dt == DType::kF32; }

// Payload bounds per codec, checked before anything is allocated or decoded.
Status check_payload(const FrameInfo& f) {
  if (f.raw_len > kCodecMaxChunkBytes)
    return ProtocolError("codec frame: raw_len " + std::to_string(f.raw_len) + " exceeds the chunk limit " +
                         std::to_string(kCodecMaxChunkBytes));
  if (f.raw_len == 0 && f.payload_len != 0)
    return ProtocolError("codec frame: empty chunk with a " + std::to_string(f.payload_len) + "-byte payload");
  switch (f.kind) {
    case CodecKind::kRaw:
      if (f.payload_len != f.raw_len)
        return ProtocolError("codec frame: raw payload_len " + std::to_string(f.payload_len) + " != raw_len " +
                             std::to_string(f.raw_len));
      return Status::Ok();
    case CodecKind::kZstd:
    case CodecKind::kLz4:
      // Compressed data never exceeds the raw size: the encoder sends kRaw instead.
      if (f.payload_len >= f.raw_len && f.raw_len != 0)
        return ProtocolError("codec frame: compressed payload_len " + std::to_string(f.payload_len) +
                             " not below raw_len " + std::to_string(f.raw_len));
      return Status::Ok();
    case CodecKind::kFp8: {
      if (!is_fp8_input(f.dtype))
        return ProtocolError("codec frame: fp8 of dtype " + std::string(dtype_name(f.dtype)) +
                             " (expected bfloat16, float16 or float32)");
      const uint64_t es = dtype_size(f.dtype);
      if (f.raw_len % es != 0)
        return ProtocolError("codec frame: fp8 raw_len " + std::to_string(f.raw_len) +
                             " is not a whole number of " + std::string(dtype_name(f.dtype)) + " elements");
      const uint64_t elems = f.raw_len / es;
      const uint64_t groups = fp8_group_count(elems, f.fp8);
      if (elems != 0 && groups == 0)
        return ProtocolError("codec frame: fp8 grouping (heads " + std::to_string(f.fp8.heads) + ", head_dim " +
                             std::to_string(f.fp8.head_dim) + ", rows_per_group " +
                             std::to_string(f.fp8.rows_per_group) + ") does not fit " + std::to_string(elems) +
                             " elements");
      if (f.payload_len != groups * 4 + elems)
        return ProtocolError("codec frame: fp8 payload_len " + std::to_string(f.payload_len) + " != " +
                             std::to_string(groups) + " scales * 4 + " + std::to_string(elems) + " codes");
      return Status::Ok();
    }
  }
  return ProtocolError("codec frame: unknown codec");
}

}  // namespace

void write_frame_header(const FrameInfo& info, uint64_t checksum, uint8_t* out) {
  std::memcpy(out, kFrameMagic, 4);
  put<uint8_t>(out, 4, kFrameVersion);
  put<uint8_t>(out, 5, uint8_t(info.kind));
  put<uint8_t>(out, 6, uint8_t(info.dtype));
  put<uint8_t>(out, 7, info.has_checksum ? kFlagChecksum : 0);
  put<uint64_t>(out, 8, info.raw_len);
  put<uint64_t>(out, 16, info.payload_len);
  const bool fp8 = info.kind == CodecKind::kFp8;  // other codecs carry zeros there
  put<uint32_t>(out, 24, fp8 ? info.fp8.heads : 0);
  put<uint32_t>(out, 28, fp8 ? info.fp8.head_dim : 0);
  put<uint32_t>(out, 32, fp8 ? info.fp8.rows_per_group : 0);
  put<uint32_t>(out, 36, 0);
  put<uint64_t>(out, 40, info.has_checksum ? checksum : 0);
}

Result<FrameInfo> read_frame_header(const uint8_t* frame, size_t n, uint64_t* checksum) {
  if (n < kCodecHeaderBytes)
    return ProtocolError("codec frame: " + std::to_string(n) + " bytes, shorter than the " +
                         std::to_string(kCodecHeaderBytes) + "-byte header");
  util::ByteReader r(std::string_view(reinterpret_cast<const char*>(frame), kCodecHeaderBytes));
  char magic[4];
  uint8_t version = 0, kind = 0, dtype = 0, flags = 0;
  uint32_t reserved = 0;
  FrameInfo f;
  PDKV_RETURN_IF_ERROR(r.get(&magic, "codec magic"));
  PDKV_RETURN_IF_ERROR(r.get(&version, "codec version"));
  PDKV_RETURN_IF_ERROR(r.get(&kind, "codec kind"));
  PDKV_RETURN_IF_ERROR(r.get(&dtype, "codec dtype"));
  PDKV_RETURN_IF_ERROR(r.get(&flags, "codec flags"));
  PDKV_RETURN_IF_ERROR(r.get(&f.raw_len, "codec raw_len"));
  PDKV_RETURN_IF_ERROR(r.get(&f.payload_len, "codec payload_len"));
  PDKV_RETURN_IF_ERROR(r.get(&f.fp8.heads, "codec heads"));
  PDKV_RETURN_IF_ERROR(r.get(&f.fp8.head_dim, "codec head_dim"));
  PDKV_RETURN_IF_ERROR(r.get(&f.fp8.rows_per_group, "codec rows_per_group"));
  PDKV_RETURN_IF_ERROR(r.get(&reserved, "codec reserved"));
  PDKV_RETURN_IF_ERROR(r.get(checksum, "codec checksum"));
  if (std::memcmp(magic, kFrameMagic, 4) != 0) return ProtocolError("codec frame: bad magic (not a pdkv codec frame)");
  if (version != kFrameVersion)
    return VersionMismatch("codec frame: version " + std::to_string(version) + " (this pdkv speaks " +
                           std::to_string(kFrameVersion) + ")");
  if (kind > uint8_t(CodecKind::kFp8)) return ProtocolError("codec frame: unknown codec " + std::to_string(kind));
  if (dtype > uint8_t(DType::kI64)) return ProtocolError("codec frame: unknown dtype " + std::to_string(dtype));
  if (flags & ~kFlagChecksum) return ProtocolError("codec frame: unknown flags " + std::to_string(flags));
  if (reserved != 0) return ProtocolError("codec frame: reserved field is " + std::to_string(reserved));
  f.kind = CodecKind(kind);
  f.dtype = DType(dtype);
  f.has_checksum = flags & kFlagChecksum;
  if (!f.has_checksum && *checksum != 0) return ProtocolError("codec frame: checksum set without its flag");
  if (f.kind != CodecKind::kFp8 && (f.fp8.heads | f.fp8.head_dim | f.fp8.rows_per_group) != 0)
    return ProtocolError("codec frame: fp8 grouping set on a " + std::string(codec_kind_name(f.kind)) + " frame");
  PDKV_RETURN_IF_ERROR(check_payload(f));
  f.frame_len = kCodecHeaderBytes + f.payload_len;
  return f;
}

Status walk_payload_frames(const uint8_t* payload, uint64_t len, uint64_t capacity, std::string_view what,
                           uint32_t allowed, const std::function<Status(const PayloadFrame&)>& fn) {
  PayloadFrame f;
  uint64_t done = 0;  // bytes the frames so far decode to
  for (uint64_t at = 0; at < len; ++f.index) {
    f.offset = at;
    f.where = std::string(what) + ", codec frame " + std::to_string(f.index) + " (payload offset " +
              std::to_string(at) + "): ";
    auto info = peek_frame(payload + at, static_cast<size_t>(len - at));
    if (!info.ok()) return ProtocolError(f.where + info.status().message());
    if (info->frame_len > len - at)
      return ProtocolError(f.where + "frame_len " + std::to_string(info->frame_len) + " runs past the payload (" +
                           std::to_string(len - at) + " bytes left)");
    if (info->raw_len == 0) return ProtocolError(f.where + "raw_len is 0");
    if (!((allowed >> static_cast<unsigned>(info->kind)) & 1u))
      return ProtocolError(f.where + "codec " + std::string(codec_kind_name(info->kind)) + " was not asked for");
    auto out_len = decoded_size(*info, info->dtype);
    if (!out_len.ok()) return ProtocolError(f.where + out_len.status().message());
    if (*out_len > capacity - done)
      return ProtocolError(f.where + "raw_len " + std::to_string(*out_len) + " exceeds the " +
                           std::to_string(capacity - done) + " bytes left in its extents");
    f.info = *info;
    f.out_len = *out_len;
    PDKV_RETURN_IF_ERROR(fn(f));
    done += *out_len;
    at += info->frame_len;
  }
  if (done != capacity)
    return ProtocolError(std::string(what) + ": the codec frames decode to " + std::to_string(done) +
                         " bytes (sum of raw_len), its extents hold " + std::to_string(capacity));
  return Status::Ok();
}

}  // namespace pdkv::codec
