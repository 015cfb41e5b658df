// The tcp transport's path for device (CUDA) memory: sockets only read and write
// host memory, so device bytes travel through pinned host buffers (cuda/staging.h).
//
//   write, initiator: each batch is gathered from the GPU into a pooled pinned
//                     buffer on the staging thread (in order, while the previous
//                     batch is on the wire), then sent from there.
//   read, target:     the requested extents are gathered on the staging thread and
//                     sent as the read response (respond_read).
//   receiving:        the payload lands in pinned buffers that a ScatterPipe copies
//                     to the GPU double buffered (FrameReceiver::begin_staged_rx);
//                     the ack follows the last completed copy.
//   Every copy between the GPU and a pinned buffer is one launch of the strided-copy
//   kernel per batch (cuda/strided_copy.h) over the batch's runs, strided descriptors
//   as they are: no iovec or cuMemcpyAsync per piece (where the kernel does not load,
//   or BenchSwitch::kDevicePieces=1, one cuMemcpyAsync per piece as before).
//   compressed write, initiator (encode, on an encoder thread): fp8 is quantized on
//                     the GPU (cuda/fp8_device.h) and only the codes + scales come
//                     to the host; lossless (or fp8 where the kernels do not load) is
//                     gathered into a pinned buffer and encoded there by the host codec.
//                     Either way the frames are the host codec's, byte for byte.
//   compressed write, receiver (decode, on a decode thread): fp8 frames go to the
//                     GPU as they came and are dequantized into place; anything else
//                     is decoded on the host and copied in.
//
// The CUDA driver is loaded on first use (stager()), never at start-up: cuInit in a
// process that later forks would break CUDA in its children.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/fp8_device.h"
#include "cuda/staging.h"
#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "transport/tcp/scatter.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

class TcpConn;
class TcpTransport;
class Encoder;
struct EncodedBatch;

// The strided-copy kernel's runs for `runs` (one level each): a two-level run becomes
// one run per repetition, in order (bounded: a frame holds at most kMaxStridedPieces
// pieces, a prepared batch as many).
void append_device_runs(const PieceRun* runs, size_t n, std::vector<cuda::DeviceRun>& out);

class DeviceStaging {
 public:
  DeviceStaging(TcpTransport& t, uint64_t chunk_bytes, uint32_t buffers)
      : t_(t), chunk_bytes_(chunk_bytes), buffers_(buffers) {}
  ~DeviceStaging() { stop(); }
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // The pinned buffer pool, created on first use; NotSupported naming the reason
  // without a usable CUDA driver.
  Result<std::shared_ptr<cuda::Stager>> stager();
  // Runs `f` on the staging thread, after the tasks queued before it; on the
  // calling thread once stopped (the task then fails fast: the agent is shutting down).
  void run(std::function<void()> f);
  // Lets the queued tasks finish and joins the staging thread.
  void stop();

  // Copies the device extents src[0..n) of `device` back to back into a pooled
  // buffer, waiting for a free one until `deadline` or until `abandon()` says to
  // give up. Runs on the staging thread.
  Result<std::shared_ptr<cuda::PinnedBuffer>> gather(int device, const iovec* src, size_t n,
                                                     Clock::time_point deadline, const std::function<bool()>& abandon);
  // The same for the runs runs[0..n) (a lazy prepared write's, scatter.h): one
  // strided-kernel launch, no iovec per piece.
  Result<std::shared_ptr<cuda::PinnedBuffer>> gather_runs(int device, const PieceRun* runs, size_t n,
                                                          Clock::time_point deadline,
                                                          const std::function<bool()>& abandon);
  // Answers the read request `h` on c for device memory: gathers the runs `src` (its
  // descriptors as they came, one strided-kernel launch) on the staging thread and
  // queues the response; fails the connection if that fails. `pins` and `gens` are
  // held until the bytes are gathered (pins: until sent).
  void respond_read(const std::shared_ptr<TcpConn>& c, const FrameHeader& h, std::vector<PieceRun> src,
                    std::vector<RegionPin> pins, GenPin gens, uint64_t bytes, int device);

  // Encodes the device extents src[0..n) of `device` as one kWriteZ payload into
  // `out` with `kind`, the frames `enc` would write for the same bytes in host memory
  // (see the file comment). Waits for a staging buffer until `deadline` / `abandon()`.
  Status encode(Encoder& enc, CodecKind kind, int device, const iovec* src, uint32_t n, Clock::time_point deadline,
                const std::function<bool()>& abandon, EncodedBatch& out);
  // The same for a compressed read response of device memory (the target's side):
  // with the codec, dtype and FP8 grouping the reader asked for (its ReadZSpec), not
  // this agent's options. On an encoder thread.
  Status encode_with(Encoder& enc, const CodecOptions& codec, DType dtype, int device, const iovec* src, uint32_t n,
                     Clock::time_point deadline, const std::function<bool()>& abandon, EncodedBatch& out);
  // Decodes a kWriteZ (or kReadRespZ) payload into the device extents dst[0..n) of
  // `device`. Errors as Decoder::decode (`what` names the payload, `allowed` the codecs
  // accepted): ProtocolError for a malformed payload, DataCorrupted for a checksum
  // mismatch; a driver failure is the driver's error.
  Status decode(int device, const uint8_t* payload, uint64_t len, const iovec* dst, size_t n,
                const char* what = "compressed write", uint32_t allowed = ~0u);
  // Whether fp8 of device memory runs as GPU kernels on real hardware here (what
  // compression mode auto assumes to be far faster than any socket); false on an
  // emulated driver, without nvcc, or when the kernels do not load on `device`.
  bool gpu_fp8_on_hardware(int device);

 private:
  void loop();
  // The GPU FP8 codec, created on first use; NotSupported naming why there is none.
  Result<std::shared_ptr<cuda::DeviceFp8>> fp8(int device);
  // encode / encode_with: FP8 on the GPU where the kernels take the extents, else
  // gathered into a pinned buffer and encoded there by `host_encode`.
  Status encode_device(CodecKind kind, DType dtype, const Fp8Grouping& fp8, bool checksum, int device,
                       const iovec* src, uint32_t n, Clock::time_point deadline, const std::function<bool()>& abandon,
                       EncodedBatch& out, const std::function<Status(const iovec*, uint32_t)>& host_encode);

  TcpTransport& t_;
  const uint64_t chunk_bytes_;
  const uint32_t buffers_;
  std::mutex mu_;  // guards everything below (a leaf lock: see conn.h)
  std::shared_ptr<cuda::Stager> stager_;
  std::shared_ptr<cuda::DeviceFp8> fp8_;
  Status fp8_status_;        // why there is no fp8_ (once tried)
  bool fp8_tried_ = false;
  bool fp8_fallback_logged_ = false;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::thread th_;
  bool stop_ = false;
};

}  // namespace pdkv::tcp
