// The receiver's GPU path for a compressed write into device memory (tcp
// DeviceStaging::decode): arbitrary payload bytes and destination extents go through
// the frame checks (read_payload_frames), the plan (plan_fp8_frames) and, when both
// accept them, the dequantize kernel itself, run on the host (cuda/host_shim.h) over
// host buffers of exactly the extents' and the payload's sizes, so ASan sees any byte
// the kernel would touch outside them on a GPU.
//
// Input: byte 0 = number of destination extents (1..8), then per extent a little-endian
// u16 length (in elements of the first frame's dtype, 0 allowed), then the payload.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/fp8_device.h"
#include "cuda/host_shim.h"
#include "cuda/fp8_codec.cu"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdkv;
  if (size < 1) return 0;
  const size_t n = 1 + data[0] % 8;
  if (size < 1 + 2 * n) return 0;
  std::vector<uint16_t> elems(n);
  for (size_t i = 0; i < n; ++i) elems[i] = uint16_t(data[1 + 2 * i] | data[2 + 2 * i] << 8);
  const uint8_t* p = data + 1 + 2 * n;
  const size_t len = size - 1 - 2 * n;
  std::vector<uint8_t> payload(p, p + len);  // exactly `len` bytes: ASan bounds
  // The element size comes from the first frame's dtype (byte 6 of its header).
  const size_t es = len > 6 && payload[6] == 0 ? 4 : 2;
  std::vector<std::vector<uint8_t>> ext(n);
  std::vector<iovec> dst(n);
  uint64_t capacity = 0;
  for (size_t i = 0; i < n; ++i) {
    ext[i].resize(size_t(elems[i]) * es);
    dst[i] = iovec{ext[i].data(), ext[i].size()};
    capacity += ext[i].size();
  }
  auto frames = cuda::read_payload_frames(payload.data(), payload.size(), capacity);
  if (!frames.ok()) return 0;
  (void)cuda::verify_fp8_checksums(payload.data(), *frames);
  auto plan = cuda::plan_fp8_frames(*frames, dst.data(), dst.size());
  if (!plan.ok() || plan->total_groups == 0) return 0;
  const FrameInfo& f = frames->front().info;
  cuda::Fp8Launch a{};
  a.pieces = reinterpret_cast<uint64_t>(plan->pieces.data());
  a.frames = reinterpret_cast<uint64_t>(plan->frames.data());
  a.buf = reinterpret_cast<uint64_t>(payload.data());
  a.total_groups = plan->total_groups;
  a.npieces = uint32_t(plan->pieces.size());
  a.nframes = uint32_t(plan->frames.size());
  a.heads = f.fp8.heads;
  a.head_dim = f.fp8.head_dim;
  a.rows_per_group = f.fp8.rows_per_group;
  a.dtype = uint32_t(f.dtype);
  pdkv_fp8_dequantize(a);
  return 0;
}
