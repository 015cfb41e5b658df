// pdkv/options/tcp.h: the tcp transport's options (any host; epoll progress threads).
//
// Owned by the tcp transport (cpp/src/transport/tcp): its constructor reads them,
// its options.cc validates them. AgentConfig (pdkv/config.h) holds one copy.
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <string>

#include "pdkv/status.h"

namespace pdkv {

struct TcpOptions {
  std::string listen_host = "127.0.0.1";  // address to bind and publish
  uint16_t listen_port = 0;               // 0: pick a free port
  uint32_t conns_per_peer = 1;            // parallel connections to each peer (1..64)
  uint32_t progress_threads = 1;          // epoll threads, connections spread over them (1..64)
  uint32_t spin_us = 0;                   // µs a progress thread polls after activity before sleeping
  uint64_t batch_bytes = 16ull << 20;     // max payload bytes per wire batch (1..2^30)
  // Max extents per batch sent as iovecs: one sendmsg, IOV_MAX less 4 (1..1020). A
  // batch of extents averaging under 8 KiB is gathered into a staging chunk instead
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

  // OK, or InvalidArgument naming the first field out of range and its value
  // ("tcp.conns_per_peer must be in 1..64, got 0").
  Status validate() const;
};

}  // namespace pdkv
