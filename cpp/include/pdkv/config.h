// pdkv/config.h: typed configuration of an agent and its transports.
//
// Strings (CLI flags, env vars) are parsed into these structs once, at the edge.
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pdkv {

struct TcpOptions {
  std::string listen_host = "127.0.0.1";  // address to bind and publish
  uint16_t listen_port = 0;               // 0: pick a free port
  uint32_t conns_per_peer = 1;            // parallel connections to each peer
  uint32_t progress_threads = 1;          // epoll threads (connections spread over them)
  uint32_t spin_us = 0;                   // poll this long after activity before sleeping (latency vs CPU)
  uint64_t batch_bytes = 16ull << 20;     // max payload bytes per wire batch
  uint32_t batch_extents = 1020;          // max extents per batch (one sendmsg, IOV_MAX)
  uint32_t rcvlowat_bytes = 1u << 20;     // SO_RCVLOWAT cap while receiving payload (0: off)
  double connect_timeout_s = 5.0;         // TCP connect + handshake
  double handshake_timeout_s = 5.0;       // inbound connections must say hello within this
  // A frame that stops arriving half-way (header, descriptors or payload), or queued
  // output the peer stops reading, closes the connection after this long without
  // progress (releasing the regions it pins).
  double frame_timeout_s = 30.0;
  // Device memory is staged through pinned host buffers of this size (also the
  // batch size of device transfers); `stage_buffers` of them per agent bound how far
  // copies run ahead of the socket. Each connection receiving into device memory
  // holds two more.
  uint64_t stage_chunk_bytes = 4ull << 20;
  uint32_t stage_buffers = 4;
};

struct ShmOptions {
  uint32_t copy_threads = 1;             // threads copying large transfers
  uint64_t inline_bytes = 256u << 10;    // transfers up to this size copy in the posting thread
};

struct AgentConfig {
  std::string name;                        // unique among peers; printable ASCII
  std::string secret;                      // peers must present it; empty: random
  std::vector<std::string> transports = {"tcp"};  // in order of preference
  TcpOptions tcp;
  ShmOptions shm;
  double default_timeout_s = 60.0;         // transfers without an explicit timeout
  uint32_t max_notif_bytes = 1u << 20;
  uint32_t wait_spin_us = 50;              // Transfer::wait spins this long before sleeping
};

}  // namespace pdkv
