#include <algorithm>

#include "transport/tcp/device_staging.h"

#include "transport/tcp/compress.h"
#include "transport/tcp/conn.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/progress.h"
#include "transport/tcp/tcp_transport_impl.h"
#include "util/log.h"
#include "util/socket.h"
#include "util/thread_name.h"

namespace pdkv::tcp {
namespace {

constexpr double kStageWaitS = 60.0;  // a read responder waits this long for a staging buffer

}  // namespace

Result<std::shared_ptr<cuda::Stager>> DeviceStaging::stager() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!stager_) {
    auto st = cuda::Stager::create(chunk_bytes_, buffers_);
    if (!st.ok()) return Status(st.status().code(), "tcp cannot stage device memory: " + st.status().message());
    stager_ = std::move(st).value();
  }
  return stager_;
}

void DeviceStaging::run(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) {
      if (!th_.joinable()) th_ = std::thread([this] { loop(); });
      queue_.push_back(std::move(f));
      cv_.notify_one();
      return;
    }
  }
  f();  // shutting down: the task fails at once on this thread
}

void DeviceStaging::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (th_.joinable()) th_.join();
}

void DeviceStaging::loop() {
  util::name_this_thread("pdkv-dev-stage");
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      f = std::move(queue_.front());
      queue_.pop_front();
    }
    f();
  }
}

Result<std::shared_ptr<cuda::PinnedBuffer>> DeviceStaging::gather(int device, const iovec* src, size_t n,
                                                                  Clock::time_point deadline,
                                                                  const std::function<bool()>& abandon) {
  PDKV_ASSIGN_OR_RETURN(auto st, stager());
  PDKV_ASSIGN_OR_RETURN(auto buf, st->acquire(device, deadline, abandon));
  Status g = st->gather(device, src, n, buf->data());
  if (!g.ok()) return g.with_context("copying device memory into the staging buffer");
  return buf;
}

void append_device_runs(const PieceRun* runs, size_t n, std::vector<cuda::DeviceRun>& out) {
  for (size_t i = 0; i < n; ++i) {
    const PieceRun& r = runs[i];
    for (uint64_t j = 0; j < r.count2; ++j)
      out.push_back(cuda::DeviceRun{reinterpret_cast<uint64_t>(r.base + j * r.stride2), r.len, r.count, r.stride});
  }
}

Result<std::shared_ptr<cuda::PinnedBuffer>> DeviceStaging::gather_runs(int device, const PieceRun* runs, size_t n,
                                                                       Clock::time_point deadline,
                                                                       const std::function<bool()>& abandon) {
  PDKV_ASSIGN_OR_RETURN(auto st, stager());
  PDKV_ASSIGN_OR_RETURN(auto buf, st->acquire(device, deadline, abandon));
  thread_local std::vector<cuda::DeviceRun> dr;
  dr.clear();
  append_device_runs(runs, n, dr);
  Status g = st->gather_runs(device, dr.data(), dr.size(), buf->data());
  if (!g.ok()) return g.with_context("copying device memory into the staging buffer");
  return buf;
}

void DeviceStaging::respond_read(const std::shared_ptr<TcpConn>& c, const FrameHeader& h, std::vector<PieceRun> src,
                                 std::vector<RegionPin> pins, GenPin gens, uint64_t bytes, int device) {
  struct Job {
    std::vector<cuda::DeviceRun> src;
    std::vector<RegionPin> pins;
    GenPin gens;  // held until the bytes are gathered (the job ends)
  };
  std::vector<cuda::DeviceRun> runs;
  append_device_runs(src.data(), src.size(), runs);
  auto job = std::make_shared<Job>(Job{std::move(runs), std::move(pins), std::move(gens)});
  run([this, c, h, job, bytes, device] {
    auto fail = [&](const Status& st) {
      if (!c->owner()) return;
      auto rl = c->lock_rx();
      if (c->open())
        t_.fail_conn_locked(c, Status(st.code(), "read request from " + c->desc() + " failed: " + st.message()),
                            h.xfer_id, h.batch);
    };
    auto dead = [&] { return c->is_dead() || t_.shutting_down(); };
    if (dead()) return;
    auto st = stager();
    if (!st.ok()) return fail(st.status());
    // A response larger than a pooled chunk gets a buffer of its own.
    auto buf = bytes <= (*st)->chunk() ? (*st)->acquire(device, util::deadline_after(kStageWaitS), dead)
                                       : (*st)->allocate(device, bytes);
    if (!buf.ok()) return fail(buf.status());
    Status g = (*st)->gather_runs(device, job->src.data(), job->src.size(), (*buf)->data());
    if (!g.ok()) return fail(g.with_context("copying device memory into the staging buffer"));
    auto m = std::make_unique<OutMsg>();
    m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
    m->hdr.payload = bytes;
    m->own_iov.push_back({(*buf)->data(), bytes});
    m->lease = std::move(buf).value();
    m->pins = std::move(job->pins);
    m->finalize();
    c->owner()->enqueue(c, std::move(m));
  });
}

// ---------------------------------------------------------------- compressed writes

Result<std::shared_ptr<cuda::DeviceFp8>> DeviceStaging::fp8(int device) {
  std::shared_ptr<cuda::DeviceFp8> k;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!fp8_tried_) {
      fp8_tried_ = true;
      auto made = cuda::DeviceFp8::create();
      if (made.ok()) fp8_ = std::move(made).value();
      else fp8_status_ = made.status();
    }
    if (!fp8_) return fp8_status_;
    k = fp8_;
  }
  PDKV_RETURN_IF_ERROR(k->ready(device));
  return k;
}

bool DeviceStaging::gpu_fp8_on_hardware(int device) {
  return cuda::CudaDriver::hardware_present() && fp8(device).ok();
}

Status DeviceStaging::encode(Encoder& enc, CodecKind kind, int device, const iovec* src, uint32_t n,
                             Clock::time_point deadline, const std::function<bool()>& abandon, EncodedBatch& out) {
  const TcpCompression& o = enc.options();
  return encode_device(kind, o.dtype, o.fp8, o.checksum, device, src, n, deadline, abandon, out,
                       [&](const iovec* staged, uint32_t k) { return enc.encode(kind, staged, k, out); });
}

Status DeviceStaging::encode_with(Encoder& enc, const CodecOptions& codec, DType dtype, int device, const iovec* src,
                                  uint32_t n, Clock::time_point deadline, const std::function<bool()>& abandon,
                                  EncodedBatch& out) {
  return encode_device(codec.kind, dtype, codec.fp8, codec.checksum, device, src, n, deadline, abandon, out,
                       [&](const iovec* staged, uint32_t k) { return enc.encode_with(codec, dtype, staged, k, out); });
}

Status DeviceStaging::encode_device(CodecKind kind, DType dtype, const Fp8Grouping& g, bool checksum, int device,
                                    const iovec* src, uint32_t n, Clock::time_point deadline,
                                    const std::function<bool()>& abandon, EncodedBatch& out,
                                    const std::function<Status(const iovec*, uint32_t)>& host_encode) {
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n; ++i) bytes += src[i].iov_len;
  if (kind == CodecKind::kFp8) {
    auto k = fp8(device);
    // The frames the host encoder writes: one for a batch of small extents, else one
    // per extent. Extents the kernels cannot take (not whole rows, or unaligned) go
    // the host's way below, which also fails where the host codec would.
    auto plan = k.ok() ? cuda::plan_fp8_batch(src, n, gathers(bytes, n, t_.opts().gather_below_bytes), dtype, g) : Result<cuda::Fp8Plan>(k.status());
    if (plan.ok()) {
      PDKV_RETURN_IF_ERROR((*k)->encode(device, *plan, dtype, g, checksum, out.bytes));
      out.kind = kind;
      return Status::Ok();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (!k.ok() && !fp8_fallback_logged_) {
      fp8_fallback_logged_ = true;
      PDKV_LOG_WARN("tcp: fp8 of device memory runs on the host after staging: %s", k.status().message().c_str());
    }
  }
  // On the host: gathered into a pinned buffer, then encoded from there extent by
  // extent, so the frames are those of the same bytes in host memory.
  PDKV_ASSIGN_OR_RETURN(auto buf, gather(device, src, n, deadline, abandon));
  std::vector<iovec> staged(n);
  uint64_t off = 0;
  for (uint32_t i = 0; i < n; ++i) {
    staged[i] = iovec{buf->data() + off, src[i].iov_len};
    off += src[i].iov_len;
  }
  return host_encode(staged.data(), n);
}

Status DeviceStaging::decode(int device, const uint8_t* payload, uint64_t len, const iovec* dst, size_t n,
                             const char* what, uint32_t allowed) {
  uint64_t capacity = 0;
  for (size_t i = 0; i < n; ++i) capacity += dst[i].iov_len;
  PDKV_ASSIGN_OR_RETURN(auto frames, cuda::read_payload_frames(payload, len, capacity, what, allowed));
  const bool all_fp8 = std::all_of(frames.begin(), frames.end(),
                                   [](const cuda::Fp8FrameAt& f) { return f.info.kind == CodecKind::kFp8; });
  if (all_fp8 && !frames.empty()) {
    auto k = fp8(device);
    // Frames whose rows do not sit whole in the extents (or mixed groupings) are
    // decoded on the host below: correct, only slower.
    auto plan = k.ok() ? cuda::plan_fp8_frames(frames, dst, n) : Result<cuda::Fp8Plan>(k.status());
    if (plan.ok()) {
      PDKV_RETURN_IF_ERROR(cuda::verify_fp8_checksums(payload, frames));
      const FrameInfo& f = frames.front().info;
      return (*k)->decode(device, payload, len, *plan, f.dtype, f.fp8);
    }
  }
  PDKV_ASSIGN_OR_RETURN(auto st, stager());
  thread_local std::vector<uint8_t> host;
  host.resize(static_cast<size_t>(capacity));
  const iovec whole{host.data(), host.size()};
  Status d = Decoder::decode(payload, len, &whole, 1, what, allowed);
  if (d.ok()) d = st->scatter(device, reinterpret_cast<const char*>(host.data()), dst, n, /*src_pinned=*/false);
  if (host.capacity() > (8u << 20)) std::vector<uint8_t>().swap(host);
  return d;
}

}  // namespace pdkv::tcp
