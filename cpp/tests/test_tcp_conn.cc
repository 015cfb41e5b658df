// The tcp transport's pieces below the frame rules: an outgoing frame's send cursor
// (out_msg.h), a connection's pending table and send queue (conn.h), and the
// initiator's blocking handshake and metadata request (handshake.h), each against
// a socket pair or a scripted target on 127.0.0.1.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp/conn.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/handshake.h"
#include "transport/tcp/out_msg.h"
#include "util/socket.h"

namespace pdkv::tcp {
namespace {

struct SocketPair {
  int a = -1, b = -1;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    a = fds[0];
    b = fds[1];
  }
  ~SocketPair() {
    if (a >= 0) ::close(a);
    if (b >= 0) ::close(b);
  }
};

std::string read_exactly(int fd, size_t n) {
  std::string out(n, '\0');
  EXPECT_TRUE(util::recv_all(fd, out.data(), n, util::deadline_after(5)).ok());
  return out;
}

std::string frame_bytes(const FrameHeader& h, const std::string& aux) {
  std::string out(reinterpret_cast<const char*>(&h), kHdr);
  return out + aux;
}

// ---------------------------------------------------------------- OutMsg

TEST(TcpOutMsg, FinalizeCountsEveryPartAndSendSomeWritesThemInOrder) {
  const WireExtent ext{7, 16, 5};
  std::string payload_a = "hello", payload_b = "world!";
  OutMsg m;
  m.hdr = make_hdr(FrameType::kWrite, 42, 3);
  m.hdr.count = 1;
  m.descs = &ext;
  m.desc_bytes = sizeof ext;
  m.aux = "AUX";
  m.own_iov = {{payload_a.data(), payload_a.size()}, {payload_b.data(), payload_b.size()}};
  m.finalize();
  EXPECT_EQ(m.hdr.aux_len, 3u);
  EXPECT_EQ(m.total, kHdr + sizeof ext + 3 + 11);
  EXPECT_EQ(m.nsegs(), 5u);

  SocketPair sp;
  int err = 0;
  ASSERT_EQ(send_some(sp.a, m, &err), 1);
  EXPECT_EQ(m.sent, m.total);
  const std::string got = read_exactly(sp.b, m.total);
  FrameHeader h = decode_header(got.data());
  EXPECT_EQ(h.xfer_id, 42u);
  EXPECT_EQ(h.batch, 3u);
  EXPECT_EQ(h.aux_len, 3u);
  WireExtent e;
  std::memcpy(&e, got.data() + kHdr, sizeof e);
  EXPECT_EQ(e.region, 7u);
  EXPECT_EQ(got.substr(kHdr + sizeof e), "AUXhelloworld!");
}

TEST(TcpOutMsg, AdvanceResumesInsideASegment) {
  std::string payload = "0123456789";
  OutMsg m;
  m.hdr = make_hdr(FrameType::kReadResp, 1, 0);
  m.own_iov = {{payload.data(), payload.size()}};
  m.finalize();
  m.advance(kHdr + 4);  // the header and "0123" already left
  EXPECT_EQ(m.seg, 3u);
  EXPECT_EQ(m.seg_off, 4u);
  SocketPair sp;
  int err = 0;
  ASSERT_EQ(send_some(sp.a, m, &err), 1);
  EXPECT_EQ(read_exactly(sp.b, 6), "456789");
}

TEST(TcpOutMsg, SendSomeReportsWouldBlockThenFinishes) {
  SocketPair sp;
  int small = 4096;
  ASSERT_EQ(::setsockopt(sp.a, SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  std::string payload(1 << 20, 'x');
  OutMsg m;
  m.hdr = make_hdr(FrameType::kReadResp, 1, 0);
  m.own_iov = {{payload.data(), payload.size()}};
  m.finalize();
  int err = 0;
  ASSERT_EQ(send_some(sp.a, m, &err), 0);  // the socket is full
  EXPECT_GT(m.sent, 0u);
  EXPECT_LT(m.sent, m.total);
  std::thread reader([&] { read_exactly(sp.b, m.total); });
  int r = 0;
  while ((r = send_some(sp.a, m, &err)) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  reader.join();
  EXPECT_EQ(r, 1);
  EXPECT_EQ(m.sent, m.total);
}

// Many small extents (and sizes around the thresholds) sent through the staging
// chunk, over a socket with a tiny send buffer so the frame leaves in many pieces
// and the stage is refilled between them: the bytes on the wire are exactly the
// header, descriptors, aux and the extents concatenated.
TEST(TcpOutMsg, SmallExtentsAreGatheredAndSentBitExact) {
  std::vector<char> pool(8 << 20);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<char>(i * 131 + (i >> 9));
  std::vector<iovec> ext;
  std::string expect;
  size_t off = 0;
  const size_t sizes[] = {1, 255, 256, 257, 511, 512, 513, 1000, 4095, 4096, 4097, 300};
  for (size_t i = 0; off + 5000 < pool.size() && ext.size() < 6000; ++i) {
    const size_t n = sizes[i % (sizeof sizes / sizeof sizes[0])];
    ext.push_back({pool.data() + off, n});
    expect.append(pool.data() + off, n);
    off += n + 37 * (i % 5) + 1;  // scattered, never adjacent
  }
  std::vector<WireExtent> descs(ext.size(), WireExtent{1, 0, 0});
  OutMsg m;
  m.hdr = make_hdr(FrameType::kWrite, 5, 0);
  m.hdr.count = static_cast<uint32_t>(descs.size());
  m.descs = descs.data();
  m.desc_bytes = descs.size() * sizeof(WireExtent);
  m.aux = "notif";
  m.data = ext.data();
  m.ndata = ext.size();
  m.gather_below = TcpOptions{}.gather_below_bytes;
  m.finalize();
  ASSERT_TRUE(m.gather);
  ASSERT_GT(expect.size(), kStageBytes);  // the stage is refilled
  EXPECT_EQ(m.total, kHdr + m.desc_bytes + 5 + expect.size());

  SocketPair sp;
  int small = 4096;
  ASSERT_EQ(::setsockopt(sp.a, SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  ASSERT_EQ(::fcntl(sp.a, F_SETFL, O_NONBLOCK), 0);
  std::string got;
  std::thread reader([&] { got = read_exactly(sp.b, m.total); });
  int err = 0, r = 0;
  while ((r = send_some(sp.a, m, &err)) == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  reader.join();
  ASSERT_EQ(r, 1);
  EXPECT_EQ(m.sent, m.total);
  EXPECT_EQ(m.stage, nullptr);  // released once sent
  EXPECT_EQ(decode_header(got.data()).count, descs.size());
  EXPECT_EQ(got.substr(kHdr + m.desc_bytes, 5), "notif");
  EXPECT_TRUE(got.substr(kHdr + m.desc_bytes + 5) == expect);
}

TEST(TcpOutMsg, GatheringIsForSmallExtentsOnly) {
  const TcpOptions o;  // the thresholds' defaults
  EXPECT_TRUE(gathers(1000 * 256, 1000, o.gather_below_bytes));
  EXPECT_TRUE(gathers(2 * (o.gather_below_bytes - 1), 2, o.gather_below_bytes));
  EXPECT_FALSE(gathers(2 * o.gather_below_bytes, 2, o.gather_below_bytes));  // 8 KiB extents keep their iovecs
  EXPECT_FALSE(gathers(100, 1, o.gather_below_bytes));  // one extent is one segment anyway
  EXPECT_FALSE(gathers(1000 * 256, 1000, 0));           // 0: never
  EXPECT_TRUE(lands(1000 * 256, 1000, o.land_below_bytes));
  EXPECT_FALSE(lands(1000 * o.land_below_bytes, 1000, o.land_below_bytes));
  EXPECT_FALSE(lands(100, 1, o.land_below_bytes));
  // The back-pressure cost of a gathered message counts its stage, and does not
  // change once it is sending.
  std::vector<char> pool(1 << 16);
  std::vector<iovec> ext = {{pool.data(), 100}, {pool.data() + 200, 100}};
  OutMsg m;
  m.hdr = make_hdr(FrameType::kReadResp, 1, 0);
  m.own_iov = ext;
  m.gather_below = o.gather_below_bytes;
  m.finalize();
  ASSERT_TRUE(m.gather);
  const size_t cost = m.cost();
  EXPECT_GE(cost, kStageBytes);
  m.refill_stage();
  EXPECT_EQ(m.cost(), cost);
  EXPECT_EQ(m.stage_len, 200u);
}

TEST(TcpOutMsg, SendSomeReportsTheErrorOfAClosedPeer) {
  SocketPair sp;
  ::close(sp.b);
  sp.b = -1;
  OutMsg m;
  m.hdr = make_hdr(FrameType::kNotify, 1, 0);
  m.aux = "n";
  m.finalize();
  int err = 0;
  EXPECT_EQ(send_some(sp.a, m, &err), -1);
  EXPECT_EQ(err, EPIPE);
}

TEST(TcpOutMsg, ErrorFrameCarriesTheCodeAndACutMessage) {
  OutMsg m = error_frame(AuthFailed(std::string(kMaxErrorBytes + 100, 'e')), 9, 2);
  EXPECT_EQ(m.hdr.type, static_cast<uint16_t>(FrameType::kError));
  EXPECT_EQ(status_code_from_wire(m.hdr.status), StatusCode::kAuthFailed);
  EXPECT_EQ(m.hdr.xfer_id, 9u);
  EXPECT_EQ(m.hdr.batch, 2u);
  EXPECT_EQ(m.aux.size(), kMaxErrorBytes);
  EXPECT_EQ(m.hdr.aux_len, kMaxErrorBytes);
  EXPECT_EQ(m.total, kHdr + kMaxErrorBytes);
}

// ---------------------------------------------------------------- TcpConn tables

std::shared_ptr<TcpPost> make_post(uint64_t id, Clock::time_point deadline) {
  auto p = std::make_shared<TcpPost>();
  p->xfer = std::make_shared<Transfer>(id, OpKind::kWrite, "peer", "tcp", 100, deadline, 0);
  return p;
}

std::unique_ptr<OutMsg> request(FrameType t, uint64_t id, uint32_t batch, const std::string* payload = nullptr) {
  auto m = std::make_unique<OutMsg>();
  m->hdr = make_hdr(t, id, batch);
  if (payload) m->own_iov = {{const_cast<char*>(payload->data()), payload->size()}};
  m->finalize();
  return m;
}

// No socket and no owner thread: only the pending table is exercised.
std::shared_ptr<TcpConn> detached_conn() { return TcpConn::dialled(-1, nullptr, "test connection", "", {}, 0); }

// A connection on one end of a socket pair nobody reads, with a small send buffer:
// a large first frame leaves partly and everything after it stays queued.
struct BlockedConn {
  SocketPair sp;
  std::shared_ptr<TcpConn> conn;
  std::string big = std::string(1 << 20, 'x');
  BlockedConn() {
    int small = 4096;
    EXPECT_EQ(::setsockopt(sp.a, SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
    EXPECT_EQ(::fcntl(sp.a, F_SETFL, O_NONBLOCK), 0);
    conn = TcpConn::dialled(sp.a, nullptr, "blocked connection", "", {}, 0);
    sp.a = -1;  // the connection closes it
  }
};

TEST(TcpConnTables, TakePendingReturnsThePartOnce) {
  auto c = detached_conn();
  auto post = make_post(5, Clock::now() + std::chrono::hours(1));
  ASSERT_TRUE(c->track(PendingPart{post, 0, 10}, 5));
  ASSERT_TRUE(c->track(PendingPart{post, 1, 20}, 5));
  PendingPart out;
  ASSERT_TRUE(c->take_pending(5, 1, &out));
  EXPECT_EQ(out.batch, 1u);
  EXPECT_EQ(out.bytes, 20u);
  EXPECT_FALSE(c->take_pending(5, 1, &out));
  EXPECT_FALSE(c->take_pending(6, 0, &out));
  EXPECT_EQ(c->pending_count(), 1u);
}

TEST(TcpConnTables, FindPendingReadOnlyFindsReadsAndLeavesThemPending) {
  auto c = detached_conn();
  auto post = make_post(5, Clock::now() + std::chrono::hours(1));
  iovec dst{nullptr, 0};
  ASSERT_TRUE(c->track(PendingPart{post, 0, 10}, 5));           // a write
  ASSERT_TRUE(c->track(PendingPart{post, 1, 10, &dst, 1}, 5));  // a read
  PendingPart out;
  EXPECT_FALSE(c->find_pending_read(5, 0, &out));
  ASSERT_TRUE(c->find_pending_read(5, 1, &out));
  EXPECT_EQ(out.dst, &dst);
  EXPECT_EQ(c->pending_count(), 2u);
}

TEST(TcpConnTables, ExpiredTransferNamesThePastDeadline) {
  auto c = detached_conn();
  const auto now = Clock::now();
  ASSERT_TRUE(c->track(PendingPart{make_post(1, now + std::chrono::hours(1)), 0, 1}, 1));
  EXPECT_EQ(c->expired_transfer(now), 0u);
  ASSERT_TRUE(c->track(PendingPart{make_post(2, now - std::chrono::seconds(1)), 0, 1}, 2));
  EXPECT_EQ(c->expired_transfer(now), 2u);
}

TEST(TcpConnSend, AFullSocketQueuesTheRest) {
  BlockedConn b;
  EXPECT_EQ(b.conn->send(request(FrameType::kWrite, 5, 0, &b.big)), TcpConn::SendResult::kQueued);
  EXPECT_EQ(b.conn->send(request(FrameType::kWrite, 5, 1)), TcpConn::SendResult::kQueued);
  EXPECT_EQ(b.conn->queued_frames(), 2u);
  EXPECT_FALSE(b.conn->flush());  // still blocked, nothing failed
  EXPECT_EQ(b.conn->queued_frames(), 2u);
  const auto now = Clock::now() + std::chrono::seconds(10);
  EXPECT_TRUE(b.conn->output_stalled(now, std::chrono::seconds(5)));
  EXPECT_FALSE(b.conn->output_stalled(now, std::chrono::seconds(60)));
}

TEST(TcpConnSend, AClosedPeerFailsTheSendWithTheReason) {
  BlockedConn b;
  ::close(b.sp.b);
  b.sp.b = -1;
  EXPECT_EQ(b.conn->send(request(FrameType::kNotify, 1, 0)), TcpConn::SendResult::kFailed);
  const Status why = b.conn->kill_reason();
  EXPECT_EQ(why.code(), StatusCode::kConnectionError);
  EXPECT_NE(why.message().find("sending to blocked connection failed"), std::string::npos) << why.message();
  EXPECT_TRUE(b.conn->flush());  // the owner must kill it
}

TEST(TcpConnTables, DropUnsentRemovesOnlyUnstartedRequestsOfThatTransfer) {
  BlockedConn b;
  auto& c = b.conn;
  auto post = make_post(5, Clock::now() + std::chrono::hours(1));
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(c->track(PendingPart{post, i, 1}, 5));
  ASSERT_EQ(c->send(request(FrameType::kWrite, 5, 0, &b.big)), TcpConn::SendResult::kQueued);  // partly sent
  c->send(request(FrameType::kWrite, 5, 1));
  c->send(request(FrameType::kReadReq, 5, 2));
  c->send(request(FrameType::kWrite, 6, 0));   // another transfer
  c->send(request(FrameType::kNotify, 5, 7));  // not a request
  auto dropped = c->drop_unsent(5);
  ASSERT_EQ(dropped.size(), 2u);
  EXPECT_EQ(dropped[0].batch, 1u);
  EXPECT_EQ(dropped[1].batch, 2u);
  EXPECT_EQ(c->queued_frames(), 3u);
  EXPECT_EQ(c->pending_count(), 1u);
}

TEST(TcpConnTables, RetireHandsOverEverythingOnceAndRefusesNewParts) {
  BlockedConn b;
  auto& c = b.conn;
  auto post = make_post(5, Clock::now() + std::chrono::hours(1));
  ASSERT_TRUE(c->track(PendingPart{post, 0, 1}, 5));
  ASSERT_EQ(c->send(request(FrameType::kWrite, 5, 0, &b.big)), TcpConn::SendResult::kQueued);
  std::unordered_map<uint64_t, PendingPart> pend;
  std::deque<std::unique_ptr<OutMsg>> sq;
  ASSERT_TRUE(c->retire(&pend, &sq));
  EXPECT_TRUE(c->is_dead());
  EXPECT_EQ(pend.size(), 1u);
  EXPECT_EQ(sq.size(), 1u);
  EXPECT_EQ(c->queued_frames(), 0u);
  EXPECT_FALSE(c->retire(&pend, &sq));
  EXPECT_FALSE(c->track(PendingPart{post, 1, 1}, 5));
  EXPECT_EQ(c->send(request(FrameType::kWrite, 5, 1)), TcpConn::SendResult::kDead);
  EXPECT_TRUE(c->drop_unsent(5).empty());
  EXPECT_FALSE(c->set_driven(true));
}

// ---------------------------------------------------------------- handshake

// A target on 127.0.0.1 that reads one hello and answers with `reply`; or, given a
// secret, runs the real target side (challenge, proof check, hello-ack) as agent
// `name` instance `instance`, with `secret` (an impostor when it is the wrong one).
class ScriptedTarget {
 public:
  explicit ScriptedTarget(std::string reply) : reply_(std::move(reply)) { start(); }
  ScriptedTarget(std::string name, uint64_t instance, std::string secret)
      : name_(std::move(name)), instance_(instance), secret_(std::move(secret)) {
    start();
  }
  void start() {
    auto fd = util::listen_tcp(util::HostPort{"127.0.0.1", 0}, &port_);
    EXPECT_TRUE(fd.ok());
    listen_ = std::move(fd).value();
    th_ = std::thread([this] {
      const int c = ::accept(listen_.get(), nullptr, nullptr);
      if (c < 0) return;
      const auto deadline = util::deadline_after(5);
      FrameHeader h{};
      if (util::recv_all(c, &h, kHdr, deadline).ok() && h.aux_len <= kMaxHelloBytes) {
        hello_.resize(h.aux_len);
        if (util::recv_all(c, hello_.data(), hello_.size(), deadline).ok()) {
          if (name_.empty()) (void)util::send_all(c, reply_.data(), reply_.size(), deadline);
          else answer(c, deadline);
        }
      }
      ::close(c);
    });
  }
  ~ScriptedTarget() {
    if (th_.joinable()) th_.join();
  }
  util::HostPort where() const { return util::HostPort{"127.0.0.1", port_}; }
  // The hello body the target received (after it answered).
  std::string received_hello() {
    if (th_.joinable()) th_.join();
    return hello_;
  }
  // The proof it received, and whether it matched its secret (scripted with a secret).
  bool proof_matched() {
    if (th_.joinable()) th_.join();
    return matched_;
  }

 private:
  void answer(int c, std::chrono::steady_clock::time_point deadline) {
    auto hello = decode_hello(hello_);
    if (!hello.ok()) return;
    std::string ch;
    auto hs = begin_challenge(*hello, name_, instance_, &ch);
    if (!hs.ok()) return;
    FrameHeader h = make_hdr(FrameType::kChallenge, 0, 0);
    h.aux_len = static_cast<uint32_t>(ch.size());
    const std::string f = frame_bytes(h, ch);
    if (!util::send_all(c, f.data(), f.size(), deadline).ok()) return;
    FrameHeader p{};
    std::string proof(auth::kMacBytes, '\0');
    if (!util::recv_all(c, &p, kHdr, deadline).ok() || p.aux_len != auth::kMacBytes ||
        !util::recv_all(c, proof.data(), proof.size(), deadline).ok())
      return;
    auth::Mac mac{}, ack{};
    std::memcpy(mac.data(), proof.data(), mac.size());
    auto ok = hs->check(mac, {auth::derive_key(secret_)}, &ack);
    matched_ = ok.ok();
    if (!ok.ok()) {  // an impostor answers with a made-up MAC
      ack.fill(0x5a);
    }
    FrameHeader a = make_hdr(FrameType::kHelloAck, 0, 0);
    a.aux_len = static_cast<uint32_t>(ack.size());
    const std::string af = frame_bytes(a, encode_mac(ack));
    (void)util::send_all(c, af.data(), af.size(), deadline);
  }

  std::string reply_;
  std::string name_;
  uint64_t instance_ = 0;
  std::string secret_;
  bool matched_ = false;
  uint16_t port_ = 0;
  util::ScopedFd listen_;
  std::string hello_;
  std::thread th_;
};


std::string error_reply(const Status& st) {
  OutMsg m = error_frame(st, 0, 0);
  return frame_bytes(m.hdr, m.aux);
}

TEST(TcpHandshake, DialProvesTheSecretWithoutSendingItAndReturnsThePeerName) {
  ScriptedTarget t("target", 77, "s3cret");
  std::string name;
  auto fd = dial(t.where(), HelloParams{"me", "target", 77, auth::derive_key("s3cret")}, 5, &name);
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  EXPECT_EQ(name, "target");
  EXPECT_TRUE(t.proof_matched());
  const std::string raw = t.received_hello();
  auto hello = decode_hello(raw);
  ASSERT_TRUE(hello.ok()) << hello.status().to_string();
  EXPECT_EQ(hello->version, kWireVersion);
  EXPECT_EQ(hello->from, "me");
  EXPECT_EQ(hello->to, "target");
  EXPECT_EQ(hello->instance, 77u);
  EXPECT_EQ(raw.find("s3cret"), std::string::npos);
}

TEST(TcpHandshake, DialRefusesAnImpostorTarget) {
  ScriptedTarget t("target", 77, "not-the-secret");
  auto fd = dial(t.where(), HelloParams{"me", "target", 77, auth::derive_key("s3cret")}, 5, nullptr);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kAuthFailed);
  EXPECT_NE(fd.status().message().find("could not prove it knows the secret"), std::string::npos)
      << fd.status().message();
  EXPECT_FALSE(t.proof_matched());
}

TEST(TcpHandshake, DialRefusesAnotherAgentOrInstance) {
  {
    ScriptedTarget t("someone", 77, "s3cret");
    auto fd = dial(t.where(), HelloParams{"me", "target", 77, auth::derive_key("s3cret")}, 5, nullptr);
    ASSERT_FALSE(fd.ok());
    EXPECT_EQ(fd.status().code(), StatusCode::kProtocolError) << fd.status().to_string();
    EXPECT_FALSE(t.proof_matched());  // nothing proved to the wrong agent
  }
  ScriptedTarget t("target", 78, "s3cret");
  auto fd = dial(t.where(), HelloParams{"me", "target", 77, auth::derive_key("s3cret")}, 5, nullptr);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kStalePeer) << fd.status().to_string();
}

TEST(TcpHandshake, DialReturnsTheTargetsRefusal) {
  ScriptedTarget t(error_reply(AuthFailed("wrong secret")));
  auto fd = dial(t.where(), HelloParams{"me", "target", 0, auth::derive_key("bad")}, 5, nullptr);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kAuthFailed);
  EXPECT_NE(fd.status().message().find("refused the connection: wrong secret"), std::string::npos)
      << fd.status().message();
}

TEST(TcpHandshake, DialRejectsAnAnswerThatIsNoFrame) {
  ScriptedTarget t(std::string(kHdr, 'x'));
  auto fd = dial(t.where(), HelloParams{"me", "", 0, auth::derive_key("s")}, 5, nullptr);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kProtocolError);
  EXPECT_NE(fd.status().message().find("answered the handshake with a bad frame"), std::string::npos)
      << fd.status().message();
}

TEST(TcpHandshake, RequestMetadataReturnsTheBlob) {
  SocketPair sp;
  FrameHeader h = make_hdr(FrameType::kMetaResp, 0, 0);
  h.aux_len = 4;
  const std::string resp = frame_bytes(h, "BLOB");
  ASSERT_EQ(::write(sp.b, resp.data(), resp.size()), static_cast<ssize_t>(resp.size()));
  auto blob = request_metadata(sp.a, "test-target", util::deadline_after(5));
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  EXPECT_EQ(*blob, "BLOB");
  const FrameHeader req = decode_header(read_exactly(sp.b, kHdr).data());
  EXPECT_EQ(req.type, static_cast<uint16_t>(FrameType::kMetaReq));
}

TEST(TcpHandshake, RequestMetadataReturnsTheRefusal) {
  SocketPair sp;
  const std::string resp = error_reply(StalePeer("gone"));
  ASSERT_EQ(::write(sp.b, resp.data(), resp.size()), static_cast<ssize_t>(resp.size()));
  auto blob = request_metadata(sp.a, "test-target", util::deadline_after(5));
  ASSERT_FALSE(blob.ok());
  EXPECT_EQ(blob.status().code(), StatusCode::kStalePeer);
  EXPECT_EQ(blob.status().message(), "test-target refused the metadata request: gone");
}

}  // namespace
}  // namespace pdkv::tcp
