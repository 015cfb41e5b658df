// pdkv/options/shm.h: the shm transport's options (same host; memfd regions, one copy).
//
// Owned by the shm transport (cpp/src/transport/shm): registered with its factory,
// read by its constructor, validated by its options.cc. An agent gets them in
// AgentConfig::options (pdkv/config.h); without them the defaults apply.
// Thread safety: a plain value.
#pragma once

#include <cstdint>
#include <vector>

#include "pdkv/options/transport_options.h"
#include "pdkv/status.h"

namespace pdkv {

struct ShmOptions : TransportOptionsOf<ShmOptions> {
  static constexpr std::string_view kTransport = "shm";

  uint32_t copy_threads = 1;           // threads copying large transfers (1..64)
  uint64_t inline_bytes = 256u << 10;  // transfers up to this many bytes copy in the posting thread
  // Exported host memory the engine allocated itself (numpy, torch) whose whole pages
  // span at least this many bytes is re-mapped at registration onto a memfd, so
  // same-host peers copy into it as fast as into Agent.alloc memory instead of through
  // cross-memory attach (docs/transports.md). 0: never (the off switch). Bytes.
  uint64_t share_pages_min_bytes = 1u << 20;
  // A transfer's notification completes the transfer once it is sent (after every
  // byte landed, so the peer still gets it only then) instead of when the peer
  // acknowledges it (one round trip less). One the peer never acknowledges (the
  // connection closed, or the transfer's deadline passed first) is then not the
  // transfer's error: it is counted (Agent::notifications_unacknowledged) and
  // logged. Off: the transfer fails instead (docs/api.md, "Notifications").
  bool notify_on_send = false;
  // Same-host peers are identified by the kernel (SO_PEERCRED on the control socket,
  // never by what they say): a peer process whose uid is neither this process's own
  // uid nor listed here is refused, both when it connects to us (its connection is
  // closed with AuthFailed before its hello is read) and when we dial it (the dial
  // fails with AuthFailed). Empty (the default): same uid only. At most 64 uids.
  std::vector<uint32_t> allowed_peer_uids;
  // s (0, 86400]: dialing a same-host peer's control socket plus its handshake.
  double connect_timeout_s = 5.0;

  // OK, or InvalidArgument naming the field out of range and its value.
  Status validate() const override;
};

}  // namespace pdkv
