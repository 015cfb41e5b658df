// For tests, fuzzers and the fake driver only: the CUDA built-ins fp8_codec.cu and
// strided_copy.cu use, for running their kernels on the host as a one-thread grid
// (cpp/tests/test_fp8_kernel.cc, cpp/tests/test_strided_kernel.cc,
// fuzz/targets/fp8_frames_fuzz.cc, tests/fakecuda/fakecuda.cc). Include it, then the .cu, in one translation unit;
// call a kernel as a plain function with its Fp8Launch. Host pointers stand in for
// device ones. What this cannot show (a GPU's float unit, a CTA of many threads) is
// left to bench/gpu_check.sh.
#pragma once

#include <cmath>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

namespace {

struct PdkvHostDim3 {
  unsigned x;
};
// A one-thread grid by default. A kernel without __syncthreads (dequantize, the strided
// copy) may also be run as a wider grid: set these and call it once per (block,
// thread). Per host thread: the fake driver runs kernels on several stream threads.
thread_local PdkvHostDim3 threadIdx{0}, blockIdx{0}, blockDim{1}, gridDim{1};

struct uint4 {
  unsigned x, y, z, w;
};

inline void __syncthreads() {}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __float2int_rn(float f) { return static_cast<int>(std::nearbyint(f)); }  // default mode: to nearest even
inline float __fmul_rn(float a, float b) { return a * b; }
inline unsigned atomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v > old) *p = v;
  return old;
}

}  // namespace
