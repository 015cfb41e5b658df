#include "transport/tcp/receiver.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "transport/tcp/compress.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/progress.h"
#include "transport/tcp/scatter.h"
#include "transport/tcp/tcp_transport_impl.h"
#include "util/socket.h"

namespace pdkv::tcp {
namespace {

// Most bytes one receive() call takes from a connection before the owner thread
// moves on to the others (fairness).
constexpr uint64_t kReceiveBudget = 64ull << 20;

// One read of up to `want` payload bytes into `buf`; the read that completes the
// payload also takes the next frame's header (one syscall less per frame). The
// syscall's result.
ssize_t recv_with_next_header(int fd, RxState& st, void* buf, size_t want) {
  iovec iov[2] = {{buf, want}, {&st.hdr, kHdr}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = want == st.remaining ? 2 : 1;
  st.asked = want + (mh.msg_iovlen == 2 ? kHdr : 0);
  return ::recvmsg(fd, &mh, MSG_DONTWAIT);
}

}  // namespace

// An ack carrying a refused part's status and message (the connection stays).
std::unique_ptr<OutMsg> failed_ack(const FrameHeader& h, const Status& why) {
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
  m->hdr.status = static_cast<uint32_t>(why.code());
  m->aux = why.message().substr(0, kMaxErrorBytes);
  m->finalize();
  return m;
}

// ---------------------------------------------------------------- the byte stream

uint64_t FrameReceiver::receive(const std::shared_ptr<TcpConn>& c, const Transfer* until) {
  uint64_t got = 0;
  uint64_t budget = kReceiveBudget;
  while (c->fd() >= 0 && !c->draining() && budget > 0 && !c->reading_paused()) {
    bool stop = false;
    ssize_t r = 0;
    switch (rx(c).stage) {
      case RxStage::kHeader: r = read_header(c, &stop); break;
      case RxStage::kControl: r = read_control(c, &stop); break;
      case RxStage::kPayload:
        r = rx(c).staged   ? read_staged_payload(c, &budget, &stop)
            : rx(c).zgrow  ? read_zbuf_payload(c, &budget, &stop)
            : rx(c).gather ? read_landed_payload(c, &budget, &stop)
                           : read_payload(c, &budget, &stop);
        break;
    }
    if (r > 0) {
      got += static_cast<uint64_t>(r);
      if (stop || (until && until->terminal())) return got;
      // Fewer bytes than asked: the socket was empty. Return now instead of reading
      // again to see EAGAIN (a syscall per frame on the latency path); readiness is
      // level-triggered for both callers (the owner's epoll, drive()'s poll), so bytes
      // that arrive meanwhile are reported again.
      if (static_cast<size_t>(r) < rx(c).asked) {
        if (c->fd() >= 0) lowat_for_payload(c);
        return got;
      }
      continue;
    }
    if (r == 0) {
      t_.kill_locked(c, ConnectionError(rx(c).mid_frame() ? c->desc() + " closed the connection in the middle of a frame"
                                                       : c->desc() + " closed the connection"));
      return got;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      lowat_for_payload(c);
      return got;
    }
    t_.kill_locked(c, ConnectionError("receiving from " + c->desc() + " failed: " + util::errno_str(errno)));
    return got;
  }
  return got;
}

// Waiting in the middle of a payload: no wake-up until a good share of the rest is
// there (TcpOptions::rcvlowat_bytes).
void FrameReceiver::lowat_for_payload(const std::shared_ptr<TcpConn>& c) {
  if (rx(c).stage == RxStage::kPayload && t_.opts().rcvlowat_bytes > 0) {
    set_lowat(*c, static_cast<int>(
                      std::max<uint64_t>(1, std::min<uint64_t>(t_.opts().rcvlowat_bytes, rx(c).remaining / 2))));
  }
}

ssize_t FrameReceiver::read_header(const std::shared_ptr<TcpConn>& c, bool* stop) {
  rx(c).asked = kHdr - rx(c).hdr_got;
  ssize_t r = ::recv(c->fd(), reinterpret_cast<char*>(&rx(c).hdr) + rx(c).hdr_got, kHdr - rx(c).hdr_got, MSG_DONTWAIT);
  if (r > 0) {
    rx(c).hdr_got += static_cast<size_t>(r);
    if (rx(c).hdr_got == kHdr && !on_header(c)) *stop = true;
  }
  return r;
}

ssize_t FrameReceiver::read_control(const std::shared_ptr<TcpConn>& c, bool* stop) {
  rx(c).asked = rx(c).ctrl.size() - rx(c).ctrl_got;
  ssize_t r = ::recv(c->fd(), rx(c).ctrl.data() + rx(c).ctrl_got, rx(c).ctrl.size() - rx(c).ctrl_got, MSG_DONTWAIT);
  if (r > 0) {
    rx(c).ctrl_got += static_cast<size_t>(r);
    if (rx(c).ctrl_got == rx(c).ctrl.size() && !on_control(c)) *stop = true;
  }
  return r;
}

// Straight into the destination extents; the last read also takes the next header.
ssize_t FrameReceiver::read_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop) {
  iovec iov[kIovMax];
  int n = 0;
  size_t i = rx(c).dst_idx;
  for (; i < rx(c).ndst && n < kIovMax - 1; ++i) {
    size_t off = (i == rx(c).dst_idx) ? rx(c).dst_off : 0;
    iov[n].iov_base = static_cast<char*>(rx(c).dst[i].iov_base) + off;
    iov[n].iov_len = rx(c).dst[i].iov_len - off;
    ++n;
  }
  const bool last = (i == rx(c).ndst);
  if (last) iov[n++] = {&rx(c).hdr, kHdr};  // pick up the next header in the same call
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = static_cast<size_t>(n);
  rx(c).asked = 0;
  for (int k = 0; k < n; ++k) rx(c).asked += iov[k].iov_len;
  ssize_t r = ::recvmsg(c->fd(), &mh, MSG_DONTWAIT);
  if (r <= 0) return r;
  *budget -= std::min<uint64_t>(*budget, static_cast<uint64_t>(r));
  const uint64_t take = std::min<uint64_t>(static_cast<uint64_t>(r), rx(c).remaining);
  advance_dst(rx(c), take, nullptr);
  payload_received(c, take, static_cast<uint64_t>(r) - take, stop);
  return r;
}

// Small extents: into the landing chunk (and the next header, on the last read),
// then copied out to the destination extents.
ssize_t FrameReceiver::read_landed_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop) {
  RxState& st = rx(c);
  if (!st.landing) st.landing.reset(new char[kStageBytes]);  // uninitialized: only received bytes are copied out
  const size_t want = static_cast<size_t>(std::min<uint64_t>(st.remaining, kStageBytes));
  ssize_t r = recv_with_next_header(c->fd(), st, st.landing.get(), want);
  if (r <= 0) return r;
  *budget -= std::min<uint64_t>(*budget, static_cast<uint64_t>(r));
  const uint64_t take = std::min<uint64_t>(static_cast<uint64_t>(r), st.remaining);
  advance_dst(st, take, st.landing.get());
  payload_received(c, take, static_cast<uint64_t>(r) - take, stop);
  return r;
}

// A compressed frame's payload: into zbuf, grown only as far as the bytes coming
// next (at most double what already arrived, at least kZbufFirstBytes), so its
// memory follows what the peer actually sent.
ssize_t FrameReceiver::read_zbuf_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop) {
  RxState& st = rx(c);
  const uint64_t room = st.zbuf.size() - st.zgot;
  if (room == 0) {
    const uint64_t grow = std::min<uint64_t>(st.remaining, std::max<uint64_t>(kZbufFirstBytes, st.zgot));
    st.zbuf.resize(static_cast<size_t>(st.zgot + grow));
  }
  const size_t want = static_cast<size_t>(std::min<uint64_t>(st.remaining, st.zbuf.size() - st.zgot));
  ssize_t r = recv_with_next_header(c->fd(), st, st.zbuf.data() + st.zgot, want);
  if (r <= 0) return r;
  *budget -= std::min<uint64_t>(*budget, static_cast<uint64_t>(r));
  const uint64_t take = std::min<uint64_t>(static_cast<uint64_t>(r), st.remaining);
  st.zgot += take;
  if (take == st.remaining) st.zgrow = false;  // complete: zbuf holds exactly the payload
  payload_received(c, take, static_cast<uint64_t>(r) - take, stop);
  return r;
}

void FrameReceiver::advance_dst(RxState& st, uint64_t n, const char* from) {
  if (st.runs) {  // landed into strided runs (begin_write_payload, on_read_response_header)
    scatter_to_runs(st.runs, st.nruns, st.run_cur, from, n);
    return;
  }
  IovCursor cur{st.dst_idx, st.dst_off};
  if (from) {
    scatter_to_iov(st.dst, st.ndst, cur, from, n);  // landed: copy on the way (scatter.h)
  } else {
    while (n > 0) {
      const size_t step = static_cast<size_t>(std::min<uint64_t>(n, st.dst[cur.idx].iov_len - cur.off));
      n -= step;
      cur.off += step;
      if (cur.off == st.dst[cur.idx].iov_len) {
        ++cur.idx;
        cur.off = 0;
      }
    }
  }
  st.dst_idx = cur.idx;
  st.dst_off = cur.off;
}

void FrameReceiver::payload_received(const std::shared_ptr<TcpConn>& c, uint64_t took, uint64_t extra, bool* stop) {
  RxState& st = rx(c);
  st.remaining -= took;
  if (st.remaining != 0) return;
  st.hdr_got = static_cast<size_t>(extra);
  on_payload_done(c);
  if (c->fd() < 0 || (st.hdr_got == kHdr && !on_header(c))) *stop = true;
}

// Into the pinned buffer the ScatterPipe offers; it copies full ones to the GPU.
ssize_t FrameReceiver::read_staged_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop) {
  const iovec sp = rx(c).pipe->space();
  rx(c).asked = sp.iov_len;
  ssize_t r = ::recv(c->fd(), sp.iov_base, sp.iov_len, MSG_DONTWAIT);
  if (r <= 0) return r;
  *budget -= std::min<uint64_t>(*budget, static_cast<uint64_t>(r));
  rx(c).remaining -= static_cast<uint64_t>(r);
  Status st = rx(c).pipe->received(static_cast<uint64_t>(r));
  if (!st.ok()) {
    staged_rx_failed(c, st);
    *stop = true;
    return r;
  }
  if (rx(c).remaining == 0) {
    on_payload_done(c);
    if (c->fd() < 0) *stop = true;
  }
  return r;
}

void FrameReceiver::set_lowat(TcpConn& c, int v) {
  if (v == rx(c).cur_lowat) return;
  if (::setsockopt(c.fd(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v) == 0) rx(c).cur_lowat = v;
}

void FrameReceiver::reply(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m) {
  c->owner()->enqueue(c, std::move(m));
}

// ---------------------------------------------------------------- headers

bool FrameReceiver::on_header(const std::shared_ptr<TcpConn>& c) {
  rx(c).cur = rx(c).hdr;
  rx(c).hdr_got = 0;
  const FrameHeader& h = rx(c).cur;
  // One place decides what may arrive here, and how large, before anything is
  // allocated (wire.h, docs/wire.md).
  const ConnState state{c->outbound() ? ConnRole::kOutbound : ConnRole::kInbound,
                        c->outbound() || c->authed() ? ConnPhase::kOpen
                        : rx(c).proof                ? ConnPhase::kProofWait
                                                     : ConnPhase::kHandshake};
  Status valid = check_header(h, state, t_.frame_limits());
  if (!valid.ok()) {
    t_.fail_conn_locked(c, ProtocolError(valid.message() + " from " + c->desc()), h.xfer_id, h.batch);
    return false;
  }
  if (!c->outbound() && c->authed() && !c->admitted()) {
    // The per-peer connection cap (TcpOptions::max_inbound_per_peer), at the first
    // frame after the handshake at the latest (admit() is a no-op once taken).
    Status in = t_.admit(c, c->peer_name());
    if (!in.ok()) {
      t_.fail_conn_locked(c, in, h.xfer_id, h.batch);
      return false;
    }
  }
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kAck: {
      if (h.aux_len > 0) break;  // a failure message follows (on_failed_ack)
      PendingPart part;
      if (!c->take_pending(h.xfer_id, h.batch, &part)) {
        t_.fail_conn_locked(c, ProtocolError("ack for unknown transfer " + std::to_string(h.xfer_id)), h.xfer_id,
                            h.batch);
        return false;
      }
      t_.resolve(part, part.bytes,
                 h.status == 0 ? Status::Ok() : Status(status_code_from_wire(h.status), "peer reported failure"));
      rx(c).stage = RxStage::kHeader;
      return true;
    }
    case FrameType::kReadResp:
      return on_read_response_header(c);
    case FrameType::kReadRespZ:
      return on_compressed_read_response_header(c);
    default:
      break;
  }
  const uint64_t ctrl = control_bytes(h);  // bounded by check_header
  if (ctrl == 0) return on_control(c);
  rx(c).ctrl.resize(ctrl);
  rx(c).ctrl_got = 0;
  rx(c).stage = RxStage::kControl;
  return true;
}

bool FrameReceiver::on_read_response_header(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = rx(c).cur;
  auto bad = [&](const std::string& why) {
    t_.fail_conn_locked(c, ProtocolError(why), h.xfer_id, h.batch);
    return false;
  };
  if (!c->find_pending_read(h.xfer_id, h.batch, &rx(c).read_part))
    return bad("read response for unknown transfer " + std::to_string(h.xfer_id));
  if (h.payload != rx(c).read_part.bytes)
    return bad("read response carries " + std::to_string(h.payload) + " bytes, expected " +
               std::to_string(rx(c).read_part.bytes));
  const PendingPart& part = rx(c).read_part;
  rx(c).dst = part.dst;
  rx(c).ndst = part.ndst;
  rx(c).runs = nullptr;
  rx(c).nruns = 0;
  const bool staged = part.post->prep->staged;
  if (part.runs && (staged || lands(h.payload, part.extents, t_.opts().land_below_bytes))) {  // a lazy read's runs, walked while landing
    rx(c).runs = part.runs;
    rx(c).nruns = part.nruns;
    rx(c).run_cur = RunCursor{};
  } else if (part.runs) {  // pieces large enough to receive into directly: listed
    rx(c).dst_own.clear();
    append_iovecs(part.runs, part.nruns, rx(c).dst_own);
    rx(c).dst = rx(c).dst_own.data();
    rx(c).ndst = rx(c).dst_own.size();
  }
  rx(c).dst_idx = 0;
  rx(c).dst_off = 0;
  rx(c).remaining = h.payload;
  rx(c).gather = lands(h.payload, part.extents, t_.opts().land_below_bytes);
  rx(c).stage = RxStage::kPayload;
  if (staged) {
    Status st = begin_staged_rx(*c, rx(c).read_part.post->prep->device);
    if (!st.ok()) {
      t_.kill_locked(c, st.with_context("receiving a read response into device memory"));
      return false;
    }
  }
  return true;
}

// The payload (codec frames, at most kMaxCompressedPayload bytes: check_header) is
// received into zbuf; the pending part stays in the table (deadlines, connection
// death) until the payload is in.
// A compressed frame's payload is read whole into st.zbuf (a buffer a decoded batch
// gave back, when there is one), then decoded off this thread.
void FrameReceiver::receive_into_zbuf(RxState& st, uint64_t payload) {
  if (st.zbuf.capacity() == 0) st.zbuf = t_.decoder().buffer();
  // Grown as the bytes arrive (read_zbuf_payload); a reused buffer's capacity is
  // used without zero-filling it here.
  st.zbuf.clear();
  st.zgot = 0;
  st.zgrow = true;
  st.dst_own.clear();
  st.dst = nullptr;
  st.ndst = 0;
  st.runs = nullptr;
  st.nruns = 0;
  st.dst_idx = 0;
  st.dst_off = 0;
  st.remaining = payload;
  st.gather = false;
  st.stage = RxStage::kPayload;
}

bool FrameReceiver::on_compressed_read_response_header(const std::shared_ptr<TcpConn>& c) {
  RxState& st = rx(c);
  const FrameHeader& h = st.cur;
  auto bad = [&](const std::string& why) {
    t_.fail_conn_locked(c, ProtocolError(why + " from " + c->desc()), h.xfer_id, h.batch);
    return false;
  };
  if (!c->find_pending_read(h.xfer_id, h.batch, &st.read_part))
    return bad("compressed read response for unknown transfer " + std::to_string(h.xfer_id));
  if (!st.read_part.post->compress.compress)
    return bad("compressed read response to transfer " + std::to_string(h.xfer_id) +
               ", which did not ask for one");
  receive_into_zbuf(st, h.payload);
  return true;
}

// ---------------------------------------------------------------- control frames

bool FrameReceiver::on_control(const std::shared_ptr<TcpConn>& c) {
  rx(c).stage = RxStage::kHeader;
  switch (static_cast<FrameType>(rx(c).cur.type)) {
    case FrameType::kHello: return on_hello(c);
    case FrameType::kProof: return on_proof(c);
    case FrameType::kMetaReq: return on_metadata_request(c);
    case FrameType::kWrite:
    case FrameType::kWriteZ:
    case FrameType::kReadReq: return on_data_request(c);
    case FrameType::kAck: return on_failed_ack(c);
    case FrameType::kNotify: return on_notify(c);
    case FrameType::kError: return on_error(c);
    default:
      t_.fail_conn_locked(c, Internal("unhandled frame type " + std::to_string(rx(c).cur.type)));
      return false;
  }
}

bool FrameReceiver::on_hello(const std::shared_ptr<TcpConn>& c) {
  AgentHooks* hooks = t_.hooks();
  auto body = decode_hello(rx(c).ctrl);
  if (!body.ok()) {
    const Status& e = body.status();
    t_.fail_conn_locked(c, e.code() == StatusCode::kVersionMismatch
                               ? e
                               : ProtocolError("malformed hello from " + c->desc() + ": " + e.message()));
    return false;
  }
  const std::string& from = body->from;
  // A (source, agent name) that recently failed to authenticate waits before its next
  // guess is even looked at; other agents on the same host do not (guard.h).
  const double wait = t_.auth_backoff().wait_s(c->source(), from, Clock::now());
  if (wait > 0) {
    char left[32];
    snprintf(left, sizeof left, "%.1f", wait);
    t_.fail_conn_locked(c, AuthFailed("too many failed authentications from " + c->source() + " (as agent '" + from +
                                      "'); retry in " + left + " s"));
    return false;
  }
  const std::string& to = body->to;
  const uint64_t expect = body->instance;
  if (!to.empty() && to != hooks->agent_name()) {
    t_.fail_conn_locked(c, AuthFailed("this is agent '" + hooks->agent_name() + "', not '" + to + "'"));
    return false;
  }
  if (expect != 0 && expect != hooks->instance_id()) {
    t_.fail_conn_locked(c, StalePeer("agent '" + hooks->agent_name() +
                                     "' restarted since its metadata was fetched; fetch it again and re-add the peer"));
    return false;
  }
  // Challenge: the initiator proves first; we prove ourselves only after its proof
  // checked (on_proof), so a peer without the secret learns nothing from us.
  auto m = std::make_unique<OutMsg>();
  auto pending = begin_challenge(*body, hooks->agent_name(), hooks->instance_id(), &m->aux,
                                 c->tls() ? c->tls()->binding() : auth::ChannelBinding{});
  if (!pending.ok()) {
    t_.fail_conn_locked(c, pending.status().with_context("handshake with " + c->desc()));
    return false;
  }
  rx(c).proof = std::make_unique<auth::TargetHandshake>(std::move(pending).value());
  m->hdr = make_hdr(FrameType::kChallenge, 0, 0);
  m->finalize();
  reply(c, std::move(m));
  return true;
}

bool FrameReceiver::on_proof(const std::shared_ptr<TcpConn>& c) {
  AgentHooks* hooks = t_.hooks();
  std::unique_ptr<auth::TargetHandshake> p = std::move(rx(c).proof);
  auto mac = decode_mac(rx(c).ctrl, "proof");
  if (!mac.ok()) {  // unreachable: check_header fixed its size
    t_.fail_conn_locked(c, ProtocolError("malformed proof from " + c->desc() + ": " + mac.status().message()));
    return false;
  }
  const std::string from = p->initiator();
  auth::Mac ack{};
  auto matched = p->check(*mac, hooks->accepted_keys(), &ack);
  if (!matched.ok()) {
    t_.auth_backoff().failed(c->source(), from, Clock::now());
    t_.fail_conn_locked(c, matched.status());
    return false;
  }
  t_.auth_backoff().succeeded(c->source(), from);
  c->authenticate(from);
  // The per-peer connection cap, now that the peer's name is proved (admission.h).
  if (Status in = t_.admit(c, from); !in.ok()) {
    t_.fail_conn_locked(c, in);
    return false;
  }
  auto m = std::make_unique<OutMsg>();
  m->aux = encode_mac(ack);
  m->hdr = make_hdr(FrameType::kHelloAck, 0, 0);
  m->finalize();
  reply(c, std::move(m));
  return true;
}

bool FrameReceiver::on_metadata_request(const std::shared_ptr<TcpConn>& c) {
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kMetaResp, 0, 0);
  m->aux = t_.hooks()->metadata_blob();
  m->finalize();
  reply(c, std::move(m));
  return true;
}

// A failed part with its message (block generations).
bool FrameReceiver::on_failed_ack(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = rx(c).cur;
  PendingPart part;
  if (!c->take_pending(h.xfer_id, h.batch, &part)) {
    t_.fail_conn_locked(c, ProtocolError("ack for unknown transfer " + std::to_string(h.xfer_id) + " from " + c->desc()),
                        h.xfer_id, h.batch);
    return false;
  }
  t_.resolve(part, 0, Status(status_code_from_wire(h.status), "peer '" + c->peer_name() + "': " + rx(c).ctrl));
  return true;
}

bool FrameReceiver::on_notify(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader& h = rx(c).cur;
  Status taken = t_.hooks()->deliver_notification(Notification{c->peer_name(), rx(c).ctrl});
  if (!taken.ok()) {  // the queue is full: the sender's notify fails with it
    reply(c, failed_ack(h, taken));
    return true;
  }
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(FrameType::kAck, h.xfer_id, h.batch);
  m->finalize();
  reply(c, std::move(m));
  return true;
}

bool FrameReceiver::on_error(const std::shared_ptr<TcpConn>& c) {
  const FrameHeader h = rx(c).cur;
  Status st(status_code_from_wire(h.status), c->desc() + " refused the request: " + rx(c).ctrl);
  PendingPart part;
  const bool found = c->take_pending(h.xfer_id, h.batch, &part);
  // Retire the connection before the caller can learn of the failure, so its next
  // transfer opens a fresh connection instead of racing onto this closing one.
  t_.kill_locked(c, ConnectionError(c->desc() + " closed the connection after an error: " + rx(c).ctrl));
  if (found) t_.resolve(part, 0, st);
  return false;
}

}  // namespace pdkv::tcp
