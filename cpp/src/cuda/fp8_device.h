// The FP8 codec on the GPU: quantize a batch of device extents into the codec frames
// the host codec (pdkv/codec.h, CodecKind::kFp8) writes for the same bytes, and
// dequantize such frames into device extents, with the kernels of fp8_codec.cu.
//
//   plan_fp8_batch   host side, no driver: which frame covers which rows, where its
//                    scales and codes sit in the payload (fp8_abi.h), checked.
//   DeviceFp8        the loaded kernels and, per device, a stream and device scratch
//                    (descriptor tables, scales + codes) reused from batch to batch.
//
// The wire bytes are the host codec's, bit for bit (frame headers and checksums are
// written on the host from the same fields), so a GPU sender talks to a CPU receiver
// and back. tests/fakecuda emulates both kernels from docs/compression.md's rules.
//
// Thread safety: DeviceFp8 is thread-safe (one batch at a time per device).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "cuda/driver.h"
#include "cuda/fp8_abi.h"
#include "pdkv/codec.h"
#include "pdkv/status.h"

namespace pdkv::cuda {

// The frames of one batch and where their parts go in its payload.
struct Fp8Plan {
  std::vector<Fp8Piece> pieces;
  std::vector<Fp8FrameDesc> frames;
  std::vector<uint64_t> frame_offset;  // payload offset of each frame's 48-byte header
  std::vector<uint64_t> raw_len;       // each frame's raw_len
  uint64_t total_groups = 0;
  uint64_t payload_bytes = 0;
};

// The plan of the frames the host codec writes for the extents ext[0, n) of `dtype`
// (one frame per extent, or one for all of them when `one_frame`, as the tcp encoder
// chooses). Every extent must be whole rows (heads x head_dim elements) at an
// address aligned to its element: InvalidArgument naming the extent otherwise.
Result<Fp8Plan> plan_fp8_batch(const iovec* ext, size_t n, bool one_frame, DType dtype, const Fp8Grouping& g);

// One fp8 frame of a received payload: its offset there and its (validated) header.
struct Fp8FrameAt {
  uint64_t offset;
  FrameInfo info;
};
// The plan that dequantizes `frames` (one dtype and grouping, decoding to exactly the
// bytes of dst[0, n)) into the device extents dst[0, n). InvalidArgument when an
// extent is not whole rows or not aligned (the caller then decodes on the host).
Result<Fp8Plan> plan_fp8_frames(const std::vector<Fp8FrameAt>& frames, const iovec* dst, size_t n);

// The codec frames of a compressed tcp batch (docs/wire.md, type 11), checked by the
// walk the host decoder (tcp decode_payload) uses, codec::walk_payload_frames: ProtocolError
// naming the frame and field unless every header is valid, the frames tile the payload
// and their decoded sizes add up to `capacity`, the bytes of the destination extents.
// `what` names the payload in errors; `allowed`: bit (1 << CodecKind) per codec accepted
// (a read's initiator accepts raw and the codec it asked for).
Result<std::vector<Fp8FrameAt>> read_payload_frames(const uint8_t* payload, uint64_t len, uint64_t capacity,
                                                    std::string_view what = "compressed write", uint32_t allowed = ~0u);
// The XXH3 of each frame's codes + scales that carries one: DataCorrupted on a mismatch.
Status verify_fp8_checksums(const uint8_t* payload, const std::vector<Fp8FrameAt>& frames);

class DeviceFp8 {
 public:
  // NotSupported (naming why) without a CUDA driver, or when pdkv was built without nvcc.
  static Result<std::shared_ptr<DeviceFp8>> create();
  ~DeviceFp8();
  DeviceFp8(const DeviceFp8&) = delete;
  DeviceFp8& operator=(const DeviceFp8&) = delete;

  // OK when the kernels load on `device` (loaded once; NotSupported with the driver's
  // reason when the fatbin has no code for that GPU).
  Status ready(int device);

  // Quantizes the device extents of `plan` (plan_fp8_batch) into `out`: the batch's
  // codec frames back to back, headers and (with `checksum`) XXH3 of each frame's
  // codes + scales included. A driver failure (a launch, an illegal address) is the
  // driver's error; nothing is left running on return.
  Status encode(int device, const Fp8Plan& plan, DType dtype, const Fp8Grouping& g, bool checksum,
                std::vector<uint8_t>& out);
  // Dequantizes the payload's scales + codes (frames already validated and checked by
  // the caller; `plan` from plan_fp8_batch over the destination extents, with the
  // payload's frame layout) into the device extents.
  Status decode(int device, const uint8_t* payload, uint64_t len, const Fp8Plan& plan, DType dtype,
                const Fp8Grouping& g);

 private:
  struct PerDevice;
  explicit DeviceFp8(const CudaDriver* drv);
  Result<PerDevice*> device_state(int device);  // mu_ held
  Status upload(PerDevice& d, const Fp8Plan& plan, uint64_t buf_bytes);
  Status launch(PerDevice& d, CUfunction fn, const Fp8Plan& plan, DType dtype, const Fp8Grouping& g,
                const char* what);

  const CudaDriver* drv_;
  std::mutex mu_;  // one batch at a time; guards devices_
  std::map<int, std::unique_ptr<PerDevice>> devices_;
};

}  // namespace pdkv::cuda
