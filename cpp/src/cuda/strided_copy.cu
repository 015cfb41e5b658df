// One launch copies many strided runs (strided_abi.h): CTAs stride over the run list,
// a CTA's threads over the run's (piece, word) pairs, so pieces of 256 bytes keep a
// whole CTA busy. Words are 16 bytes when every address, stride and the piece length
// are 16-byte aligned, else 8, 4 or 1 byte(s): correct for any alignment and length
// (fp8 rows of 13 bytes, odd offsets). Built into a fatbin by CMake and loaded with
// cuModuleLoadData (no CUDA runtime dependency). The same source runs as host code
// in the fake driver and the unit test (host_shim.h); keep it to what the shim has.
#include "strided_abi.h"

namespace pdkv_strided {

// Index type I: 32-bit division where the run's words fit below 2^31 (every run cut by
// append_run does), 64-bit otherwise.
template <typename W, typename I>
__device__ __forceinline__ void copy_words(const pdkv::cuda::StridedRun& r) {
  const I words = static_cast<I>(r.len / sizeof(W));
  const I total = words * static_cast<I>(r.count);
  const char* src = reinterpret_cast<const char*>(r.src);
  char* dst = reinterpret_cast<char*>(r.dst);
  for (I i = threadIdx.x; i < total; i += blockDim.x) {
    const I piece = i / words, w = i - piece * words;
    reinterpret_cast<W*>(dst + piece * r.dst_stride)[w] = reinterpret_cast<const W*>(src + piece * r.src_stride)[w];
  }
}

template <typename W>
__device__ __forceinline__ void copy_run(const pdkv::cuda::StridedRun& r) {
  if ((r.len / sizeof(W)) * r.count < 0x80000000ull)  // i + blockDim.x cannot wrap
    copy_words<W, unsigned>(r);
  else
    copy_words<W, unsigned long long>(r);
}

}  // namespace pdkv_strided

extern "C" __global__ void pdkv_strided_copy(const pdkv::cuda::StridedRun* __restrict__ runs, unsigned n) {
  for (unsigned e = blockIdx.x; e < n; e += gridDim.x) {
    const pdkv::cuda::StridedRun r = runs[e];
    if (r.len == 0 || r.count == 0) continue;
    // The strides matter only between pieces.
    const unsigned long long a = r.src | r.dst | r.len | (r.count > 1 ? (r.src_stride | r.dst_stride) : 0ull);
    if ((a & 15ull) == 0)
      pdkv_strided::copy_run<uint4>(r);
    else if ((a & 7ull) == 0)
      pdkv_strided::copy_run<unsigned long long>(r);
    else if ((a & 3ull) == 0)
      pdkv_strided::copy_run<unsigned>(r);
    else
      pdkv_strided::copy_run<unsigned char>(r);
  }
}
