#include "transport/tcp/compress.h"

#include <algorithm>
#include <cstring>

#include "codec/frame.h"
#include "transport/tcp/out_msg.h"
#include "transport/tcp/wire.h"
#include "util/bytes.h"
#include "util/log.h"
#include "util/thread_name.h"

namespace pdkv::tcp {
namespace {

constexpr double kEwma = 0.5;           // weight of a new measurement
constexpr double kWinMargin = 1.10;     // compressed must beat plain by this factor
constexpr uint64_t kProbeEvery = 16;    // every n-th write to a compressing peer goes plain
constexpr double kLinkStaleS = 5.0;     // ... and any write once the link figure is this old

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

CodecOptions codec_options(const TcpCompression& o, CodecKind kind) {
  CodecOptions c;
  c.kind = kind;
  c.level = o.level;
  c.checksum = o.checksum;
  c.fp8 = o.fp8;
  return c;
}

uint64_t iov_bytes(const iovec* iov, uint32_t n) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; ++i) sum += iov[i].iov_len;
  return sum;
}

// Per-thread buffers kept between batches up to this size; a larger batch's are
// released after it (codec threads live as long as the agent).
constexpr size_t kKeepBufferBytes = 8u << 20;

void trim(std::vector<uint8_t>& v) {
  if (v.capacity() > kKeepBufferBytes) std::vector<uint8_t>().swap(v);
}

// Appends the frame(s) of `iov[0, n)` encoded by `codec` to `out`. At most
// kMaxCompressedChunk raw bytes (callers check it first: a compressed batch is one
// codec chunk), so the gather buffer and the codec's scratch stay bounded.
Status encode_into(Codec& codec, DType dtype, const iovec* iov, uint32_t n, uint64_t gather_below,
                   std::vector<uint8_t>& out) {
  thread_local std::vector<uint8_t> frame;
  thread_local std::vector<uint8_t> gathered;
  out.clear();
  const uint64_t bytes = iov_bytes(iov, n);
  if (bytes > kMaxCompressedChunk)
    return InvalidArgument("a compressed batch of " + std::to_string(bytes) + " bytes exceeds " +
                           std::to_string(kMaxCompressedChunk));
  Status st;
  if (gathers(bytes, n, gather_below)) {  // small extents: one frame for all of them
    gathered.resize(bytes);
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; ++i) {
      std::memcpy(gathered.data() + off, iov[i].iov_base, iov[i].iov_len);
      off += iov[i].iov_len;
    }
    st = codec.encode(gathered.data(), bytes, dtype, out);
  } else {
    for (uint32_t i = 0; i < n && st.ok(); ++i) {
      st = codec.encode(static_cast<const uint8_t*>(iov[i].iov_base), iov[i].iov_len, dtype, frame);
      if (st.ok()) out.insert(out.end(), frame.begin(), frame.end());
    }
  }
  trim(gathered);
  trim(frame);
  return st;
}

}  // namespace

uint32_t codec_threads(const TcpCompression& opts) {
  if (opts.threads > 0) return opts.threads;
  const uint32_t hw = std::thread::hardware_concurrency();
  return std::max(1u, std::min(4u, hw));
}

// ---------------------------------------------------------------- TaskPool

bool TaskPool::post(std::function<void()> f) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_ && threads_.empty()) return false;  // (stopping: the threads still drain the queue)
  // Another thread only when every running one is busy with an earlier task.
  if (!stop_ && threads_.size() < max_threads_ && tasks_.size() >= idle_) threads_.emplace_back([this] { loop(); });
  tasks_.push_back(std::move(f));
  cv_.notify_one();
  return true;
}

void TaskPool::loop() {
  util::name_this_thread(name_);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lk, [&] { return stop_ || !tasks_.empty(); });
    --idle_;
    if (tasks_.empty()) return;  // stopping, nothing left
    auto f = std::move(tasks_.front());
    tasks_.pop_front();
    lk.unlock();
    f();
    lk.lock();
  }
}

void TaskPool::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;  // no thread is added from now on
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();  // they drain the queue
  std::deque<std::function<void()>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    threads_.clear();
    left.swap(tasks_);  // queued after the last thread looked
  }
  for (auto& f : left) f();
}

bool TaskPool::stopped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stop_ && threads_.empty();
}

// ---------------------------------------------------------------- Encoder

std::shared_ptr<EncodedBatch> Encoder::buffer() {
  std::lock_guard<std::mutex> lk(mu_);
  std::unique_ptr<EncodedBatch> b;
  if (!free_.empty()) {
    b = std::move(free_.back());
    free_.pop_back();
  } else {
    b = std::make_unique<EncodedBatch>();
  }
  // Back to the pool when the frame that carries it is gone (sent or dropped).
  return std::shared_ptr<EncodedBatch>(b.release(), [this](EncodedBatch* p) {
    std::unique_ptr<EncodedBatch> own(p);
    std::lock_guard<std::mutex> lk(mu_);
    if (own->bytes.capacity() <= (8u << 20) && free_.size() < 64) free_.push_back(std::move(own));
  });
}

Result<Codec*> Encoder::codec_for(CodecKind kind) {
  std::lock_guard<std::mutex> lk(mu_);
  const auto me = std::this_thread::get_id();
  auto it = std::find_if(codecs_.begin(), codecs_.end(), [&](const auto& e) { return e.first == me; });
  if (it == codecs_.end()) {
    codecs_.emplace_back(me, std::array<std::unique_ptr<Codec>, 4>{});
    it = codecs_.end() - 1;
  }
  auto& slot = it->second[static_cast<size_t>(kind)];
  if (!slot) {
    PDKV_ASSIGN_OR_RETURN(slot, Codec::create(codec_options(opts_, kind)));
  }
  return slot.get();
}

Status Encoder::encode(CodecKind kind, const iovec* iov, uint32_t n, EncodedBatch& out) {
  PDKV_ASSIGN_OR_RETURN(Codec * codec, codec_for(kind));
  const auto t0 = Clock::now();
  PDKV_RETURN_IF_ERROR(encode_into(*codec, opts_.dtype, iov, n, gather_below_, out.bytes));
  out.kind = kind;
  record(kind, iov_bytes(iov, n), out.bytes.size(), seconds_since(t0));
  return Status::Ok();
}

Status Encoder::encode_with(const CodecOptions& options, DType dtype, const iovec* iov, uint32_t n,
                            EncodedBatch& out) {
  // A Codec is single-threaded and the options vary by initiator: each thread keeps
  // the last few it used.
  struct Cached {
    CodecOptions options;
    std::unique_ptr<Codec> codec;
  };
  thread_local std::vector<Cached> cache;
  auto same = [&](const CodecOptions& o) {
    return o.kind == options.kind && o.level == options.level && o.checksum == options.checksum &&
           o.fp8.heads == options.fp8.heads && o.fp8.head_dim == options.fp8.head_dim &&
           o.fp8.rows_per_group == options.fp8.rows_per_group;
  };
  auto it = std::find_if(cache.begin(), cache.end(), [&](const Cached& c) { return same(c.options); });
  if (it == cache.end()) {
    PDKV_ASSIGN_OR_RETURN(auto codec, Codec::create(options));
    if (cache.size() >= 4) cache.erase(cache.begin());
    cache.push_back(Cached{options, std::move(codec)});
    it = cache.end() - 1;
  }
  PDKV_RETURN_IF_ERROR(encode_into(*it->codec, dtype, iov, n, gather_below_, out.bytes));
  out.kind = options.kind;
  return Status::Ok();
}

void Encoder::calibrate(CodecKind kind, const iovec* iov, uint32_t n, bool again) {
  if (!again && figures(kind).encode_bps > 0) return;
  auto codec = Codec::create(codec_options(opts_, kind));
  if (!codec.ok()) return;
  uint32_t take = 0;  // about one chunk
  uint64_t bytes = 0;
  while (take < n && bytes < opts_.chunk_bytes) bytes += iov[take++].iov_len;
  std::vector<uint8_t> out;
  const auto t0 = Clock::now();
  if (!encode_into(**codec, opts_.dtype, iov, take, gather_below_, out).ok()) return;
  record(kind, bytes, out.size(), seconds_since(t0));
  // Decode the sample the way the peer will (into a scratch copy of its extents).
  std::vector<uint8_t> back(bytes);
  const iovec whole{back.data(), back.size()};
  const auto t1 = Clock::now();
  if (!Decoder::decode(out.data(), out.size(), &whole, 1).ok()) return;
  const double s = seconds_since(t1);
  if (bytes < 4096 || s <= 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  figures_[static_cast<size_t>(kind)].decode_bps = bytes / s;
}

void Encoder::record(CodecKind kind, uint64_t raw, uint64_t wire, double seconds) {
  if (raw < 4096 || wire == 0 || seconds <= 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  CodecFigures& f = figures_[static_cast<size_t>(kind)];
  const double bps = raw / seconds;
  const double ratio = double(raw) / double(wire);
  if (f.encode_bps == 0) {
    f.encode_bps = bps;
    f.ratio = ratio;
  } else {
    f.encode_bps = kEwma * bps + (1 - kEwma) * f.encode_bps;
    f.ratio = kEwma * ratio + (1 - kEwma) * f.ratio;
  }
}

CodecFigures Encoder::figures(CodecKind kind) const {
  std::lock_guard<std::mutex> lk(mu_);
  return figures_[static_cast<size_t>(kind)];
}

// ---------------------------------------------------------------- LinkChooser

Choice LinkChooser::choose(const Encoder& enc, CodecKind kind, uint32_t peer_codecs, CodecPipeline pipe) {
  std::lock_guard<std::mutex> lk(mu_);
  ++writes_;
  if (!(peer_codecs & (1u << static_cast<unsigned>(kind)))) return Choice{};
  if (link_bps_ == 0) return Choice{};  // measure the link first
  if (last_ == 1 && (writes_ % kProbeEvery == 0 || seconds_since(measured_) > kLinkStaleS)) return Choice{};
  const CodecFigures f = enc.figures(kind);
  // The pipeline runs at its slowest stage: the encoders, the wire carrying the
  // compressed bytes, or the decoders (not measured: as fast as the encoders).
  const double encode_bps = f.encode_bps * std::max(1u, pipe.encode_threads);
  const double decode_bps = f.decode_bps > 0 ? f.decode_bps * std::max(1u, pipe.decode_threads) : encode_bps;
  const double compressed_bps = std::min({encode_bps, decode_bps, link_bps_ * f.ratio});
  const bool on = f.encode_bps > 0 && compressed_bps > kWinMargin * link_bps_;
  if (int(on) != last_) {
    PDKV_LOG_INFO("tcp: %s peer '%s' now %s %s (link %.3f GB/s plain; %s encodes %.3f GB/s x %u threads, "
                  "decodes %.3f GB/s x %u threads, ratio %.2f)",
                  what_, peer_.c_str(), on ? "compressed with" : "plain, not",
                  std::string(codec_kind_name(kind)).c_str(), link_bps_ / 1e9,
                  std::string(codec_kind_name(kind)).c_str(), f.encode_bps / 1e9, pipe.encode_threads,
                  f.decode_bps / 1e9, pipe.decode_threads, f.ratio);
    last_ = on;
  }
  return on ? Choice{true, kind} : Choice{};
}

void LinkChooser::plain_delivered(uint64_t bytes, Clock::time_point posted, Clock::time_point done) {
  std::lock_guard<std::mutex> lk(mu_);
  const bool overlapped = posted < last_done_;  // posted while an earlier one was still on the link
  const Clock::time_point from = std::max(posted, last_done_);
  last_done_ = std::max(last_done_, done);
  if (bytes < kMinMeasuredBytes && !overlapped) return;
  acc_bytes_ += bytes;
  if (done > from) acc_s_ += std::chrono::duration<double>(done - from).count();
  if (acc_bytes_ < kMinMeasuredBytes || acc_s_ <= 0) return;
  const double bps = acc_bytes_ / acc_s_;
  link_bps_ = link_bps_ == 0 ? bps : kEwma * bps + (1 - kEwma) * link_bps_;
  PDKV_LOG_DEBUG("tcp: link sample for %s peer '%s': %llu bytes in %.6f s busy = %.6f GB/s (average %.6f GB/s)", what_,
                 peer_.c_str(), static_cast<unsigned long long>(acc_bytes_), acc_s_, bps / 1e9, link_bps_ / 1e9);
  acc_bytes_ = 0;
  acc_s_ = 0;
  measured_ = Clock::now();
}

bool LinkChooser::resample_due() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_ == 0 && (writes_ + 1) % kProbeEvery == 0;
}

double LinkChooser::link_bps() const {
  std::lock_guard<std::mutex> lk(mu_);
  return link_bps_;
}

// ---------------------------------------------------------------- the receiver's side

Decoder::Decoder() : pool_("pdkv-tcp-unzip", codec_threads(TcpCompression{})) {}

std::vector<uint8_t> Decoder::buffer() {
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.empty()) return {};
  std::vector<uint8_t> b = std::move(free_.back());
  free_.pop_back();
  return b;
}

void Decoder::give_back(std::vector<uint8_t> buf) {
  if (buf.capacity() > kKeepBufferBytes) return;  // a rare huge payload is not kept
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.size() < 2 * kDecodeAhead) free_.push_back(std::move(buf));
}

Status Decoder::decode(const uint8_t* payload, uint64_t len, const iovec* dst, size_t n, const char* what,
                       uint32_t allowed) {
  // A Codec is single-threaded: one set per thread (decode threads, or a caller
  // decoding inline at shutdown), created on first use.
  thread_local std::array<std::unique_ptr<Codec>, 4> codecs;
  thread_local std::vector<uint8_t> scratch;
  Status st = decode_payload(payload, len, dst, n, codecs, scratch, what, allowed);
  trim(scratch);
  return st;
}

Status decode_payload(const uint8_t* payload, uint64_t len, const iovec* dst, size_t n,
                      std::array<std::unique_ptr<Codec>, 4>& codecs, std::vector<uint8_t>& scratch,
                      const char* what, uint32_t allowed) {
  uint64_t capacity = 0;
  for (size_t i = 0; i < n; ++i) capacity += dst[i].iov_len;
  size_t idx = 0;      // current destination extent
  uint64_t off = 0;    // bytes of it already written
  return codec::walk_payload_frames(payload, len, capacity, what, allowed, [&](const codec::PayloadFrame& f) {
    auto& codec = codecs[static_cast<size_t>(f.info.kind)];
    if (!codec) {
      CodecOptions co;
      co.kind = f.info.kind;
      PDKV_ASSIGN_OR_RETURN(codec, Codec::create(co));
    }
    size_t written = 0;
    const bool in_place = dst[idx].iov_len - off >= f.out_len;
    uint8_t* out = in_place ? static_cast<uint8_t*>(dst[idx].iov_base) + off : nullptr;
    if (!in_place) {
      scratch.resize(static_cast<size_t>(f.out_len));
      out = scratch.data();
    }
    Status st = codec->decode(payload + f.offset, static_cast<size_t>(f.info.frame_len), f.info.dtype, out,
                              static_cast<size_t>(f.out_len), &written);
    if (!st.ok()) return Status(st.code(), f.where + st.message());
    if (written != f.out_len)
      return ProtocolError(f.where + "decoded " + std::to_string(written) + " bytes, its header says " +
                           std::to_string(f.out_len));
    // Spread over the extents (in place: only the cursor moves).
    for (uint64_t left = written, from = 0; left > 0;) {
      const uint64_t step = std::min<uint64_t>(left, dst[idx].iov_len - off);
      if (!in_place) std::memcpy(static_cast<uint8_t*>(dst[idx].iov_base) + off, scratch.data() + from, step);
      from += step;
      left -= step;
      off += step;
      if (off == dst[idx].iov_len && idx + 1 < n) {
        ++idx;
        off = 0;
      }
    }
    return Status::Ok();
  });
}

// ---------------------------------------------------------------- compressed reads

CodecKind codec_for_mode(const TcpCompression& o, uint32_t peer_codecs) {
  if (o.mode == CompressMode::kFp8) return CodecKind::kFp8;
  const bool peer_fp8 = peer_codecs & (1u << static_cast<unsigned>(CodecKind::kFp8));
  if (o.mode == CompressMode::kAuto && o.policy == CompressPolicy::kLossyAllowed && peer_fp8) return CodecKind::kFp8;
  return o.codec;
}

ReadZSpec make_zspec(const TcpCompression& o, CodecKind kind) {
  ReadZSpec z{};
  z.codec = static_cast<uint8_t>(kind);
  z.dtype = static_cast<uint8_t>(o.dtype);
  z.checksum = o.checksum ? 1 : 0;
  z.level = o.level;
  z.heads = o.fp8.heads;
  z.head_dim = o.fp8.head_dim;
  z.rows_per_group = o.fp8.rows_per_group;
  return z;
}

Result<ZSpecCodec> decode_zspec(std::string_view bytes) {
  if (bytes.size() != sizeof(ReadZSpec))
    return ProtocolError("read compression spec is " + std::to_string(bytes.size()) + " bytes, expected " +
                         std::to_string(sizeof(ReadZSpec)));
  ReadZSpec z;
  std::memcpy(&z, bytes.data(), sizeof z);
  auto bad = [](const std::string& field, uint64_t v) {
    return ProtocolError("read compression spec: " + field + " " + std::to_string(v) + " is out of range");
  };
  const auto kind = static_cast<CodecKind>(z.codec);
  if (kind != CodecKind::kZstd && kind != CodecKind::kLz4 && kind != CodecKind::kFp8) return bad("codec", z.codec);
  if (z.dtype > static_cast<uint8_t>(DType::kI64))
    return bad("dtype", z.dtype);
  if (z.checksum > 1) return bad("checksum", z.checksum);
  if (z.reserved != 0 || z.reserved2 != 0) return ProtocolError("read compression spec: reserved fields are not 0");
  if (z.level < -7 || z.level > 9) return bad("level", static_cast<uint64_t>(static_cast<int64_t>(z.level)));
  constexpr uint32_t kMaxGroupDim = 1u << 16;
  if (z.heads == 0 || z.heads > kMaxGroupDim) return bad("heads", z.heads);
  if (z.head_dim == 0 || z.head_dim > kMaxGroupDim) return bad("head_dim", z.head_dim);
  if (z.rows_per_group == 0 || z.rows_per_group > kMaxGroupDim) return bad("rows_per_group", z.rows_per_group);
  if (!codec_available(kind))
    return NotSupported("this agent cannot encode " + std::string(codec_kind_name(kind)) +
                        " (its build lacks that library)");
  ZSpecCodec c;
  c.options.kind = kind;
  c.options.level = z.level;
  c.options.checksum = z.checksum != 0;
  c.options.fp8 = Fp8Grouping{z.heads, z.head_dim, z.rows_per_group};
  c.dtype = static_cast<DType>(z.dtype);
  return c;
}

// ---------------------------------------------------------------- metadata extra

std::string encode_extra(uint32_t encode_threads) {
  uint32_t codecs = 0;
  for (auto k : {CodecKind::kRaw, CodecKind::kZstd, CodecKind::kLz4, CodecKind::kFp8})
    if (codec_available(k)) codecs |= 1u << static_cast<unsigned>(k);
  util::ByteWriter w;
  w.put<uint32_t>(kExtraMagic);
  w.put<uint32_t>(kFeatureCompressedWrite | kFeatureStridedExtents | kFeatureCompressedRead | kFeatureTwoLevelExtents);
  w.put<uint32_t>(codecs);
  w.put<uint32_t>(codec_threads(TcpCompression{}));  // decode threads (Decoder); older peers stop reading before it
  w.put<uint32_t>(encode_threads);                   // encoder threads answering compressed reads (newer still)
  return w.take();
}

PeerFeatures decode_extra(std::string_view extra) {
  util::ByteReader r(extra);
  uint32_t magic = 0, features = 0, codecs = 0;
  PeerFeatures f;
  if (!r.get(&magic, "tcp extra magic").ok() || magic != kExtraMagic) return f;
  if (!r.get(&features, "tcp extra features").ok() || !r.get(&codecs, "tcp extra codecs").ok()) return f;
  f.compressed_write = features & kFeatureCompressedWrite;
  f.strided_extents = features & kFeatureStridedExtents;
  f.compressed_read = features & kFeatureCompressedRead;
  f.two_level_extents = f.strided_extents && (features & kFeatureTwoLevelExtents);
  f.codecs = codecs;
  uint32_t threads = 0;
  if (r.get(&threads, "tcp extra decode threads").ok()) f.decode_threads = std::max(1u, std::min(threads, 64u));
  if (r.get(&threads, "tcp extra encode threads").ok()) f.encode_threads = std::max(1u, std::min(threads, 64u));
  return f;
}

}  // namespace pdkv::tcp
