// The argument layout of the strided-copy kernel (strided_copy.cu), shared by the host
// code that launches it (strided_copy.cc), the fake driver that runs it as host code
// (tests/fakecuda/fakecuda.cc includes the kernel source) and the host-build unit
// test (cpp/tests/test_strided_kernel.cc).
//
// A run is `count` pieces of `len` bytes: piece i is copied from src + i * src_stride
// to dst + i * dst_stride. Addresses are device addresses (or pinned host memory the
// GPU can reach). The kernel's only parameters are (const StridedRun* runs, unsigned n).
#pragma once

#include <cstdint>

namespace pdkv::cuda {

struct StridedRun {
  uint64_t src;
  uint64_t dst;
  uint64_t len;
  uint64_t count;
  uint64_t src_stride;
  uint64_t dst_stride;
};

static_assert(sizeof(StridedRun) == 48, "StridedRun layout is shared with the fake driver");

inline constexpr const char* kStridedCopyKernel = "pdkv_strided_copy";
// A launch's CTAs take one run at a time; runs are cut (strided_copy.h) to at most
// this many bytes so that a transfer of a few big runs still spreads over every SM.
inline constexpr uint64_t kStridedRunChunk = 64 << 10;
inline constexpr unsigned kStridedCopyThreads = 256;
inline constexpr unsigned kStridedCopyMaxGrid = 8192;

}  // namespace pdkv::cuda
