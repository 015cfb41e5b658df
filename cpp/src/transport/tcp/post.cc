// TcpTransport's posting (tcp_transport_impl.h): a prepared transfer's batches sent
// on the peer's connections (inline on the caller's thread when the send queue is
// empty, staged through pinned buffers for device memory, or encoded on an encoder
// thread when compressed), their parts settled as acks and read responses arrive, a
// notification alone, cancel, and a waiter driving its own connection. Preparing is
// prepare.cc; the rest of the transport tcp_transport.cc.
#include <poll.h>

#include <algorithm>
#include <cstring>

#include "transport/tcp/tcp_transport_impl.h"
#include "util/log.h"

namespace pdkv::tcp {

// ---------------------------------------------------------------- posting

void TcpTransport::post(const std::shared_ptr<const PreparedOps>& ops, const std::shared_ptr<Transfer>& xfer,
                        std::string notif) {
  auto prep = std::static_pointer_cast<const TcpPrepared>(ops);
  auto pcr = peer_conns(prep->peer);
  if (!pcr.ok()) {
    spi::TransferControl(xfer).fail_now(pcr.status());
    return;
  }
  bool sample = false;
  auto choice = choose_compression(*prep, **pcr, &sample);
  if (!choice.ok()) {
    spi::TransferControl(xfer).fail_now(choice.status());
    return;
  }
  const TcpCompression z = compression_of(*prep);
  if (!choice->compress && prep->plain) prep = prep->plain;  // auto chose plain: plain-sized batches
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->prep = prep;
  post->pc = *pcr;
  post->notif = std::move(notif);
  post->sample_codec = sample;
  const uint32_t nconn = opts_.conns_per_peer;
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  const uint32_t base = post->pc->rr.fetch_add(1, std::memory_order_relaxed);
  const bool spread = nconn > 1 && nb > 1;
  post->compress = *choice;
  post->reads_unsettled = nb;
  if (post->compress.compress && prep->op == OpKind::kRead) {
    post->zspec = make_zspec(z, post->compress.kind);
  } else if (post->compress.compress) {
    // (A read says so when a compressed response lands: the target may answer plain.)
    spi::TransferControl(xfer).set_compression(codec_kind_name(post->compress.kind).data());
  }
  // Compressed batches may leave out of order (several encoder threads): the
  // notification then follows the last ack, as for a spread transfer.
  const bool unordered = post->compress.compress && nb > 1;
  post->separate_notif = !post->notif.empty() && (prep->op == OpKind::kRead || spread || unordered);
  post->data_left = nb;
  spi::TransferControl(xfer).set_parts(nb + (post->separate_notif ? 1 : 0));
  std::weak_ptr<TcpPost> wp = post;
  spi::TransferControl(xfer).set_cancel_hook([this, wp] {
    if (auto p = wp.lock()) cancel(p);
  });
  if (post->compress.compress && prep->op == OpKind::kWrite) {
    post->zbase = base;
    return pump_encodes(post);
  }
  for (uint32_t i = 0; i < nb; ++i) {
    const uint32_t slot = (base + i) % nconn;
    if (prep->staged && prep->op == OpKind::kWrite) {
      staging_.run([this, post, i, slot] { stage_and_send(post, i, slot); });
    } else {
      send_batch(post, i, slot, nullptr);
    }
  }
}

void TcpTransport::send_batch(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot,
                              std::shared_ptr<cuda::PinnedBuffer> staged, std::shared_ptr<EncodedBatch> encoded,
                              std::shared_ptr<void> ticket) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  const uint32_t nb = static_cast<uint32_t>(prep->batches.size());
  PendingPart part{post, i, b.bytes};
  if (prep->op == OpKind::kRead && prep->lazy) {
    part.runs = &prep->runs[b.first];
    part.nruns = b.count;
    part.extents = b.extents;
  } else if (prep->op == OpKind::kRead) {
    part.dst = &prep->iov[b.first];
    part.ndst = b.count;
    part.extents = b.count;
  }
  Status connect_err;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    connect_err = post->connect_err;
  }
  if (!connect_err.ok() || spi::TransferControl(xfer).cancel_requested()) {
    resolve(part, 0, connect_err.ok() ? Cancelled("cancelled") : connect_err);
    return;
  }
  auto cr = get_conn(*post->pc, slot, true, xfer->deadline());
  if (!cr.ok()) {
    {
      std::lock_guard<std::mutex> lk(post->mu);
      post->connect_err = cr.status();
    }
    resolve(part, 0, cr.status());
    return;
  }
  auto& conn = *cr;
  {
    std::lock_guard<std::mutex> lk(post->mu);
    post->conns.push_back(conn);
  }
  const bool compressed = encoded != nullptr;  // (posted from an encoder thread: no driver for wait())
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(prep->op == OpKind::kWrite ? FrameType::kWrite : FrameType::kReadReq, xfer->id(), i);
  m->hdr.count = b.desc_count;
  if (prep->two_level) {
    m->hdr.flags |= kFlagStrided2;
    m->descs = &prep->sdescs2[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireStrided2Extent);
  } else if (prep->strided) {
    m->hdr.flags |= kFlagStrided;
    m->descs = &prep->sdescs[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireStridedExtent);
  } else {
    m->descs = &prep->descs[b.desc_first];
    m->desc_bytes = size_t(b.desc_count) * sizeof(WireExtent);
  }
  if (prep->op == OpKind::kWrite) {
    m->hdr.payload = b.bytes;
    m->gather_below = opts_.gather_below_bytes;
    if (encoded) {
      m->hdr.type = static_cast<uint16_t>(FrameType::kWriteZ);
      m->hdr.payload = encoded->bytes.size();
      m->own_iov.push_back({encoded->bytes.data(), encoded->bytes.size()});
      // Released once the frame left (or was dropped): the buffer goes back, the ticket
      // lets the next batch of this write be encoded.
      m->lease = std::make_shared<std::pair<std::shared_ptr<EncodedBatch>, std::shared_ptr<void>>>(std::move(encoded),
                                                                                                 std::move(ticket));
    } else if (staged) {
      m->own_iov.push_back({staged->data(), b.bytes});
      m->lease = std::move(staged);
    } else if (prep->lazy) {
      m->runs = &prep->runs[b.first];
      m->nruns = b.count;
    } else {
      m->data = &prep->iov[b.first];
      m->ndata = b.count;
    }
  }
  if (!prep->claim_aux.empty()) {
    m->hdr.flags |= kFlagGens;
    m->aux = prep->claim_aux;
  }
  const bool zreply = prep->op == OpKind::kRead && post->compress.compress;
  if (zreply) {  // the spec follows the claim (docs/wire.md, "Compressed reads")
    m->hdr.flags |= kFlagZReply;
    m->aux.append(reinterpret_cast<const char*>(&post->zspec), sizeof post->zspec);
  }
  if (prep->op == OpKind::kWrite && !post->separate_notif && !post->notif.empty() && i == nb - 1 &&
      !post->data_failed) {
    m->hdr.flags |= kFlagNotif;
    m->aux += post->notif;
  }
  m->keep = prep;
  m->finalize();
  if (prep->op == OpKind::kWrite) spi::TransferControl(xfer).add_wire_bytes(m->hdr.payload);
  if (!conn->track(std::move(part), xfer->id())) {
    resolve(PendingPart{post, i, b.bytes}, 0, ConnectionError("connection to " + conn->desc() + " closed"));
    return;
  }
  if (nb == 1 && !prep->staged && !compressed && !zreply) {
    // Small transfers: the caller's wait() reads the ack itself (one thread hop
    // fewer, the latency of a plain socket round trip). Not for device memory: the
    // caller's thread would have to bind a CUDA context.
    std::weak_ptr<TcpConn> wc = conn;
    spi::TransferControl(xfer).set_driver([this, wc](Transfer& x, Clock::time_point deadline, uint32_t spin_us) {
      if (auto c = wc.lock()) drive(c, x, deadline, spin_us);
    });
  }
  conn->owner()->enqueue(conn, std::move(m));
  conn->owner()->wake_if_idle();  // so it spins for the ack and enforces the deadline
}

void TcpTransport::stage_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, uint32_t slot) {
  const auto& prep = post->prep;
  const auto& xfer = post->xfer;
  const TcpBatch& b = prep->batches[i];
  auto fail = [&](const Status& st) {
    post->data_failed = true;
    resolve(PendingPart{post, i, b.bytes}, 0, st);
  };
  if (shut_) return fail(ConnectionError("agent is shutting down"));
  if (spi::TransferControl(xfer).cancel_requested()) return fail(Cancelled("cancelled"));
  if (post->data_failed) return fail(Cancelled("an earlier batch of this transfer failed"));
  auto abandon = [&] { return spi::TransferControl(xfer).cancel_requested() || shut_.load(); };
  auto buf = prep->lazy ? staging_.gather_runs(prep->device, &prep->runs[b.first], b.count, xfer->deadline(), abandon)
                        : staging_.gather(prep->device, &prep->iov[b.first], b.count, xfer->deadline(), abandon);
  if (!buf.ok()) return fail(buf.status());
  send_batch(post, i, slot, std::move(buf).value());
}

void TcpTransport::resolve(const PendingPart& p, uint64_t bytes, const Status& st) {
  const auto& post = p.post;
  if (post->separate_notif && p.batch != kNotifyBatch) {
    if (!st.ok()) post->data_failed = true;
    const bool last_data = post->data_left.fetch_sub(1, std::memory_order_acq_rel) == 1;
    settle(post, p.batch, bytes, st);
    if (last_data) {
      if (post->data_failed || spi::TransferControl(post->xfer).cancel_requested()) {
        spi::TransferControl(post->xfer).resolve_part(0, Cancelled("notification not sent: the data did not all land"));
      } else {
        send_separate_notify(post);
      }
    }
    return;
  }
  settle(post, p.batch, bytes, st);
}

void TcpTransport::settle(const std::shared_ptr<TcpPost>& post, uint32_t batch, uint64_t bytes, const Status& st) {
  if (post->prep && post->prep->op == OpKind::kRead && batch != kNotifyBatch && settle_read(post, bytes, st)) return;
  if (!spi::TransferControl(post->xfer).resolve_part(bytes, st)) return;
  // A plain write that completed measures the link to its peer (compression kAuto).
  if (!post->prep || post->prep->op != OpKind::kWrite || post->compress.compress) return;
  if (post->prep->zmode != CompressMode::kAuto || post->xfer->state() != XferState::kDone) return;
  post->pc->chooser.plain_delivered(post->prep->total, post->posted);
}

bool TcpTransport::settle_read(const std::shared_ptr<TcpPost>& post, uint64_t bytes, const Status& st) {
  if (!st.ok()) post->read_failed = true;
  if (post->reads_unsettled.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;  // not the last
  const TcpPrepared& prep = *post->prep;
  if (post->compress.compress || prep.zmode != CompressMode::kAuto || post->read_failed) return false;
  post->pc->read_chooser.plain_delivered(prep.total, post->posted);
  if (!post->sample_codec || prep.batches.empty()) return false;
  // Not on this (progress) thread: a sample costs a chunk's encode and decode.
  return encoder_->post([this, post, bytes, st] {
    const TcpPrepared& p = *post->prep;
    const CodecKind kind = codec_for_mode(compression_of(p), post->pc->features.codecs);
    std::vector<iovec> scratch;
    uint32_t n = 0;
    const iovec* iov = iovecs_of(p, p.batches[0], scratch, &n);
    encoder_->calibrate(kind, iov, n, /*again=*/true);
    spi::TransferControl(post->xfer).resolve_part(bytes, st);
  });
}

// ---------------------------------------------------------------- compression

TcpCompression TcpTransport::compression_of(const TcpPrepared& prep) const {
  TcpCompression z = opts_.compress;
  z.mode = prep.zmode;
  return z;
}

// Device memory: forced modes compress; auto only with FP8 kernels on a real GPU
// (device_staging.h; a lossless codec would run on the host after staging).
bool TcpTransport::device_may_compress(const TcpCompression& z, int device) {
  if (z.mode != CompressMode::kAuto) return true;
  return z.policy == CompressPolicy::kLossyAllowed && staging_.gpu_fp8_on_hardware(device);
}

Result<Choice> TcpTransport::choose_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample) {
  if (prep.zmode == CompressMode::kOff || prep.batches.empty()) return Choice{};
  if (prep.op == OpKind::kRead) {
    if (!prep.staged) return choose_read_compression(prep, pc, sample);
    // Into device memory: forced modes ask as for host memory (the response is decoded
    // on the GPU for fp8, on the host then copied in otherwise); auto only for FP8
    // with real GPU kernels, once a plain read measured the link (as writes), and
    // never a codec sample (that would read device memory on the host).
    const TcpCompression o = compression_of(prep);
    if (o.mode != CompressMode::kAuto) {
      bool no_sample = false;
      return choose_read_compression(prep, pc, &no_sample);
    }
    const PeerFeatures& f = pc.features;
    const bool peer_fp8 = f.compressed_read && ((f.codecs >> static_cast<unsigned>(CodecKind::kFp8)) & 1u);
    if (!peer_fp8 || !device_may_compress(o, prep.device) || pc.read_chooser.link_bps() == 0) return Choice{};
    return Choice{true, CodecKind::kFp8};
  }
  const TcpCompression o = compression_of(prep);
  const PeerFeatures& f = pc.features;
  const std::string& peer = pc.peer->md.name;
  auto decodes = [&](CodecKind k) { return f.compressed_write && ((f.codecs >> static_cast<unsigned>(k)) & 1u); };
  if (o.mode == CompressMode::kAuto && prep.staged) {
    // The GPU quantizes at device-memory speed, far above a socket: FP8 wins whenever
    // the peer decodes it, once a plain write has measured the link.
    if (!decodes(CodecKind::kFp8) || !device_may_compress(o, prep.device) || pc.chooser.link_bps() == 0)
      return Choice{};
    return Choice{true, CodecKind::kFp8};
  }
  if (o.mode == CompressMode::kAuto) {
    if (!f.compressed_write) return Choice{};  // an older peer: plain, as it expects
    const CodecKind k = codec_for_mode(o, f.codecs);
    std::vector<iovec> scratch;
    uint32_t n = 0;
    const iovec* iov = iovecs_of(prep, prep.batches[0], scratch, &n);
    encoder_->calibrate(k, iov, n, pc.chooser.resample_due());
    return pc.chooser.choose(*encoder_, k, f.codecs, CodecPipeline{encoder_->threads(), f.decode_threads});
  }
  const CodecKind k = o.mode == CompressMode::kFp8 ? CodecKind::kFp8 : o.codec;
  if (!f.compressed_write)
    return NotSupported("peer '" + peer + "' does not accept compressed writes (an older pdkv: its metadata has no "
                        "tcp features); set tcp.compress.mode to 'auto' or 'off' for it");
  if (!decodes(k))
    return NotSupported("peer '" + peer + "' cannot decode " + std::string(codec_kind_name(k)) +
                        " frames (its build lacks that library)");
  return Choice{true, k};
}

// A read asks; the target answers compressed or plain. So a peer that cannot answer
// compressed (an older pdkv, or one lacking the codec) is simply read plain, whatever
// the mode; kAuto decides from the delivered rate of plain reads from that peer (the
// initiator waits for the whole round trip, so its measure is the one that counts)
// and this agent's codec figures (sampled on bytes read from that peer).
Choice TcpTransport::choose_read_compression(const TcpPrepared& prep, PeerConns& pc, bool* sample) {
  const TcpCompression o = compression_of(prep);
  const PeerFeatures& f = pc.features;
  const CodecKind k = codec_for_mode(o, f.codecs);
  if (!f.compressed_read || !((f.codecs >> static_cast<unsigned>(k)) & 1u)) return Choice{};
  if (o.mode != CompressMode::kAuto) return Choice{true, k};
  const bool due = pc.read_chooser.resample_due() || encoder_->figures(k).encode_bps == 0;
  const Choice c = pc.read_chooser.choose(*encoder_, k, f.codecs, CodecPipeline{f.encode_threads, decoder_.threads()});
  *sample = !c.compress && due;
  return c;
}

void TcpTransport::pump_encodes(const std::shared_ptr<TcpPost>& post) {
  const uint32_t nb = static_cast<uint32_t>(post->prep->batches.size());
  for (;;) {
    uint32_t i = 0;
    std::vector<uint32_t> unsent;
    {
      std::lock_guard<std::mutex> lk(post->mu);
      if (post->znext >= nb || post->zinflight >= kEncodeAhead) return;
      if (encoder_->stopped()) {  // shutting down: fail the rest here, without recursing
        for (uint32_t j = post->znext; j < nb; ++j) unsent.push_back(j);
        post->znext = nb;
      } else {
        i = post->znext++;
        ++post->zinflight;
      }
    }
    if (!unsent.empty()) {
      post->data_failed = true;
      for (uint32_t j : unsent)
        resolve(PendingPart{post, j, post->prep->batches[j].bytes}, 0, ConnectionError("agent is shutting down"));
      return;
    }
    std::shared_ptr<void> ticket(new char, [this, post](void* p) {
      delete static_cast<char*>(p);
      {
        std::lock_guard<std::mutex> lk(post->mu);
        --post->zinflight;
      }
      pump_encodes(post);
    });
    encoder_->run([this, post, i, ticket]() mutable { encode_and_send(post, i, std::move(ticket)); });
  }
}

void TcpTransport::encode_and_send(const std::shared_ptr<TcpPost>& post, uint32_t i, std::shared_ptr<void> ticket) {
  const auto& prep = post->prep;
  const TcpBatch& b = prep->batches[i];
  auto fail = [&](const Status& st) {
    post->data_failed = true;
    resolve(PendingPart{post, i, b.bytes}, 0, st);
  };
  if (shut_) return fail(ConnectionError("agent is shutting down"));
  if (spi::TransferControl(post->xfer).cancel_requested()) return fail(Cancelled("cancelled"));
  if (post->data_failed) return fail(Cancelled("an earlier batch of this transfer failed"));
  auto buf = encoder_->buffer();
  Status st = prep->staged
                  ? staging_.encode(*encoder_, post->compress.kind, prep->device, &prep->iov[b.first], b.count,
                                    post->xfer->deadline(),
                                    [&] { return spi::TransferControl(post->xfer).cancel_requested() || shut_.load(); },
                                    *buf)
                  : encode_batch(*prep, b, post->compress.kind, *buf);
  if (!st.ok()) return fail(st.with_context("compressing batch " + std::to_string(i) + " of the write"));
  const uint32_t slot = (post->zbase + i) % opts_.conns_per_peer;
  send_batch(post, i, slot, nullptr, std::move(buf), std::move(ticket));
}

Status TcpTransport::encode_batch(const TcpPrepared& prep, const TcpBatch& b, CodecKind kind, EncodedBatch& out) {
  std::vector<iovec> scratch;
  uint32_t n = 0;
  const iovec* iov = iovecs_of(prep, b, scratch, &n);
  return encoder_->encode(kind, iov, n, out);
}

void TcpTransport::send_separate_notify(const std::shared_ptr<TcpPost>& p) {
  // Never connect from here (this may run on a progress thread).
  auto conn = get_conn(*p->pc, 0, false);
  if (!conn.ok()) {
    spi::TransferControl(p->xfer).resolve_part(0, conn.status().with_context("sending the notification"));
    return;
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kNotify, p->xfer->id(), kNotifyBatch);
  m->aux = p->notif;
  m->finalize();
  if (!(*conn)->track(PendingPart{p, kNotifyBatch, 0}, p->xfer->id())) {
    spi::TransferControl(p->xfer).resolve_part(0, ConnectionError("connection to peer '" + p->pc->peer->md.name + "' closed"));
    return;
  }
  (*conn)->owner()->enqueue(*conn, std::move(m));
  (*conn)->owner()->wake_if_idle();
}

void TcpTransport::notify(std::shared_ptr<const Peer> peer, const std::shared_ptr<Transfer>& xfer, std::string notif) {
  auto pcr = peer_conns(peer);
  if (!pcr.ok()) {
    spi::TransferControl(xfer).fail_now(pcr.status());
    return;
  }
  auto post = std::make_shared<TcpPost>();
  post->xfer = xfer;
  post->pc = *pcr;
  post->notif = std::move(notif);
  post->separate_notif = true;
  auto cr = get_conn(*post->pc, 0, true, xfer->deadline());
  if (!cr.ok()) {
    spi::TransferControl(xfer).resolve_part(0, cr.status());
    return;
  }
  send_separate_notify(post);
}

void TcpTransport::cancel(const std::shared_ptr<TcpPost>& p) {
  std::vector<std::shared_ptr<TcpConn>> conns;
  {
    std::lock_guard<std::mutex> lk(p->mu);
    for (auto& w : p->conns)
      if (auto c = w.lock()) conns.push_back(c);
  }
  for (auto& c : conns)
    for (auto& part : c->drop_unsent(p->xfer->id())) resolve(part, 0, Cancelled("cancelled before it was sent"));
}

void TcpTransport::drive(const std::shared_ptr<TcpConn>& c, Transfer& x, Clock::time_point deadline,
                         uint32_t /*spin_us*/) {
  auto rl = c->try_lock_rx();
  if (!rl || !c->open()) return;
  if (!c->set_driven(true)) return;  // the owner thread stops watching EPOLLIN while we read
  deadline = std::min(deadline, x.deadline());
  while (!x.terminal() && c->open()) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    Status stalled = c->owner()->frame_stalled(*c, now);
    if (!stalled.ok()) {
      kill_locked(c, stalled);
      break;
    }
    // Blocks at once, in slices of <= 10 ms so deadlines and shutdown are noticed; no
    // busy spin first (wait_spin_us is for waits without a driver). Measured on the
    // 2-core VM, 32 KiB writes, p50: with two busy processes beside it a caller that
    // polled here for 50 us first waited 80 us for its ack, one blocked in poll 27-33 us;
    // beside other sessions' work (load ~7) 30.8-31.1 against 27.7-28.4 us
    // (bench/results/tcpperf/drive-spin.txt).
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
    const int timeout = static_cast<int>(std::min<int64_t>(left, 10));
    pollfd pf{c->fd(), POLLIN | POLLRDHUP, 0};
    const int r = ::poll(&pf, 1, timeout);
    if (r > 0) c->owner()->on_readable(c, &x);  // stops at our ack: no read to see EAGAIN
  }
  c->set_driven(false);
}

}  // namespace pdkv::tcp
