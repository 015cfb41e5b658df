// The FP8 loops vectorised for the build's baseline instruction set (SSE2 on x86-64).
#define PDKV_FP8_KERNEL_NS vec_baseline
#include "codec/fp8_kernels.h"
#include "codec/kernels.h"

namespace pdkv::codec {

void fp8_quantize_baseline(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                           uint8_t* codes) {
  vec_baseline::quantize_any(src, elems, dtype, g, scales, codes);
}

void fp8_dequantize_baseline(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                             DType dst_dtype, uint8_t* dst) {
  vec_baseline::dequantize_any(scales, codes, elems, g, dst_dtype, dst);
}

}  // namespace pdkv::codec
