// FrameReceiver's data path (receiver.h; the byte stream, headers and control frames
// are in receiver.cc): a data request decoded and checked against this agent's
// regions, a read answered (plainly, gathered, or compressed on an encoder thread), a
// write's payload received into place (directly, landed and scattered, staged to the
// device, or decoded on a decoder thread), and the ack once it landed.
//
// Thread safety: as receiver.h says (the receive lock held, except finish_decode,
// finish_read_decode and encode_reply, on a decode or encoder thread).
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "transport/tcp/compress.h"
#include "transport/tcp/progress.h"
#include "transport/tcp/receiver.h"
#include "transport/tcp/scatter.h"
#include "transport/tcp/tcp_transport_impl.h"
#include "transport/tcp/wire.h"
#include "util/socket.h"

namespace pdkv::tcp {
namespace {

// Destination of a payload that must be read and thrown away (a write whose block
// generations are stale): `bytes` (at most kMaxPayloadPerFrame) over one shared
// scratch buffer nobody reads.
std::vector<iovec> discard_iov(uint64_t bytes) {
  static constexpr size_t kScratch = 1u << 20;
  static char* const scratch = new char[kScratch];  // never freed: shared by every thread, contents unused
  std::vector<iovec> out;
  out.reserve(static_cast<size_t>((bytes + kScratch - 1) / kScratch));
  for (uint64_t left = bytes; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kScratch));
    out.push_back({scratch, n});
    left -= n;
  }
  return out;
}

}  // namespace

bool FrameReceiver::on_data_request(const std::shared_ptr<TcpConn>& c) {
  Request req;
  if (!decode_request(c, &req)) return false;
  if (static_cast<FrameType>(rx(c).cur.type) == FrameType::kReadReq) return answer_read(c, std::move(req));
  return begin_write_payload(c, std::move(req));
}

bool FrameReceiver::decode_request(const std::shared_ptr<TcpConn>& c, Request* req) {
  const FrameHeader& h = rx(c).cur;
  const bool is_write = static_cast<FrameType>(h.type) == FrameType::kWrite;
  const bool strided = h.flags & (kFlagStrided | kFlagStrided2);
  AgentHooks* hooks = t_.hooks();
  const std::string& ctrl = rx(c).ctrl;
  const uint32_t n = h.count;
  auto protocol_error = [&](const Status& st) {
    t_.fail_conn_locked(c, ProtocolError(st.message() + " (from " + c->desc() + ")"), h.xfer_id, h.batch);
    return false;
  };
  // Strided descriptors are checked (counts, overflow, total pieces) before anything
  // is built from them; plain ones after (their count is bounded by check_header).
  if (strided) {
    auto sizes = (h.flags & kFlagStrided2)
                     ? check_strided2_extents(reinterpret_cast<const WireStrided2Extent*>(ctrl.data()), n, h)
                     : check_strided_extents(reinterpret_cast<const WireStridedExtent*>(ctrl.data()), n, h);
    if (!sizes.ok()) return protocol_error(sizes.status());
    req->bytes = *sizes;
  }
  req->runs.reserve(n);
  // Consecutive extents of one region share its pin. A strided run is checked whole
  // (first byte to the end of its last piece).
  uint64_t last_region = 0;
  const RegionDesc* last = nullptr;
  for (uint32_t i = 0; i < n; ++i) {
    const DescView e = desc_at(ctrl.data(), h.flags, i);
    const uint64_t span = e.span();  // no overflow: checked above (plain: count 1, count2 1)
    Status err;
    if (e.len == 0) {
      err = ProtocolError("extent " + std::to_string(i) + " has length 0");
    } else if (last && e.region == last_region) {
      if (!extent_in_region(e.offset, span, last->len))
        err = OutOfRange("bytes [" + std::to_string(e.offset) + ", +" + std::to_string(span) +
                         ") fall outside region " + std::to_string(e.region) + " (" + std::to_string(last->len) +
                         " bytes)");
    } else {
      uint64_t addr = 0;
      auto pin = hooks->region_table().pin(e.region, e.offset, span, true, TcpTransport::mem_kinds(), &addr);
      if (!pin.ok()) {
        err = pin.status();
      } else {
        last = pin->desc();
        last_region = e.region;
        if (last->kind == MemKind::kCuda && req->device < 0) req->device = last->device;
        req->pins.push_back(std::move(pin).value());
      }
    }
    if (!err.ok()) {
      t_.fail_conn_locked(c, Status(err.code(), std::string(is_write ? "write" : "read") + " request from " + c->desc() +
                                                    " rejected: " + err.message()),
                          h.xfer_id, h.batch);
      return false;
    }
    char* const base = reinterpret_cast<char*>(last->addr + e.offset);
    const PieceRun run = make_run(base, e.len, e.count, e.stride, e.count2, e.stride2);  // touching pieces fold
    req->runs.push_back(run);
    req->extents += run.extents();
  }
  if (!strided) {
    // Total size (no overflow) and, for a write, the declared payload.
    auto sizes = check_extents(reinterpret_cast<const WireExtent*>(ctrl.data()), n, h);
    if (!sizes.ok()) return protocol_error(sizes.status());
    req->bytes = *sizes;
  }
  const std::string_view aux = std::string_view(ctrl).substr(size_t(n) * desc_bytes(h));
  auto parts = split_data_aux(h, aux);
  if (!parts.ok()) return protocol_error(parts.status());
  rx(c).notif_off = rx(c).ctrl.size() - parts->notif.size();
  // Block generations: checked (and the blocks pinned) before a byte lands or is
  // sent. A stale claim fails this part only.
  req->zspec = std::string(parts->zspec);
  if (h.flags & kFlagGens) {
    auto claim = decode_claim(parts->claim);
    if (!claim.ok()) return protocol_error(claim.status());
    auto pin = hooks->check_generations(*claim);
    if (pin.ok()) {
      req->gens = std::move(pin).value();
    } else {
      req->reject = pin.status();
    }
  }
  return true;
}

bool FrameReceiver::answer_read(const std::shared_ptr<TcpConn>& c, Request req) {
  const FrameHeader& h = rx(c).cur;
  if (!req.reject.ok()) {
    reply(c, failed_ack(h, req.reject));
    return true;
  }
  if (h.flags & kFlagZReply) {
    // Encoded on an encoder thread; device memory through the device path (fp8
    // quantized on the GPU, lossless gathered to a pinned buffer and encoded on the
    // host), as a device write is.
    auto codec = decode_zspec(req.zspec);
    // More than one codec chunk (kMaxCompressedChunk) is never asked for compressed
    // by a pdkv initiator (its compressed reads are cut into codec chunks): answered
    // plain before anything is gathered or encoded, so a request cannot make the
    // encoder buffer more than one chunk.
    if (codec.ok() && req.bytes > kMaxCompressedChunk)
      codec = NotSupported("a compressed response of more than one codec chunk");
    if (codec.ok()) {
      list_iovecs(req);
      return answer_read_compressed(c, req, *codec);
    }
    if (codec.status().code() != StatusCode::kNotSupported) {
      t_.fail_conn_locked(c, ProtocolError(codec.status().message() + " (from " + c->desc() + ")"), h.xfer_id,
                          h.batch);
      return false;
    }
    // A codec this build lacks: answered plain (the initiator accepts either).
  }
  if (req.device >= 0) {
    // Gathered from the GPU on the staging thread, which sends the response. From the runs: no iovec per piece.
    t_.staging().respond_read(c, h, std::move(req.runs), std::move(req.pins), std::move(req.gens), req.bytes,
                              req.device);
    return true;
  }
  reply(c, gathered_read_response(h, req, t_.opts().gather_below_bytes));
  return true;
}

void FrameReceiver::list_iovecs(Request& req) {
  if (!req.iov.empty() || req.runs.empty()) return;
  req.iov.reserve(static_cast<size_t>(req.extents));  // bounded: kMaxStridedPieces (check_strided_extents)
  append_iovecs(req.runs.data(), req.runs.size(), req.iov);
}

std::unique_ptr<OutMsg> FrameReceiver::gathered_read_response(const FrameHeader& h, Request& req,
                                                              uint64_t gather_below) {
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
  m->hdr.payload = req.bytes;
  m->own_runs = std::move(req.runs);  // finalize lists them when the pieces are too large to gather
  m->gather_below = gather_below;
  m->pins = std::move(req.pins);
  m->gens = std::move(req.gens);
  m->finalize();
  return m;
}

std::unique_ptr<OutMsg> FrameReceiver::plain_read_response(const FrameHeader& h, std::vector<iovec> iov,
                                                           std::vector<RegionPin> pins, GenPin gens, uint64_t bytes,
                                                           uint64_t gather_below) {
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kReadResp, h.xfer_id, h.batch);
  m->hdr.payload = bytes;
  m->own_iov = std::move(iov);
  m->gather_below = gather_below;
  m->pins = std::move(pins);
  m->gens = std::move(gens);
  m->finalize();
  return m;
}

// How long a compressed read response of device memory waits for a staging buffer
// (the reader's own deadline is not sent; a dead connection stops the wait sooner).
constexpr double kDeviceReplyWaitS = 60.0;  // as a plain one (device_staging.cc kStageWaitS)

// What a compressed read response takes to its encoder thread.
struct FrameReceiver::ReplyJob {
  FrameHeader hdr{};
  std::vector<iovec> iov;  // the checked extents, in order
  std::vector<RegionPin> pins;
  GenPin gens;
  uint64_t bytes = 0;
  CodecOptions codec;
  DType dtype = DType::kU8;
  int device = -1;  // >= 0: the extents are device memory (encoded through the staging path)
};

bool FrameReceiver::answer_read_compressed(const std::shared_ptr<TcpConn>& c, Request& req,
                                           const ZSpecCodec& codec) {
  const FrameHeader& h = rx(c).cur;
  auto job = std::make_shared<ReplyJob>();
  job->hdr = h;
  job->codec = codec.options;
  job->dtype = codec.dtype;
  job->iov = std::move(req.iov);
  job->pins = std::move(req.pins);
  job->gens = std::move(req.gens);
  job->bytes = req.bytes;
  job->device = req.device;
  c->decode_started();  // done when the response left (or was dropped): kDecodeAhead bounds the memory
  TcpTransport& t = t_;
  t.encoder().run([&t, c, job] { encode_reply(t, c, *job); });  // (inline once stopped: encode_reply gives up)
  return true;
}

// On an encoder thread: encodes the response and queues it. A codec error (FP8 on
// extents that are not whole rows) fails that part with a failed ack; a response
// that does not fit in kMaxCompressedPayload goes plain. The extents' pins and
// block claim are released once encoded (the bytes were copied), or with the plain
// response once sent.
void FrameReceiver::encode_reply(TcpTransport& t, const std::shared_ptr<TcpConn>& c, ReplyJob& job) {
  if (t.shutting_down() || c->is_dead() || !c->owner()) {  // its initiator's read fails with the connection
    c->decode_done();
    return;
  }
  const FrameHeader& h = job.hdr;
  auto buf = t.encoder().buffer();
  const auto n = static_cast<uint32_t>(job.iov.size());
  Status st = job.device < 0
                  ? t.encoder().encode_with(job.codec, job.dtype, job.iov.data(), n, *buf)
                  : t.staging().encode_with(t.encoder(), job.codec, job.dtype, job.device, job.iov.data(), n,
                                            util::deadline_after(kDeviceReplyWaitS),
                                            [&] { return c->is_dead() || t.shutting_down(); }, *buf);
  std::unique_ptr<OutMsg> m;
  if (!st.ok()) {
    m = failed_ack(h, st.with_context("compressing the read response"));
  } else if (buf->bytes.size() > kMaxCompressedPayload && job.device >= 0) {
    // Too large compressed: plain, gathered from the GPU by the staging thread.
    std::vector<PieceRun> runs(job.iov.size());
    for (size_t i = 0; i < job.iov.size(); ++i)
      runs[i] = PieceRun{static_cast<char*>(job.iov[i].iov_base), job.iov[i].iov_len, 1, 0};
    t.staging().respond_read(c, h, std::move(runs), std::move(job.pins), std::move(job.gens), job.bytes, job.device);
    c->decode_done();
    return;
  } else if (buf->bytes.size() > kMaxCompressedPayload) {
    m = plain_read_response(h, std::move(job.iov), std::move(job.pins), std::move(job.gens), job.bytes,
                            t.opts().gather_below_bytes);
  } else {
    job.pins.clear();
    job.gens.reset();  // read: a bump of these blocks may return now
    m = std::make_unique<OutMsg>();
    m->hdr = make_hdr(FrameType::kReadRespZ, h.xfer_id, h.batch);
    m->hdr.payload = buf->bytes.size();
    m->own_iov.push_back({buf->bytes.data(), buf->bytes.size()});
    // Freed once the frame left or was dropped, under the send queue's lock: the
    // connection's decode_done() (which takes that lock) is left to an encoder thread.
    Encoder* enc = &t.encoder();
    std::shared_ptr<void> done(nullptr, [enc, c](void*) {
      if (!enc->post([c] { c->decode_done(); })) return;  // stopped: the connection goes with the agent
    });
    m->lease = std::make_shared<std::pair<std::shared_ptr<EncodedBatch>, std::shared_ptr<void>>>(std::move(buf),
                                                                                               std::move(done));
    m->finalize();
    c->owner()->enqueue(c, std::move(m));
    c->owner()->wake_if_idle();
    return;
  }
  m->finalize();
  c->owner()->enqueue(c, std::move(m));
  c->owner()->wake_if_idle();
  c->decode_done();
}

bool FrameReceiver::begin_write_payload(const std::shared_ptr<TcpConn>& c, Request req) {
  const FrameHeader& h = rx(c).cur;
  if (static_cast<FrameType>(h.type) == FrameType::kWriteZ) return begin_compressed_payload(c, std::move(req));
  if (!req.reject.ok()) {  // receive the payload into scratch memory, then refuse
    req.pins.clear();
    req.runs.clear();
    req.iov = discard_iov(req.bytes);
    req.extents = req.iov.size();
    req.device = -1;
  }
  // Small pieces in host memory are landed and scattered out of the runs, device
  // memory is staged and copied out to the runs; the others are received straight
  // into their pieces from a list.
  const bool walk_runs = !req.runs.empty() && (req.device >= 0 || lands(req.bytes, req.extents, t_.opts().land_below_bytes));
  if (!walk_runs) list_iovecs(req);
  rx(c).gens = std::move(req.gens);
  rx(c).reject = req.reject;
  rx(c).dst_own = std::move(req.iov);
  rx(c).dst = rx(c).dst_own.data();
  rx(c).ndst = rx(c).dst_own.size();
  rx(c).runs_own = std::move(req.runs);
  rx(c).runs = walk_runs ? rx(c).runs_own.data() : nullptr;
  rx(c).nruns = walk_runs ? rx(c).runs_own.size() : 0;
  rx(c).run_cur = RunCursor{};
  rx(c).dst_idx = 0;
  rx(c).dst_off = 0;
  rx(c).remaining = req.bytes;
  rx(c).gather = lands(req.bytes, req.extents, t_.opts().land_below_bytes);
  rx(c).pins = std::move(req.pins);
  rx(c).stage = RxStage::kPayload;
  if (req.device >= 0) {
    Status st = begin_staged_rx(*c, req.device);
    if (!st.ok()) {
      t_.fail_conn_locked(c, Status(st.code(), "write request from " + c->desc() +
                                                   " cannot be received into device memory: " + st.message()),
                          h.xfer_id, h.batch);
      return false;
    }
  }
  return true;
}

// The payload (codec frames, at most kMaxCompressedPayload bytes: check_header) is
// received into zbuf; the checked extents wait in zdst for on_payload_done.
bool FrameReceiver::begin_compressed_payload(const std::shared_ptr<TcpConn>& c, Request req) {
  list_iovecs(req);  // the decoder writes into a list of extents
  RxState& st = rx(c);
  const FrameHeader& h = st.cur;
  if (req.reject.ok() && req.device >= 0) {
    auto stager = t_.staging().stager();  // decoded on the host or the GPU, copied in through the driver
    if (!stager.ok())
      req.reject = Status(stager.status().code(), "a compressed write into device memory cannot be received: " +
                                                       stager.status().message());
  }
  st.gens = std::move(req.gens);
  st.reject = req.reject;
  st.zdevice = -1;
  if (req.reject.ok()) {
    st.zdst = std::move(req.iov);
    st.pins = std::move(req.pins);
    st.zdevice = req.device;
  }
  receive_into_zbuf(st, h.payload);
  return true;
}

// What a compressed batch takes to its decode thread: everything the write needs
// once its payload is in (the connection's receive state moves on to the next frame).
struct FrameReceiver::DecodeJob {
  FrameHeader hdr{};
  std::vector<uint8_t> payload;  // the codec frames
  std::vector<iovec> dst;        // the checked extents
  int device = -1;               // their CUDA device, or -1: host memory
  std::vector<RegionPin> pins;
  GenPin gens;
  Status reject;      // refused before its payload came: discarded, failed ack
  std::string notif;  // kFlagNotif: delivered after the last byte is decoded
};

// A compressed write's payload is in: a decode thread decodes it (finish_decode)
// while this thread reads on. Reading this connection pauses while kDecodeAhead of
// its batches are at the decode threads.
void FrameReceiver::hand_to_decoder(const std::shared_ptr<TcpConn>& c) {
  RxState& st = rx(c);
  auto job = std::make_shared<DecodeJob>();
  job->hdr = st.cur;
  job->payload = std::move(st.zbuf);
  job->dst = std::move(st.zdst);
  job->device = std::exchange(st.zdevice, -1);
  job->pins = std::move(st.pins);
  job->gens = std::move(st.gens);
  job->reject = std::move(st.reject);
  if (st.cur.flags & kFlagNotif) job->notif = st.ctrl.substr(st.notif_off);
  st.reject = Status::Ok();
  st.zbuf.clear();
  st.zdst.clear();
  st.dst_own.clear();
  c->decode_started();
  TcpTransport& t = t_;
  if (!t.decoder().post([&t, c, job] { finish_decode(t, c, *job); })) {
    // Shutting down (the decode threads are gone): refuse it rather than decode
    // here, under the receive lock a failing decode would take.
    job->reject = ConnectionError("agent is shutting down");
    finish_decode(t, c, *job);
  }
}

// On a decode thread (no receive lock held): decodes the job's payload into its
// extents, then acknowledges it. A malformed payload fails the connection; a
// checksum mismatch (DataCorrupted) or a codec this build lacks fails only this
// part. Nothing is acknowledged or notified on a connection that died meanwhile:
// its sender's transfer has failed with it.
void FrameReceiver::finish_decode(TcpTransport& t, const std::shared_ptr<TcpConn>& c, DecodeJob& job) {
  const FrameHeader& h = job.hdr;
  Status result = job.reject;
  bool conn_failed = false;
  if (result.ok()) {
    Status d = job.device >= 0 ? t.staging().decode(job.device, job.payload.data(), job.payload.size(),
                                                    job.dst.data(), job.dst.size())
                               : Decoder::decode(job.payload.data(), job.payload.size(), job.dst.data(), job.dst.size());
    if (d.code() == StatusCode::kProtocolError) {
      auto lk = c->lock_rx();
      t.fail_conn_locked(c, ProtocolError(d.message() + " (from " + c->desc() + ")"), h.xfer_id, h.batch);
      conn_failed = true;
    } else if (!d.ok()) {
      result = Status(d.code(), d.message() + " (from " + c->desc() + ")");
    }
  }
  job.pins.clear();
  job.gens.reset();  // landed: a bump of these blocks may return now
  t.decoder().give_back(std::move(job.payload));
  if (!conn_failed && !c->is_dead() && c->owner()) {
    if (!result.ok()) {
      c->owner()->enqueue(c, failed_ack(h, result));  // discarded: no notification
    } else {
      // A notification the agent's queue refuses fails the batch (it was not accepted).
      Status taken = (h.flags & kFlagNotif)
                         ? t.hooks()->deliver_notification(Notification{c->peer_name(), std::move(job.notif)})
                         : Status::Ok();
      if (!taken.ok()) {
        c->owner()->enqueue(c, failed_ack(h, taken));
      } else {
        auto m = std::make_unique<OutMsg>();
        m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
        m->finalize();
        c->owner()->enqueue(c, std::move(m));
      }
    }
  }
  c->decode_done();
}
// ---------------------------------------------------------------- payloads

Status FrameReceiver::begin_staged_rx(TcpConn& c, int device) {
  if (!rx(c).pipe) {
    PDKV_ASSIGN_OR_RETURN(auto st, t_.staging().stager());
    rx(c).pipe = std::make_unique<cuda::ScatterPipe>(std::move(st));
  }
  if (rx(c).runs) {  // a strided request's runs, or a lazy read's: copied out run by run
    std::vector<cuda::DeviceRun> runs;  // two-level runs: one per repetition (scatter.h)
    append_device_runs(rx(c).runs, rx(c).nruns, runs);
    PDKV_RETURN_IF_ERROR(rx(c).pipe->begin_runs(device, std::move(runs), rx(c).remaining));
  } else {
    PDKV_RETURN_IF_ERROR(rx(c).pipe->begin(device, rx(c).dst, rx(c).ndst, rx(c).remaining));
  }
  rx(c).staged = true;
  return Status::Ok();
}

void FrameReceiver::staged_rx_failed(const std::shared_ptr<TcpConn>& c, const Status& st) {
  const FrameHeader h = rx(c).cur;
  rx(c).staged = false;
  rx(c).pipe->abandon();
  if (static_cast<FrameType>(h.type) == FrameType::kWrite) {
    t_.fail_conn_locked(
        c, Status(st.code(), "copying the payload from " + c->desc() + " into device memory failed: " + st.message()),
        h.xfer_id, h.batch);
  } else {
    // The rest of the payload is unread: the stream cannot be resynchronized.
    t_.kill_locked(c, st.with_context("copying a read response into device memory"));
  }
}

void FrameReceiver::on_payload_done(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = rx(c).cur;
  rx(c).stage = RxStage::kHeader;
  set_lowat(*c, 1);
  Status staged;
  if (rx(c).staged) {
    rx(c).staged = false;
    staged = rx(c).pipe->finish();  // every byte reached the device before the ack
    if (!staged.ok() && static_cast<FrameType>(h.type) == FrameType::kWrite) {
      t_.fail_conn_locked(c, Status(staged.code(), "copying the payload from " + c->desc() +
                                                       " into device memory failed: " + staged.message()),
                          h.xfer_id, h.batch);
      return;
    }
  }
  if (static_cast<FrameType>(h.type) == FrameType::kWriteZ) return hand_to_decoder(c);
  if (static_cast<FrameType>(h.type) == FrameType::kWrite) return write_landed(c);
  if (static_cast<FrameType>(h.type) == FrameType::kReadRespZ) return hand_read_to_decoder(c);
  // Read response complete.
  PendingPart part;
  const bool found = c->take_pending(h.xfer_id, h.batch, &part);
  rx(c).read_part = PendingPart{};
  rx(c).dst = nullptr;
  rx(c).runs = nullptr;
  if (found) {
    spi::TransferControl(part.post->xfer).add_wire_bytes(h.payload);
    t_.resolve(part, staged.ok() ? part.bytes : 0, staged.with_context("copying a read response into device memory"));
  }
}

// What a compressed read response takes to its decode thread.
struct FrameReceiver::ReadDecodeJob {
  FrameHeader hdr{};
  std::vector<uint8_t> payload;  // the codec frames
  PendingPart part;              // taken from the pending table: this job resolves it
};

void FrameReceiver::hand_read_to_decoder(const std::shared_ptr<TcpConn>& c) {
  RxState& st = rx(c);
  auto job = std::make_shared<ReadDecodeJob>();
  job->hdr = st.cur;
  job->payload = std::move(st.zbuf);
  st.zbuf.clear();
  st.dst_own.clear();
  st.dst = nullptr;
  st.read_part = PendingPart{};
  if (!c->take_pending(job->hdr.xfer_id, job->hdr.batch, &job->part)) {
    t_.decoder().give_back(std::move(job->payload));  // (resolved meanwhile)
    return;
  }
  c->decode_started();
  TcpTransport& t = t_;
  if (!t.decoder().post([&t, c, job] { finish_read_decode(t, c, *job); })) {
    t.resolve(job->part, 0, ConnectionError("agent is shutting down"));
    t.decoder().give_back(std::move(job->payload));
    c->decode_done();
  }
}

// On a decode thread (no receive lock held): decodes into the read's destination
// (pinned until the transfer completes, which it cannot before this part resolves).
// A malformed payload fails the connection; a checksum mismatch (DataCorrupted)
// fails this part only.
void FrameReceiver::finish_read_decode(TcpTransport& t, const std::shared_ptr<TcpConn>& c, ReadDecodeJob& job) {
  const FrameHeader& h = job.hdr;
  const PendingPart& part = job.part;
  spi::TransferControl(part.post->xfer).add_wire_bytes(job.payload.size());
  // Raw frames (a chunk that did not shrink) or the codec this read asked for: never
  // lossy bytes a lossless read did not accept.
  const uint32_t allowed = (1u << static_cast<unsigned>(CodecKind::kRaw)) |
                           (1u << static_cast<unsigned>(part.post->compress.kind));
  std::vector<iovec> listed;  // a lazy read's runs, listed for the decoder
  if (part.runs) append_iovecs(part.runs, part.nruns, listed);
  const iovec* dst = part.runs ? listed.data() : part.dst;
  const size_t ndst = part.runs ? listed.size() : part.ndst;
  const int device = part.post->prep->staged ? part.post->prep->device : -1;  // the read lands in device memory
  Status d = device < 0 ? Decoder::decode(job.payload.data(), job.payload.size(), dst, ndst,
                                          "compressed read response", allowed)
                        : t.staging().decode(device, job.payload.data(), job.payload.size(), dst, ndst,
                                             "compressed read response", allowed);
  t.decoder().give_back(std::move(job.payload));
  if (d.code() == StatusCode::kProtocolError) {
    d = ProtocolError(d.message() + " (from " + c->desc() + ")");
    auto lk = c->lock_rx();
    t.fail_conn_locked(c, d, h.xfer_id, h.batch);
  } else if (!d.ok()) {
    d = Status(d.code(), d.message() + " (from " + c->desc() + ")");
  } else {
    spi::TransferControl(part.post->xfer).set_compression(codec_kind_name(part.post->compress.kind).data());
  }
  t.resolve(part, d.ok() ? part.bytes : 0, d);
  c->decode_done();
}

// The payload of a write is in place (or discarded): release it and acknowledge.
void FrameReceiver::write_landed(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = rx(c).cur;
  rx(c).pins.clear();
  rx(c).gens.reset();  // landed: a bump of these blocks may return now
  rx(c).dst_own.clear();
  rx(c).runs_own.clear();
  rx(c).runs = nullptr;
  const Status reject = std::move(rx(c).reject);
  rx(c).reject = Status::Ok();
  if (!reject.ok()) return reply(c, failed_ack(h, reject));  // discarded: no notification
  if (h.flags & kFlagNotif) {
    Status taken = t_.hooks()->deliver_notification(Notification{c->peer_name(), rx(c).ctrl.substr(rx(c).notif_off)});
    if (!taken.ok()) return reply(c, failed_ack(h, taken));  // the queue is full: the batch fails with it
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
  m->finalize();
  reply(c, std::move(m));
}

}  // namespace pdkv::tcp
