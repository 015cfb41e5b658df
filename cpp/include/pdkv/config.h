// pdkv/config.h: the typed configuration of an agent: its own settings plus the
// options of any of its transports (each type declared, registered and validated by
// its transport: pdkv/options/<transport>.h; the agent names none of them).
//
// Strings (CLI flags, env vars, "host:port") are parsed into these structs once, at
// the edge. Agent::create() rejects a config whose validate() fails.
// Thread safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pdkv/options/transport_options.h"
#include "pdkv/status.h"

namespace pdkv {

struct AgentConfig {
  std::string name;                               // unique among peers; printable ASCII
  // The cluster secret this agent proves knowledge of in every handshake (<= 1024
  // bytes; empty: random). It never crosses the wire (pdkv/spi/auth.h).
  std::string secret;
  // Further secrets whose proofs this agent accepts (rotation; at most 7, each 1..1024
  // bytes). A target proves itself with whichever secret the initiator's proof used.
  std::vector<std::string> accepted_secrets;
  std::vector<std::string> transports = {"tcp"};  // in order of preference; not empty
  // Options of transports, at most one per transport (held by its name): each reaches
  // that transport's factory; a transport without any here gets its defaults. E.g.
  // `cfg.options.set(TcpOptions{...})`, `cfg.options.edit<TcpOptions>().spin_us = 5`.
  TransportOptionsSet options;
  double default_timeout_s = 60.0;  // s, deadline of transfers posted without one (0: none)
  uint32_t max_notif_bytes = 1u << 20;  // largest notification sent or received (>= 1)
  // Received notifications not yet taken by the application (get_notifications /
  // wait_notifications): at most this many (>= 1) and this many bytes of payload and
  // sender names (>= 1; an empty queue takes any one notification). One more is
  // refused before it is accepted: the sender's transfer (or notify) fails with
  // ResourceExhausted naming these limits; nothing accepted is dropped.
  uint32_t max_queued_notifs = 65536;
  uint64_t max_queued_notif_bytes = 64ull << 20;
  uint32_t wait_spin_us = 50;           // µs Transfer::wait spins before sleeping

  // OK, or InvalidArgument naming the first bad field and its value. Checks every
  // transport's options held, enabled or not (a bad value is a mistake either way).
  // The name's syntax, the transports' names and that each options object's transport
  // is registered (and takes options) are checked by Agent::create.
  Status validate() const;
};

}  // namespace pdkv
