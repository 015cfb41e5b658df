// Which implementation of the codec's element loops runs (pdkv/codec.h CodecKernels):
// the scalar reference, the compiler-vectorised baseline, or AVX2, chosen once from
// the CPU and switchable (tests compare them; benchmarks time each).
#pragma once

#include <cstdint>

#include "pdkv/codec.h"

namespace pdkv::codec {

// The loops of the current path (codec_kernels()).
void fp8_quantize_fast(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                       uint8_t* codes);
void fp8_dequantize_fast(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                         DType dst_dtype, uint8_t* dst);
// Whether byte planes use their per-size loops (false: the generic strided loop).
bool planes_fast();

// Per path (fp8_vec.cc, fp8_avx2.cc; the latter only in x86-64 builds).
void fp8_quantize_baseline(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                           uint8_t* codes);
void fp8_dequantize_baseline(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                             DType dst_dtype, uint8_t* dst);
void fp8_quantize_avx2(const uint8_t* src, uint64_t elems, DType dtype, const Fp8Grouping& g, uint8_t* scales,
                       uint8_t* codes);
void fp8_dequantize_avx2(const uint8_t* scales, const uint8_t* codes, uint64_t elems, const Fp8Grouping& g,
                         DType dst_dtype, uint8_t* dst);

}  // namespace pdkv::codec
