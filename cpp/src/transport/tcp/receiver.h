// The receive side of a connection: turns the byte stream into frames and acts on
// each one (the target side of writes, reads, notifications and the handshake; the
// initiator side of acks, read responses and errors).
//
// A frame arrives in up to three stages (conn.h RxStage): the 40-byte header, which
// wire.h's check_header() validates for this connection's role and phase before
// anything is allocated; the control bytes (extent descriptors and aux); and the
// payload, which is received straight into the destination extents (host memory;
// small extents through a landing chunk, see out_msg.h),
// into pinned buffers that are copied to the GPU as they fill (device memory,
// device_staging.h), or into scratch memory when the write is refused. A payload's
// last recvmsg also picks up the next header.
//
// A frame that breaks the rules fails the connection with an error frame naming the
// problem (fail_conn_locked); a refused part of a valid request (stale block
// generations) is answered with a failed ack and the connection stays.
//
// Ownership: the receive state of every connection (conn.h RxState) is this class's;
// nothing else reads or writes it.
//
// Compressed frames are coded off the progress threads: a kWriteZ payload and a
// kReadRespZ payload (a compressed read's response) are decoded on a decode thread
// (compress.h Decoder), a read request with kFlagZReply is answered by an encoder
// thread (compress.h Encoder). At most kDecodeAhead of them per connection are at
// those threads (or encoded and not yet sent); at that many, reading the connection
// pauses.
//
// The class is defined in two files: receiver.cc (the byte stream, headers, the
// handshake and the other control frames) and receiver_data.cc (data requests: reads
// answered, write payloads received into place, staged or decoded, and their acks).
//
// Thread safety: every function runs with the connection's receive lock held
// (TcpConn::lock_rx: the owner thread, or a caller driving its own transfer),
// except finish_decode, finish_read_decode and encode_reply, which run on a decode
// or encoder thread and touch no receive state.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "pdkv/spi/generations.h"
#include "pdkv/spi/region_table.h"
#include "pdkv/status.h"
#include "transport/tcp/conn.h"

namespace pdkv::tcp {

class TcpTransport;
class ProgressThread;

class FrameReceiver {
 public:
  explicit FrameReceiver(TcpTransport& t) : t_(t) {}

  // Reads c until the socket is empty, the connection is closed or paused, or a
  // fairness budget is spent; acts on every frame completed. Returns the bytes read.
  // With `until` (a caller driving its own transfer, TcpTransport::drive): also stops
  // once that transfer is terminal, leaving later bytes to the owner thread.
  uint64_t receive(const std::shared_ptr<TcpConn>& c, const Transfer* until = nullptr);

 private:
  // What a write or read request addresses, once its extents are pinned and its
  // aux checked.
  struct Request {
    std::vector<PieceRun> runs;  // the local extents, one run per descriptor, in order
    uint64_t extents = 0;        // ... holding this many pieces (touching ones count once)
    std::vector<iovec> iov;      // the same pieces listed, for the paths that take iovecs (list_iovecs)
    std::vector<RegionPin> pins;
    int device = -1;  // >= 0: the extents are in this device's memory
    uint64_t bytes = 0;
    GenPin gens;    // the claimed blocks, held until the bytes landed or left
    Status reject;  // the claim failed: refuse this part only
    std::string zspec;  // a read request with kFlagZReply: its ReadZSpec (unchecked)
  };

  // One read of the current stage. Returns the syscall's result; when it read
  // bytes, *stop says receive() must return (the connection failed or closed).
  ssize_t read_header(const std::shared_ptr<TcpConn>& c, bool* stop);
  void lowat_for_payload(const std::shared_ptr<TcpConn>& c);
  ssize_t read_control(const std::shared_ptr<TcpConn>& c, bool* stop);
  ssize_t read_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop);
  ssize_t read_staged_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop);
  ssize_t read_landed_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop);
  ssize_t read_zbuf_payload(const std::shared_ptr<TcpConn>& c, uint64_t* budget, bool* stop);
  // The first step a compressed payload's buffer grows by (then it doubles).
  static constexpr uint64_t kZbufFirstBytes = 1u << 20;
  // Moves the payload cursor `n` bytes through the destination extents, copying them
  // from `from` on the way (landed payloads) unless it is null.
  static void advance_dst(RxState& st, uint64_t n, const char* from);
  // `took` payload bytes (and `extra` bytes of the next header) arrived: finishes the
  // payload when it is complete.
  void payload_received(const std::shared_ptr<TcpConn>& c, uint64_t took, uint64_t extra, bool* stop);

  // A full header is in c->hdr: validates it and sets up the next stage. False when
  // the connection was failed.
  bool on_header(const std::shared_ptr<TcpConn>& c);
  bool on_read_response_header(const std::shared_ptr<TcpConn>& c);
  bool on_compressed_read_response_header(const std::shared_ptr<TcpConn>& c);
  // Sets up the payload stage to read a compressed frame's `payload` bytes into st.zbuf.
  void receive_into_zbuf(RxState& st, uint64_t payload);
  // The control bytes of c->cur are in c->ctrl: acts on the frame. False when the
  // connection was failed.
  bool on_control(const std::shared_ptr<TcpConn>& c);
  bool on_hello(const std::shared_ptr<TcpConn>& c);
  bool on_proof(const std::shared_ptr<TcpConn>& c);
  bool on_metadata_request(const std::shared_ptr<TcpConn>& c);
  bool on_data_request(const std::shared_ptr<TcpConn>& c);
  bool on_failed_ack(const std::shared_ptr<TcpConn>& c);
  bool on_notify(const std::shared_ptr<TcpConn>& c);
  bool on_error(const std::shared_ptr<TcpConn>& c);
  // Pins the extents of the write / read request in c->cur and checks its aux and
  // block generation claim. False when the connection was failed.
  bool decode_request(const std::shared_ptr<TcpConn>& c, Request* req);
  // Answers a read request (plain, compressed, or from device memory). False when
  // the connection was failed.
  bool answer_read(const std::shared_ptr<TcpConn>& c, Request req);
  // A read request with kFlagZReply from host memory, its spec checked: an encoder
  // thread encodes the response (encode_reply) and sends it.
  bool answer_read_compressed(const std::shared_ptr<TcpConn>& c, Request& req, const ZSpecCodec& codec);
  struct ReplyJob;
  static void encode_reply(TcpTransport& t, const std::shared_ptr<TcpConn>& c, ReplyJob& job);
  // A plain response carrying the request's extents (pins and claim held until sent);
  // `gather_below`: TcpOptions::gather_below_bytes.
  static std::unique_ptr<OutMsg> plain_read_response(const FrameHeader& h, std::vector<iovec> iov,
                                                     std::vector<RegionPin> pins, GenPin gens, uint64_t bytes,
                                                     uint64_t gather_below);
  // The same, gathering its pieces from the request's runs (host memory, small pieces).
  static std::unique_ptr<OutMsg> gathered_read_response(const FrameHeader& h, Request& req, uint64_t gather_below);
  // Lists req's runs as iovecs (once): for the paths that are not walked lazily.
  static void list_iovecs(Request& req);
  bool begin_write_payload(const std::shared_ptr<TcpConn>& c, Request req);
  bool begin_compressed_payload(const std::shared_ptr<TcpConn>& c, Request req);
  struct DecodeJob;
  void hand_to_decoder(const std::shared_ptr<TcpConn>& c);
  static void finish_decode(TcpTransport& t, const std::shared_ptr<TcpConn>& c, DecodeJob& job);
  // A compressed read response is in: a decode thread decodes it into the read's
  // destination (finish_read_decode) and resolves that part.
  struct ReadDecodeJob;
  void hand_read_to_decoder(const std::shared_ptr<TcpConn>& c);
  static void finish_read_decode(TcpTransport& t, const std::shared_ptr<TcpConn>& c, ReadDecodeJob& job);
  // The current payload is complete.
  void on_payload_done(const std::shared_ptr<TcpConn>& c);
  void write_landed(const std::shared_ptr<TcpConn>& c);

  // Routes the current payload of `c` through its ScatterPipe (device destination).
  Status begin_staged_rx(TcpConn& c, int device);
  // A copy into device memory failed while receiving the current payload.
  void staged_rx_failed(const std::shared_ptr<TcpConn>& c, const Status& st);
  void set_lowat(TcpConn& c, int v);
  void reply(const std::shared_ptr<TcpConn>& c, std::unique_ptr<OutMsg> m);

  // The connection's receive state: this class's alone (conn.h RxAccess).
  static RxState& rx(TcpConn& c) { return c.rx_state(RxAccess()); }
  static RxState& rx(const std::shared_ptr<TcpConn>& c) { return rx(*c); }

  TcpTransport& t_;
};

// An ack carrying a refused part's status and message: the connection stays
// (receiver.cc).
std::unique_ptr<OutMsg> failed_ack(const FrameHeader& h, const Status& why);

}  // namespace pdkv::tcp
