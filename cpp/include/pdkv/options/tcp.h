// pdkv/options/tcp.h: the tcp transport's options (any host; epoll progress threads).
//
// Owned by the tcp transport (cpp/src/transport/tcp): registered with its factory,
// read by its constructor, validated by its options.cc. An agent gets them in
// AgentConfig::options (pdkv/config.h); without them the defaults apply.
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <string>

#include "pdkv/codec.h"
#include "pdkv/options/transport_options.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"  // CompressMode
#include "pdkv/types.h"

namespace pdkv {

// What kAuto may choose.
enum class CompressPolicy : uint8_t {
  kLossless = 0,      // plain or lossless
  kLossyAllowed = 1,  // plain or fp8 (fp8's ratio is ~2x, so it wins whenever lossless would)
};
std::string_view compress_policy_name(CompressPolicy p);
Result<CompressPolicy> parse_compress_policy(std::string_view s);  // "lossless", "lossy-allowed"

// Compression of tcp writes and reads (CompressMode, pdkv/transfer.h). The element
// type and the FP8 grouping describe the KV the agent sends or reads (they come from its layout: one agent, one KV dtype); a write whose
// extents are not whole FP8 rows fails with InvalidArgument at post.
struct TcpCompression {
  CompressMode mode = CompressMode::kOff;
  CompressPolicy policy = CompressPolicy::kLossless;  // kAuto only
  CodecKind codec = CodecKind::kZstd;                 // the lossless codec: kZstd or kLz4
  int32_t level = 1;                                  // zstd level (-7..9)
  bool checksum = false;  // XXH3-64 of every chunk's uncompressed bytes, verified by the receiver
  // Raw bytes per codec frame, the pipeline unit (4096..64 MiB): chunk i+1 is encoded
  // while chunk i is on the wire. Rounded down to whole FP8 groups for fp8.
  uint64_t chunk_bytes = 1u << 20;
  // Encoder threads per agent (1..16; 0: min(4, hardware threads)): its compressed
  // writes, and the compressed responses it answers to peers' reads. The receiver
  // decodes on as many (pdkv-tcp-unzip, min(4, hardware threads)).
  uint32_t threads = 0;
  DType dtype = DType::kBF16;  // element type of the KV (byte planes; fp8: bfloat16, float16, float32)
  Fp8Grouping fp8{1, 64, 16};  // fp8: rows of heads x head_dim, rows_per_group rows per scale

  Status validate() const;
};

struct TcpOptions : TransportOptionsOf<TcpOptions> {
  static constexpr std::string_view kTransport = "tcp";

  std::string listen_host = "127.0.0.1";  // address to bind and publish
  uint16_t listen_port = 0;               // 0: pick a free port
  uint32_t conns_per_peer = 1;            // parallel connections to each peer (1..64)
  uint32_t progress_threads = 1;          // epoll threads, connections spread over them (1..64)
  uint32_t spin_us = 0;                   // µs a progress thread polls after activity before sleeping
  uint64_t batch_bytes = 16ull << 20;     // max payload bytes per wire batch (1..2^30)
  // Max extents per batch sent as iovecs: one sendmsg, IOV_MAX less 4 (1..1020). A
  // batch of extents averaging under gather_below_bytes is gathered into a staging chunk instead
  // and may hold up to 16384 (docs/wire.md, "Many small extents in one frame").
  uint32_t batch_extents = 1020;
  uint32_t rcvlowat_bytes = 1u << 20;     // SO_RCVLOWAT cap while receiving payload (0: off)
  double connect_timeout_s = 5.0;         // s, TCP connect + handshake (0, 86400]
  double handshake_timeout_s = 5.0;       // s, inbound connections must say hello within this (0, 86400]
  // s (0, 86400]. A frame that stops arriving half-way (header, descriptors or
  // payload), or queued output the peer stops reading, closes the connection after
  // this long without progress (releasing the regions it pins).
  double frame_timeout_s = 30.0;
  // Device memory is staged through pinned host buffers of this size (also the
  // batch size of device transfers; 4096..2^30); `stage_buffers` (2..1024) of them
  // per agent bound how far copies run ahead of the socket. Each connection
  // receiving into device memory holds two more.
  uint64_t stage_chunk_bytes = 4ull << 20;
  uint32_t stage_buffers = 4;
  // Inbound connections open at once, authenticated or not (1..65536): one more is
  // answered with a ResourceExhausted error frame and closed at accept.
  uint32_t max_inbound_conns = 1024;
  // Inbound connections one authenticated peer (by agent name) may hold (1..65536):
  // one more is answered with ResourceExhausted (naming the peer and this option)
  // and closed, its first request failing with it. Each connection can make this
  // agent hold receive buffers (at most 4 compressed payloads of <= 64 MiB, each
  // grown only as its bytes arrive), so this bounds what one peer can make it hold.
  uint32_t max_inbound_per_peer = 128;
  TcpCompression compress;  // off by default; a transfer may override the mode (XferOptions::compress)
  // Encrypt every connection with TLS 1.3 (OpenSSL), inside which the handshake runs
  // bound to the session (docs/security.md). Every agent of a cluster must agree: an
  // agent with it on speaks only TLS. Costs CPU and one more copy each way
  // (`pdkv bench transfer --tls`). Off by default.
  bool tls = false;
  // Small extents (docs/wire.md, "Many small extents in one frame"). A batch whose
  // extents average fewer than `gather_below_bytes` is gathered by the sender into
  // staging chunks and sent as one frame (measured: 256 B..2 KiB extents cost the
  // sender 1.2-2x less CPU per byte; 4 KiB ones are better left to the kernel: not
  // gathering them spent 0.36-0.38 against 0.39-0.41 CPU s/GB and moved 2.6 against
  // 2.4-2.5 GB/s, alternating in one process, bench/results/tcpperf; 8 KiB and up
  // make no difference). A payload whose extents average fewer than
  // `land_below_bytes` is landed by the receiver in a buffer and scattered with
  // streaming stores (0.68-0.70x the homogeneous transfer against 0.51x straight into
  // 512-byte iovecs; 4 KiB extents, with the two ends on their own cores: 3.24-3.83
  // against 3.18-3.62 GB/s and 0.365-0.424 against 0.398-0.469 CPU s/GB, six
  // alternating invocations, bench/results/tcpperf/pinned/land-below-ab.txt).
  // Bytes, 0..2^30 (0: never). Each side uses its own: they change how a frame is
  // laid out, never what it means.
  uint64_t gather_below_bytes = 4096;
  uint64_t land_below_bytes = 8192;
  // The TCP congestion control of every connection this agent opens or accepts
  // (setsockopt TCP_CONGESTION: "cubic", "reno", "bbr", ...); "" keeps the system's
  // (net.ipv4.tcp_congestion_control). Why it is here: on a host whose default is bbr,
  // loopback transfers measured 4.7-5.2 GB/s against 6.2-7.0 with cubic or reno, for
  // pdkv and a raw socket pair alike (bbr paces at the bandwidth it estimates; the
  // 2-core dev VM, 2026-12-08, docs/benchmarks.md "Congestion control"). A name the kernel
  // refuses (not loaded, or not in net.ipv4.tcp_allowed_congestion_control for a process
  // without CAP_NET_ADMIN) fails the agent's start, naming what is allowed. Only the
  // sending side's choice matters for a transfer's data: set it on both ends.
  std::string congestion_control;

  // OK, or InvalidArgument naming the first field out of range and its value
  // ("tcp.conns_per_peer must be in 1..64, got 0").
  Status validate() const override;
};

}  // namespace pdkv
