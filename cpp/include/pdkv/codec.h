// pdkv/codec.h: compression of KV bytes, one chunk at a time.
//
// A codec turns one chunk of KV bytes into one self-describing frame and back. Chunks
// are independent, so a transport can pipeline them (encode chunk i while chunk i-1 is
// on the wire, decode each straight into its destination). Codecs:
//   kRaw    the bytes as they are (useful with a checksum alone)
//   kZstd   lossless: byte-plane split of the elements, then zstd (fast levels)
//   kLz4    lossless: byte-plane split, then LZ4 (fastest, lower ratio)
//   kFp8    lossy, opt-in: FP8 e4m3 codes with one fp32 scale per group (block x head),
//           dequantized into the receiver's dtype (bfloat16, float16 or float32)
// The frame format and the exact FP8 rounding are in docs/compression.md.
//
// A frame is untrusted wire input: decode_frame checks every header field and length
// against the caller's buffer before touching it; a malformed frame is a
// ProtocolError naming the field, a checksum mismatch is DataCorrupted.
//
// Availability: zstd, LZ4 and the checksum (xxHash XXH3-64) need their libraries at
// build time; codec_available() says what this build has, and a missing one is
// NotSupported when asked for (never a silent fallback).
//
// Thread safety: a Codec holds scratch buffers and compression contexts: one Codec per
// thread (they are cheap to create). The free functions are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv {

enum class CodecKind : uint8_t { kRaw = 0, kZstd = 1, kLz4 = 2, kFp8 = 3 };

std::string_view codec_kind_name(CodecKind kind);
// Parses "raw", "zstd", "lz4", "fp8".
Result<CodecKind> parse_codec_kind(std::string_view name);
// Whether this build can encode/decode `kind` (kRaw and kFp8 always; kZstd/kLz4 when
// their library was found at configure time).
bool codec_available(CodecKind kind);
// Whether this build can checksum frames (xxHash found at configure time).
bool checksum_available();

// Which implementation runs the codecs' element loops (FP8 quantize / dequantize and
// the byte-plane split / merge). All give bit-identical output; the default is the
// fastest this CPU runs (kAvx2 on x86-64 CPUs with AVX2, else kVector). Tests and
// benchmarks switch it to compare. Process-wide; thread-safe (a switch applies to
// the loops that start after it).
enum class CodecKernels : uint8_t {
  kScalar = 0,  // the reference loops, one element at a time
  kVector = 1,  // branch-free loops the compiler vectorises for the build's baseline ISA
  kAvx2 = 2,    // the same loops compiled for AVX2 (x86-64 builds, AVX2 CPUs)
};
std::string_view codec_kernels_name(CodecKernels k);
Result<CodecKernels> parse_codec_kernels(std::string_view name);  // "scalar", "vector", "avx2"
// The paths this process can run (kScalar and kVector always).
std::vector<CodecKernels> codec_kernels_available();
CodecKernels codec_kernels();
// NotSupported for kAvx2 on a CPU (or build) without it.
Status set_codec_kernels(CodecKernels k);

// How the elements of a chunk group for FP8 scales. The chunk is read as rows of
// `heads` x `head_dim` elements (NHD: heads = the block's kv heads; HND or one head's
// block: heads = 1); one scale covers `rows_per_group` consecutive rows of one head:
// per-block-per-head scales are rows_per_group = tokens per block. The element count
// must be a multiple of heads * head_dim; the last row group may be shorter.
struct Fp8Grouping {
  uint32_t heads = 1;
  uint32_t head_dim = 1;
  uint32_t rows_per_group = 128;
};

struct CodecOptions {
  CodecKind kind = CodecKind::kZstd;
  // zstd: compression level (1 = fast; negative = faster still). Others ignore it.
  int level = 1;
  // Append an XXH3-64 checksum of the uncompressed bytes (for kFp8: of the codes and
  // scales, which fix the dequantized output exactly); the receiver verifies it.
  bool checksum = false;
  Fp8Grouping fp8;
};

// What a frame header says (after validation).
struct FrameInfo {
  CodecKind kind = CodecKind::kRaw;
  DType dtype = DType::kU8;       // element type of the encoded chunk
  bool has_checksum = false;
  uint64_t raw_len = 0;           // bytes of the chunk as encoded (in `dtype`)
  uint64_t payload_len = 0;       // bytes after the header
  uint64_t frame_len = 0;         // header + payload
  Fp8Grouping fp8;                // meaningful for kFp8
};

// Frame header size in bytes; every frame is at least this long.
constexpr size_t kCodecHeaderBytes = 48;
// Largest chunk one frame may carry (1 GiB): chunks are pipeline units, and LZ4 and
// the size checks stay far from 32-bit limits.
constexpr uint64_t kCodecMaxChunkBytes = uint64_t(1) << 30;

// Reads and validates a frame header. `n` is how many bytes are available; the
// payload need not be complete (a streaming reader learns frame_len from it).
Result<FrameInfo> peek_frame(const uint8_t* frame, size_t n);

// Bytes decode_frame writes for `info` dequantized/decoded into `dst_dtype`
// (lossless frames: raw_len, and dst_dtype must equal the frame's dtype).
Result<uint64_t> decoded_size(const FrameInfo& info, DType dst_dtype);

class Codec {
 public:
  // Fails with NotSupported if this build lacks the codec or the checksum, and
  // InvalidArgument for an inconsistent option (level, grouping).
  static Result<std::unique_ptr<Codec>> create(const CodecOptions& options);
  ~Codec();
  Codec(const Codec&) = delete;
  Codec& operator=(const Codec&) = delete;

  const CodecOptions& options() const;

  // Upper bound of the frame size for a chunk of `len` bytes of `dtype`.
  size_t max_frame_size(size_t len, DType dtype) const;

  // Encodes `len` bytes of elements of `dtype` into `out` (replaced, capacity kept for
  // reuse). kFp8 accepts bfloat16, float16 or float32 and a length that is a whole
  // number of rows (InvalidArgument otherwise); lossless codecs accept any dtype and
  // any length (a trailing partial element is carried as is).
  Status encode(const uint8_t* src, size_t len, DType dtype, std::vector<uint8_t>& out);

  // Decodes one frame of `frame_len` bytes into dst[0, dst_cap) as `dst_dtype` and
  // sets *written. Lossless frames need dst_dtype == the frame's dtype. Never reads
  // past frame[frame_len) nor writes past dst[dst_cap): a frame that does not fit is
  // ProtocolError (the peer lied) or OutOfRange (dst too small for an honest frame).
  Status decode(const uint8_t* frame, size_t frame_len, DType dst_dtype, uint8_t* dst, size_t dst_cap,
                size_t* written);

 private:
  struct Impl;
  explicit Codec(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdkv
