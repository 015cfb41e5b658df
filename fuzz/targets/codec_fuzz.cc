// libFuzzer target: the codec frame decoder (pdkv/codec.h), which reads frames a peer
// sends. The input is decoded as a frame by every codec into a bounded destination of
// each output dtype; it must decode or fail with a Status, never read or write out of
// bounds (ASan) or hit UB.
//
// Properties checked beyond "no crash, no leak, no UB":
//   * a decode that succeeds writes exactly decoded_size(peek_frame(x)) bytes;
//   * round trip: the input, encoded as a chunk by each lossless codec (with the
//     checksum), decodes back to itself bit for bit, and the frame passes peek_frame.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "pdkv/codec.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "codec_fuzz: property violated: %s\n", what);
  std::abort();
}

std::unique_ptr<pdkv::Codec> make(pdkv::CodecKind kind) {
  pdkv::CodecOptions o;
  o.kind = kind;
  o.checksum = pdkv::checksum_available();
  auto c = pdkv::Codec::create(o);
  return c.ok() ? std::move(c).value() : nullptr;
}

constexpr size_t kDstCap = 1 << 20;  // frames claiming more are OutOfRange here

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using pdkv::CodecKind;
  using pdkv::DType;
  static std::vector<uint8_t> dst(kDstCap);
  for (CodecKind kind : {CodecKind::kRaw, CodecKind::kZstd, CodecKind::kLz4, CodecKind::kFp8}) {
    auto c = make(kind);
    if (!c) continue;
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32, DType::kU8}) {
      size_t written = 0;
      const pdkv::Status st = c->decode(data, size, dt, dst.data(), dst.size(), &written);
      if (!st.ok()) continue;
      auto info = pdkv::peek_frame(data, size);
      if (!info.ok()) fail("decode accepted a frame peek_frame rejects");
      auto n = pdkv::decoded_size(*info, dt);
      if (!n.ok() || *n != written) fail("decode wrote a size other than decoded_size");
    }
    if (kind == CodecKind::kFp8 || size > kDstCap) continue;
    // Round trip of the input as a chunk of bf16 (odd sizes carry a partial element).
    std::vector<uint8_t> frame;
    if (!c->encode(data, size, DType::kBF16, frame).ok()) fail("lossless encode failed");
    if (!pdkv::peek_frame(frame.data(), frame.size()).ok()) fail("own frame rejected by peek_frame");
    size_t written = 0;
    if (!c->decode(frame.data(), frame.size(), DType::kBF16, dst.data(), dst.size(), &written).ok())
      fail("own frame failed to decode");
    if (written != size || (size && std::memcmp(dst.data(), data, size) != 0)) fail("lossless round trip differs");
  }
  return 0;
}
