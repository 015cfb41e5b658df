// One launch copies many extents (the scattered blocks of a KV transfer): CTAs
// stride over the extent list, threads over each extent's bytes, 16 bytes at a time
// when everything is 16-byte aligned. Extents are pre-split to at most 64 KiB at
// prepare time so a transfer spreads over all SMs. Built into a fatbin by CMake
// and loaded with cuModuleLoadData (no CUDA runtime dependency).
extern "C" __global__ void pdkv_batch_copy(const unsigned long long* __restrict__ src,
                                           const unsigned long long* __restrict__ dst,
                                           const unsigned long long* __restrict__ len, unsigned n) {
  for (unsigned e = blockIdx.x; e < n; e += gridDim.x) {
    const char* s = reinterpret_cast<const char*>(src[e]);
    char* d = reinterpret_cast<char*>(dst[e]);
    const unsigned long long bytes = len[e];
    if (((src[e] | dst[e] | bytes) & 15ull) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(s);
      uint4* d4 = reinterpret_cast<uint4*>(d);
      for (unsigned long long i = threadIdx.x; i < (bytes >> 4); i += blockDim.x) d4[i] = s4[i];
    } else {
      for (unsigned long long i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
    }
  }
}
