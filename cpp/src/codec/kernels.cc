#include "codec/kernels.h"

#include <atomic>
#include <string>

namespace pdkv {
namespace {

bool cpu_has_avx2() {
#if defined(PDKV_CODEC_AVX2)
  return __builtin_cpu_supports("avx2");
#else
  return false;  // not an x86-64 build (or a compiler without the AVX2 file)
#endif
}

CodecKernels best_kernels() { return cpu_has_avx2() ? CodecKernels::kAvx2 : CodecKernels::kVector; }

std::atomic<CodecKernels>& current() {
  static std::atomic<CodecKernels> k{best_kernels()};
  return k;
}

}  // namespace

std::string_view codec_kernels_name(CodecKernels k) {
  switch (k) {
    case CodecKernels::kScalar: return "scalar";
    case CodecKernels::kVector: return "vector";
    case CodecKernels::kAvx2: return "avx2";
  }
  return "unknown";
}

Result<CodecKernels> parse_codec_kernels(std::string_view name) {
  for (CodecKernels k : {CodecKernels::kScalar, CodecKernels::kVector, CodecKernels::kAvx2})
    if (name == codec_kernels_name(k)) return k;
  return InvalidArgument("unknown codec kernels '" + std::string(name) + "' (expected scalar, vector or avx2)");
}

std::vector<CodecKernels> codec_kernels_available() {
  std::vector<CodecKernels> out{CodecKernels::kScalar, CodecKernels::kVector};
  if (cpu_has_avx2()) out.push_back(CodecKernels::kAvx2);
  return out;
}

CodecKernels codec_kernels() { return current().load(std::memory_order_relaxed); }

Status set_codec_kernels(CodecKernels k) {
  if (k == CodecKernels::kAvx2 && !cpu_has_avx2())
    return NotSupported("codec kernels 'avx2': this CPU (or build) has no AVX2");
  if (k > CodecKernels::kAvx2) return InvalidArgument("unknown codec kernels " + std::to_string(int(k)));
  current().store(k, std::memory_order_relaxed);
  return Status::Ok();
}

namespace codec {

void fp8_quantize_fast(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                       uint8_t* codes) {
#if defined(PDKV_CODEC_AVX2)
  if (codec_kernels() == CodecKernels::kAvx2) return fp8_quantize_avx2(src, elems, dtype, g, scales, codes);
#endif
  fp8_quantize_baseline(src, elems, dtype, g, scales, codes);
}

void fp8_dequantize_fast(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                         DType dst_dtype, uint8_t* dst) {
#if defined(PDKV_CODEC_AVX2)
  if (codec_kernels() == CodecKernels::kAvx2) return fp8_dequantize_avx2(scales, codes, elems, g, dst_dtype, dst);
#endif
  fp8_dequantize_baseline(scales, codes, elems, g, dst_dtype, dst);
}

bool planes_fast() { return codec_kernels() != CodecKernels::kScalar; }

}  // namespace codec
}  // namespace pdkv
