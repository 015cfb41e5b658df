// The tcp transport: any host to any host.
//
// Data path: one sendmsg per batch with the header, the extent descriptors and up to
// ~1000 iovecs pointing straight into registered memory; the receiver reads the
// descriptors, validates them against the regions it exported, and recvmsg()s the
// payload straight into the destination region, picking up the next frame header in
// the same call. SO_RCVLOWAT keeps receiver wake-ups down on large batches.
//
// Device (CUDA) memory is staged through pinned host buffers (cuda/staging.h): a
// staging thread gathers each outgoing batch from the GPU while the previous one is
// on the wire, and a receiver scatters each payload to the GPU double buffered,
// acknowledging only after the last copy completed.
//
// Threads: `progress_threads` epoll threads own the connections (accept, receive,
// completion, deadlines). Posting threads send inline when the connection's send
// queue is empty, so a small write costs one syscall on the caller's thread; the
// rest is driven by the owner thread on EPOLLOUT. An idle agent blocks in epoll_wait.
//
// Thread safety: see pdkv/transport.h.
#pragma once

#include <memory>

#include "pdkv/options/tcp.h"
#include "pdkv/status.h"
#include "pdkv/spi/transport.h"

namespace pdkv::tcp {

// A tcp transport with `opts` (validated), outside any registry lookup (tests).
Result<std::unique_ptr<Transport>> create_tcp_transport(const TcpOptions& opts);

}  // namespace pdkv::tcp
