#include "cuda/fp8_device.h"

#include <algorithm>
#include <string>

#include "codec/entropy.h"
#include "codec/fp8.h"
#include "codec/frame.h"

// Generated from fp8_codec.cu by CMake (cpp/cmake/fatbin.cmake); size 0 without nvcc.
extern const unsigned char kPdkvFp8Fatbin[];
extern const unsigned long kPdkvFp8FatbinSize;

namespace pdkv::cuda {
namespace {

constexpr unsigned kThreads = 128;      // per CTA (one CTA per scale group at a time)
constexpr uint64_t kMaxGrid = 1u << 16;  // CTAs; they stride over the groups beyond

bool fp8_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

// Appends ext[0, n) as pieces of whole rows, numbered from `row`; returns the next row.
Result<uint64_t> add_pieces(const iovec* ext, size_t n, uint64_t row_bytes, size_t esize, uint64_t row,
                            std::vector<Fp8Piece>& out) {
  for (size_t i = 0; i < n; ++i) {
    const uint64_t addr = reinterpret_cast<uint64_t>(ext[i].iov_base), len = ext[i].iov_len;
    if (len % row_bytes != 0 || addr % esize != 0)
      return InvalidArgument("fp8 on device memory: extent " + std::to_string(i) + " (" + std::to_string(len) +
                             " bytes) is not whole rows of " + std::to_string(row_bytes) +
                             " bytes at an address aligned to its element");
    if (len == 0) continue;
    out.push_back(Fp8Piece{addr, row, len / row_bytes});
    row += len / row_bytes;
  }
  return row;
}

// A frame of `rows` rows starting at batch row `row`, its header at payload offset `at`.
void add_frame(Fp8Plan& p, uint64_t at, uint64_t row, uint64_t rows, uint64_t raw_len, const Fp8Grouping& g) {
  const uint64_t groups = (rows + g.rows_per_group - 1) / g.rows_per_group * g.heads;
  const uint64_t elems = rows * g.heads * g.head_dim;
  p.frames.push_back(Fp8FrameDesc{p.total_groups, row, rows, at + kCodecHeaderBytes,
                                  at + kCodecHeaderBytes + groups * 4});
  p.frame_offset.push_back(at);
  p.raw_len.push_back(raw_len);
  p.total_groups += groups;
  p.payload_bytes = at + kCodecHeaderBytes + groups * 4 + elems;
}

}  // namespace

Result<Fp8Plan> plan_fp8_batch(const iovec* ext, size_t n, bool one_frame, DType dtype, const Fp8Grouping& g) {
  if (!fp8_dtype(dtype))
    return InvalidArgument("fp8 codec encodes bfloat16, float16 or float32, not " + std::string(dtype_name(dtype)));
  if (g.heads == 0 || g.head_dim == 0 || g.rows_per_group == 0)
    return InvalidArgument("fp8 grouping needs heads, head_dim and rows_per_group >= 1");
  const size_t esize = dtype_size(dtype);
  const uint64_t row_bytes = uint64_t(g.heads) * g.head_dim * esize;
  Fp8Plan p;
  PDKV_ASSIGN_OR_RETURN(uint64_t rows, add_pieces(ext, n, row_bytes, esize, 0, p.pieces));
  if (one_frame) {
    if (rows) add_frame(p, 0, 0, rows, rows * row_bytes, g);
    return p;
  }
  for (const Fp8Piece& piece : p.pieces)
    add_frame(p, p.payload_bytes, piece.first_row, piece.rows, piece.rows * row_bytes, g);
  return p;
}

Result<Fp8Plan> plan_fp8_frames(const std::vector<Fp8FrameAt>& frames, const iovec* dst, size_t n) {
  if (frames.empty()) return InvalidArgument("no fp8 frames");
  const FrameInfo& first = frames.front().info;
  const Fp8Grouping& g = first.fp8;
  // Checked before any division by the row size (a non-fp8 first frame has no grouping).
  if (first.kind != CodecKind::kFp8 || !fp8_dtype(first.dtype) || g.heads == 0 || g.head_dim == 0 ||
      g.rows_per_group == 0)
    return InvalidArgument("the first frame is not an fp8 frame of a bfloat16, float16 or float32 batch");
  const size_t esize = dtype_size(first.dtype);
  const uint64_t row_bytes = uint64_t(g.heads) * g.head_dim * esize;
  Fp8Plan p;
  PDKV_ASSIGN_OR_RETURN(uint64_t rows, add_pieces(dst, n, row_bytes, esize, 0, p.pieces));
  uint64_t row = 0;
  for (const Fp8FrameAt& f : frames) {
    if (f.info.kind != CodecKind::kFp8 || f.info.dtype != first.dtype || f.info.fp8.heads != g.heads ||
        f.info.fp8.head_dim != g.head_dim || f.info.fp8.rows_per_group != g.rows_per_group)
      return InvalidArgument("the frames mix dtypes or fp8 groupings");
    const uint64_t frame_rows = f.info.raw_len / row_bytes;  // whole rows: read_frame_header checked it
    add_frame(p, f.offset, row, frame_rows, f.info.raw_len, g);
    row += frame_rows;
  }
  if (row != rows) return InvalidArgument("the frames decode to another size than the extents hold");
  return p;
}

Result<std::vector<Fp8FrameAt>> read_payload_frames(const uint8_t* payload, uint64_t len, uint64_t capacity,
                                                    std::string_view what, uint32_t allowed) {
  std::vector<Fp8FrameAt> frames;
  PDKV_RETURN_IF_ERROR(codec::walk_payload_frames(payload, len, capacity, what, allowed,
                                                  [&](const codec::PayloadFrame& f) {
                                                    frames.push_back(Fp8FrameAt{f.offset, f.info});
                                                    return Status::Ok();
                                                  }));
  return frames;
}

Status verify_fp8_checksums(const uint8_t* payload, const std::vector<Fp8FrameAt>& frames) {
  for (size_t k = 0; k < frames.size(); ++k) {
    const FrameInfo& f = frames[k].info;
    if (!f.has_checksum) continue;
    const std::string where = "compressed write, codec frame " + std::to_string(k) + " (payload offset " +
                              std::to_string(frames[k].offset) + "): ";
    if (!codec::xxh3_available())
      return NotSupported(where + "codec frame carries a checksum but this build has no xxHash to verify it");
    uint64_t sent = 0;
    const uint8_t* frame = payload + frames[k].offset;
    PDKV_RETURN_IF_ERROR(codec::read_frame_header(frame, static_cast<size_t>(f.frame_len), &sent).status());
    const uint64_t got = codec::xxh3_64(frame + kCodecHeaderBytes, f.payload_len);
    if (got != sent)
      return DataCorrupted(where + "codec frame: checksum of the fp8 codes and scales does not match (sent " +
                           std::to_string(sent) + ", computed " + std::to_string(got) + ")");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- DeviceFp8

struct DeviceFp8::PerDevice {
  CUfunction quantize = nullptr;
  CUfunction dequantize = nullptr;
  Status loaded;
  CUstream stream = nullptr;
  CUdeviceptr tables = 0;  // Fp8Piece[] then Fp8FrameDesc[]
  uint64_t tables_cap = 0;
  CUdeviceptr buf = 0;  // the batch's payload (scales + codes where the frames have them)
  uint64_t buf_cap = 0;
};

Result<std::shared_ptr<DeviceFp8>> DeviceFp8::create() {
  if (kPdkvFp8FatbinSize == 0)
    return NotSupported("pdkv was built without nvcc: it has no FP8 kernels for device memory");
  PDKV_ASSIGN_OR_RETURN(const CudaDriver* drv, CudaDriver::get());
  return std::shared_ptr<DeviceFp8>(new DeviceFp8(drv));
}

DeviceFp8::DeviceFp8(const CudaDriver* drv) : drv_(drv) {}

DeviceFp8::~DeviceFp8() {
  for (auto& [dev, d] : devices_) {
    if (!drv_->use_device(dev).ok()) continue;
    if (d->tables) drv_->cuMemFree(d->tables);
    if (d->buf) drv_->cuMemFree(d->buf);
    if (d->stream) drv_->cuStreamDestroy(d->stream);
  }
}

Result<DeviceFp8::PerDevice*> DeviceFp8::device_state(int device) {
  PDKV_RETURN_IF_ERROR(drv_->use_device(device));
  auto it = devices_.find(device);
  if (it == devices_.end()) {
    auto d = std::make_unique<PerDevice>();
    CUmodule mod = nullptr;
    CUresult r = drv_->cuModuleLoadData(&mod, kPdkvFp8Fatbin);
    if (r == kSuccess) r = drv_->cuModuleGetFunction(&d->quantize, mod, kFp8QuantizeKernel);
    if (r == kSuccess) r = drv_->cuModuleGetFunction(&d->dequantize, mod, kFp8DequantizeKernel);
    if (r != kSuccess) {
      d->loaded = NotSupported("the FP8 kernels do not load on device " + std::to_string(device) + ": " +
                               drv_->check(r, "cuModuleLoadData").message());
    } else {
      d->loaded = drv_->check(drv_->cuStreamCreate(&d->stream, kStreamNonBlocking), "cuStreamCreate");
    }
    it = devices_.emplace(device, std::move(d)).first;
  }
  PDKV_RETURN_IF_ERROR(it->second->loaded);
  return it->second.get();
}

Status DeviceFp8::ready(int device) {
  std::lock_guard<std::mutex> lk(mu_);
  return device_state(device).status();
}

// Grows the scratch as needed (freeing synchronizes: nothing of ours is running) and
// copies the descriptor tables to the device.
Status DeviceFp8::upload(PerDevice& d, const Fp8Plan& plan, uint64_t buf_bytes) {
  const uint64_t pieces_bytes = plan.pieces.size() * sizeof(Fp8Piece);
  const uint64_t tables_bytes = pieces_bytes + plan.frames.size() * sizeof(Fp8FrameDesc);
  auto grow = [&](CUdeviceptr& p, uint64_t& cap, uint64_t need, const char* what) -> Status {
    if (need <= cap) return Status::Ok();
    if (p) drv_->cuMemFree(std::exchange(p, 0));
    cap = 0;
    const uint64_t want = std::max<uint64_t>(need, 64 << 10);
    PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemAlloc(&p, want), what));
    cap = want;
    return Status::Ok();
  };
  PDKV_RETURN_IF_ERROR(grow(d.tables, d.tables_cap, tables_bytes, "cuMemAlloc (fp8 descriptor tables)"));
  PDKV_RETURN_IF_ERROR(grow(d.buf, d.buf_cap, buf_bytes, "cuMemAlloc (fp8 scales and codes)"));
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(d.tables, plan.pieces.data(), pieces_bytes),
                                   "cuMemcpyHtoD (fp8 pieces)"));
  return drv_->check(drv_->cuMemcpyHtoD(d.tables + pieces_bytes, plan.frames.data(),
                                        plan.frames.size() * sizeof(Fp8FrameDesc)),
                     "cuMemcpyHtoD (fp8 frames)");
}

// Launches `fn` over the plan and waits for it (the stream reports a kernel's fault).
Status DeviceFp8::launch(PerDevice& d, CUfunction fn, const Fp8Plan& plan, DType dtype, const Fp8Grouping& g,
                         const char* what) {
  Fp8Launch a{};
  a.pieces = d.tables;
  a.frames = d.tables + plan.pieces.size() * sizeof(Fp8Piece);
  a.buf = d.buf;
  a.total_groups = plan.total_groups;
  a.npieces = static_cast<uint32_t>(plan.pieces.size());
  a.nframes = static_cast<uint32_t>(plan.frames.size());
  a.heads = g.heads;
  a.head_dim = g.head_dim;
  a.rows_per_group = g.rows_per_group;
  a.dtype = static_cast<uint32_t>(dtype);
  void* params[] = {&a};
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(plan.total_groups, kMaxGrid));
  Status st = drv_->check(drv_->cuLaunchKernel(fn, grid, 1, 1, kThreads, 1, 1, 0, d.stream, params, nullptr), what);
  Status sync = drv_->check(drv_->cuStreamSynchronize(d.stream), what);
  return st.ok() ? sync : st;
}

Status DeviceFp8::encode(int device, const Fp8Plan& plan, DType dtype, const Fp8Grouping& g, bool checksum,
                         std::vector<uint8_t>& out) {
  out.resize(plan.payload_bytes);
  if (plan.total_groups == 0) return Status::Ok();
  if (plan.pieces.size() > 0xFFFFFFFFull || plan.frames.size() > 0xFFFFFFFFull)
    return InvalidArgument("fp8 on device memory: too many extents in one batch");
  if (checksum && !codec::xxh3_available())
    return NotSupported("codec checksum needs xxHash, which was not found when pdkv was built");
  {
    std::lock_guard<std::mutex> lk(mu_);
    PDKV_ASSIGN_OR_RETURN(PerDevice * d, device_state(device));
    PDKV_RETURN_IF_ERROR(upload(*d, plan, plan.payload_bytes));
    PDKV_RETURN_IF_ERROR(launch(*d, d->quantize, plan, dtype, g, "cuLaunchKernel(pdkv_fp8_quantize)"));
    PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyDtoH(out.data(), d->buf, plan.payload_bytes),
                                     "cuMemcpyDtoH (fp8 scales and codes)"));
  }
  // The headers, written on the host exactly as the host codec writes them.
  for (size_t f = 0; f < plan.frames.size(); ++f) {
    const uint64_t at = plan.frame_offset[f];
    const uint64_t end = f + 1 < plan.frames.size() ? plan.frame_offset[f + 1] : plan.payload_bytes;
    FrameInfo info;
    info.kind = CodecKind::kFp8;
    info.dtype = dtype;
    info.has_checksum = checksum;
    info.raw_len = plan.raw_len[f];
    info.payload_len = end - at - kCodecHeaderBytes;
    info.fp8 = g;
    uint8_t* frame = out.data() + at;
    const uint64_t sum = checksum ? codec::xxh3_64(frame + kCodecHeaderBytes, info.payload_len) : 0;
    codec::write_frame_header(info, sum, frame);
  }
  return Status::Ok();
}

Status DeviceFp8::decode(int device, const uint8_t* payload, uint64_t len, const Fp8Plan& plan, DType dtype,
                         const Fp8Grouping& g) {
  if (plan.total_groups == 0) return Status::Ok();
  std::lock_guard<std::mutex> lk(mu_);
  PDKV_ASSIGN_OR_RETURN(PerDevice * d, device_state(device));
  PDKV_RETURN_IF_ERROR(upload(*d, plan, len));
  PDKV_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(d->buf, payload, len), "cuMemcpyHtoD (fp8 scales and codes)"));
  return launch(*d, d->dequantize, plan, dtype, g, "cuLaunchKernel(pdkv_fp8_dequantize)");
}

}  // namespace pdkv::cuda
