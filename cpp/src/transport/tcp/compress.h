// Compressed writes and reads on the tcp transport: the encoder threads that turn a
// batch into a kWriteZ payload (or a read's kReadRespZ payload at the target) while
// earlier batches are on the wire, the decoder threads that turn it back off the
// progress threads, and the per-peer choice (TcpCompression::mode kAuto) of whether
// compressing pays on that link, for writes to and reads from each peer.
//
//   TaskPool        named worker threads (started on first use) running queued tasks.
//   Encoder         encoder threads, a free list of payload buffers, and the measured
//                   encode and decode throughput and ratio of each codec. (How far a
//                   write's encoding runs ahead of its socket is the transport's
//                   business: kEncodeAhead batches per write, TcpTransport::pump_encodes.)
//   Decoder         the receiver's decode threads (pdkv-tcp-unzip): a compressed
//                   batch is decoded there while its progress thread reads on.
//   LinkChooser     per peer: the delivered throughput of its plain writes, and the
//                   decision plain / compressed from that and the Encoder's figures.
//   encode_batch    one batch's extents -> codec frames, back to back (docs/wire.md,
//                   "Compressed writes").
//   decode_payload  the receiver's side: codec frames -> the checked extents.
//   ReadZSpec       (wire.h) what a compressed read asks the target for: make_zspec /
//                   decode_zspec.
//
// Thread safety: TaskPool, Encoder, Decoder and LinkChooser are thread-safe;
// decode_payload uses only its arguments.
#pragma once

#include <sys/uio.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "pdkv/codec.h"
#include "pdkv/options/tcp.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "transport/tcp/wire.h"

namespace pdkv::tcp {

// One encoded batch: the kWriteZ payload. Returned to its Encoder's pool when the
// last reference (the OutMsg that sent it) goes.
struct EncodedBatch {
  std::vector<uint8_t> bytes;
  CodecKind kind = CodecKind::kRaw;
};

// Measured figures of one codec on this agent's data (exponentially averaged).
struct CodecFigures {
  double encode_bps = 0;  // raw bytes encoded per second by one thread (0: not measured)
  double decode_bps = 0;  // raw bytes decoded per second by one thread (0: not measured)
  double ratio = 1;       // raw bytes / payload bytes
};

// Encoder / decoder threads for `opts` (its `threads`, or when 0 min(4, the
// hardware threads)).
uint32_t codec_threads(const TcpCompression& opts);

// Up to `threads` threads named `name`, started as tasks arrive, running them in
// queue order (several at once when there are several threads).
class TaskPool {
 public:
  TaskPool(const char* name, uint32_t threads) : name_(name), max_threads_(threads) {}
  ~TaskPool() { stop(); }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Runs `f` on a pool thread, after the tasks queued before it; once stopped, on
  // the calling thread.
  void run(std::function<void()> f) {
    if (!post(f)) f();
  }
  // Queues `f` for a pool thread; false (and `f` not run) once stopped.
  bool post(std::function<void()> f);
  // Runs what is queued, joins the threads; later run() calls run inline.
  void stop();
  bool stopped() const;
  uint32_t max_threads() const { return max_threads_; }

 private:
  void loop();

  const char* const name_;
  const uint32_t max_threads_;
  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
  uint32_t idle_ = 0;  // threads waiting for a task
  bool stop_ = false;
};

class Encoder {
 public:
  // `gather_below`: TcpOptions::gather_below_bytes (a batch of smaller extents is one frame).
  Encoder(const TcpCompression& opts, uint64_t gather_below)
      : opts_(opts), gather_below_(gather_below), pool_("pdkv-tcp-zip", codec_threads(opts)) {}
  ~Encoder() { stop(); }
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // Runs `f` on an encoder thread (started on first use), after the tasks queued
  // before it; once stopped, on the calling thread (the task then fails fast).
  void run(std::function<void()> f) { pool_.run(std::move(f)); }
  // Queues `f` for an encoder thread; false (and `f` not run) once stopped.
  bool post(std::function<void()> f) { return pool_.post(std::move(f)); }
  void stop() { pool_.stop(); }
  bool stopped() const { return pool_.stopped(); }
  uint32_t threads() const { return pool_.max_threads(); }

  // A payload buffer (from the free list; back to it when the last reference goes).
  std::shared_ptr<EncodedBatch> buffer();

  // Encodes the `n` extents at `iov` as one kWriteZ payload into `out` with `kind`
  // (records the time and ratio). One frame per extent, or one for the whole batch
  // when its extents are small (out_msg.h gathers()).
  Status encode(CodecKind kind, const iovec* iov, uint32_t n, EncodedBatch& out);
  // The same with codec options and dtype a read's initiator asked for (ReadZSpec),
  // not this agent's (records nothing: the initiator's data, the initiator's choice).
  Status encode_with(const CodecOptions& codec, DType dtype, const iovec* iov, uint32_t n, EncodedBatch& out);

  CodecFigures figures(CodecKind kind) const;
  // Measures `kind`'s encode and decode on a sample (the first chunk of a transfer)
  // if it never was, or again when `again` (folded into the figures as a batch's
  // would be). The decode rate stands for the peer's (same code, and the peer's CPU
  // is not known here).
  void calibrate(CodecKind kind, const iovec* iov, uint32_t n, bool again = false);

  const TcpCompression& options() const { return opts_; }
  uint64_t gather_below() const { return gather_below_; }

 private:
  Result<Codec*> codec_for(CodecKind kind);
  void record(CodecKind kind, uint64_t raw, uint64_t wire, double seconds);

  const TcpCompression opts_;
  const uint64_t gather_below_;
  TaskPool pool_;
  mutable std::mutex mu_;  // guards everything below
  std::vector<std::unique_ptr<EncodedBatch>> free_;
  std::array<CodecFigures, 4> figures_{};
  // One codec per (encoder thread, kind): a Codec is single-threaded.
  std::vector<std::pair<std::thread::id, std::array<std::unique_ptr<Codec>, 4>>> codecs_;
};

// The receiver's decode threads (pdkv-tcp-unzip, min(4, hardware threads)): a
// compressed batch whose payload is in is decoded here while the progress thread
// reads other frames and connections. Also keeps payload buffers for reuse.
class Decoder {
 public:
  Decoder();
  // Queues `f` for a decode thread; false (and `f` not run) once stopped.
  bool post(std::function<void()> f) { return pool_.post(std::move(f)); }
  void stop() { pool_.stop(); }
  uint32_t threads() const { return pool_.max_threads(); }
  // An empty payload buffer (capacity from an earlier payload when there is one).
  std::vector<uint8_t> buffer();
  // Gives a payload buffer back (kept when it is not huge and few are kept).
  void give_back(std::vector<uint8_t> buf);
  // Decodes a kWriteZ or kReadRespZ payload with this thread's codecs (decode_payload
  // below; `what` names it in errors, `allowed` the codecs it may use).
  static Status decode(const uint8_t* payload, uint64_t len, const iovec* dst, size_t n,
                       const char* what = "compressed write", uint32_t allowed = ~0u);

 private:
  TaskPool pool_;
  std::mutex mu_;  // guards free_
  std::vector<std::vector<uint8_t>> free_;
};

// What a write to (or a read from) one peer does now.
struct Choice {
  bool compress = false;
  CodecKind kind = CodecKind::kRaw;
};

// The two ends of a compressed transfer's pipeline: threads encoding (writes: this
// agent's encoder; reads: the peer's) and threads decoding (writes: the peer's
// decoder; reads: this agent's).
struct CodecPipeline {
  uint32_t encode_threads = 1;
  uint32_t decode_threads = 1;
};

// Per peer and direction (mode kAuto): plain or compressed, from the delivered
// throughput of plain transfers with that peer (writes: post to last ack; reads: post
// to last response) and the Encoder's figures. Compressed wins when
// min(encode threads x encode rate, decode threads x decode rate,
// link x ratio) beats the link by 10 %; every 16th
// transfer (and any when the last plain measurement is over 5 s old) goes plain
// to measure the link again, so the choice follows the link as it changes.
class LinkChooser {
 public:
  // `what`: "writes to" or "reads from" (the log line).
  explicit LinkChooser(std::string peer, const char* what = "writes to") : peer_(std::move(peer)), what_(what) {}

  // `kind`: the codec it would use; `peer_codecs`: bit (1 << CodecKind) per codec the
  // peer handles (PeerFeatures); the encode and decode rates are this agent's (the
  // same code; the peer's CPU is not known).
  Choice choose(const Encoder& enc, CodecKind kind, uint32_t peer_codecs, CodecPipeline pipe);
  // A plain transfer of `bytes` posted at `posted` was delivered (last ack / response)
  // at `done`. Transfers to one peer share its link: when several are in flight (a
  // layer-wise stream's batches, concurrent requests), each one's post-to-ack time
  // counts the others' bytes too, so the link is measured as the bytes delivered over
  // the time the link was busy: a transfer is charged from max(its post, the previous
  // delivery). A transfer under kMinMeasuredBytes that did not overlap another says
  // more about latency than the link and is not counted; overlapping ones add up
  // until kMinMeasuredBytes make a sample.
  void plain_delivered(uint64_t bytes, Clock::time_point posted, Clock::time_point done = Clock::now());
  // Whether the codec should be sampled again before the next choose(): while writes
  // go plain, the codec's figures come only from samples, and the first (one chunk of
  // the first write) may not represent the data; every kProbeEvery-th plain write
  // samples again.
  bool resample_due() const;
  double link_bps() const;

 private:
  const std::string peer_;
  const char* const what_;
  mutable std::mutex mu_;
  double link_bps_ = 0;  // 0: not measured yet
  Clock::time_point measured_{};
  Clock::time_point last_done_{};  // the latest delivery counted
  uint64_t acc_bytes_ = 0;         // delivered since the last sample
  double acc_s_ = 0;               // link-busy seconds they took
  uint64_t writes_ = 0;
  int last_ = -1;  // the last decision logged: 0 plain, 1 compressed
};

// Batches of one write encoded ahead of those its socket has taken: enough to keep
// the wire busy while the next is encoded, few enough to bound the memory.
inline constexpr uint32_t kEncodeAhead = 4;

// Compressed batches of one connection decoding at once (or queued to): at this many
// its progress thread stops reading it until one is done, so a sender faster than
// our decoders waits in its socket buffers, not in our memory.
inline constexpr uint32_t kDecodeAhead = 4;

// Writes of fewer bytes than this say little about the link (latency dominates).
inline constexpr uint64_t kMinMeasuredBytes = 512u << 10;

// Decodes a kWriteZ (or kReadRespZ) payload of `len` bytes into the extents
// `dst[0, n)` (already checked against the target's regions, or a read's own
// destination), using the codecs in `codecs` (created on first use). ProtocolError
// names `what`, the frame and the field when the payload is malformed or does not
// decode to exactly the extents' bytes, or uses a codec outside `allowed` (bit
// 1 << CodecKind: a read's initiator allows raw and the codec it asked for, so a
// target cannot hand it lossy bytes it did not accept); DataCorrupted on a checksum
// mismatch; NotSupported for a codec this build lacks.
Status decode_payload(const uint8_t* payload, uint64_t len, const iovec* dst, size_t n,
                      std::array<std::unique_ptr<Codec>, 4>& codecs, std::vector<uint8_t>& scratch,
                      const char* what = "compressed write", uint32_t allowed = ~0u);

// The codec a transfer with `o` (mode not kOff) uses when it compresses, given the
// codecs the peer handles: fp8 for mode kFp8, or kAuto with policy lossy-allowed
// when the peer has it; else the lossless codec.
CodecKind codec_for_mode(const TcpCompression& o, uint32_t peer_codecs);

// What a compressed read asks the target for: `kind` with `o`'s parameters.
ReadZSpec make_zspec(const TcpCompression& o, CodecKind kind);
// Validates a ReadZSpec from the wire (exactly sizeof(ReadZSpec) bytes): a codec this
// build encodes (not raw), a dtype, a zstd level, an FP8 grouping in range (fp8:
// a float dtype), reserved fields 0. ProtocolError naming the field otherwise;
// NotSupported for a codec this build lacks.
struct ZSpecCodec {
  CodecOptions options;
  DType dtype = DType::kU8;
};
Result<ZSpecCodec> decode_zspec(std::string_view bytes);

// The tcp metadata extra this agent publishes (`encode_threads`: the encoder threads
// that answer compressed reads), and what a peer's says.
std::string encode_extra(uint32_t encode_threads);
struct PeerFeatures {
  bool compressed_write = false;
  bool compressed_read = false;  // answers kFlagZReply read requests (kFeatureCompressedRead)
  bool strided_extents = false;  // takes kFlagStrided frames (wire.h)
  bool two_level_extents = false;  // takes kFlagStrided2 frames (kFeatureTwoLevelExtents)
  uint32_t codecs = 0;           // bit (1 << CodecKind) per codec it decodes (and encodes)
  uint32_t decode_threads = 1;   // its decode threads (1 when an older peer does not say)
  uint32_t encode_threads = 1;   // its encoder threads answering compressed reads (1 when not said)
};
PeerFeatures decode_extra(std::string_view extra);

}  // namespace pdkv::tcp
