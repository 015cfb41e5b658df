// How many inbound connections the tcp transport keeps open: in total
// (TcpOptions::max_inbound_conns, counted from accept, authenticated or not) and per
// authenticated peer name (TcpOptions::max_inbound_per_peer, counted from admit()).
// Every connection a peer holds can make this agent hold receive buffers (a
// compressed payload, a landing chunk, queued responses), so an authenticated but
// hostile peer must not open them without limit.
//
// A slot is a ticket: the connection holds it (TcpConn::hold) and gives it back when
// its socket closes; the counts then drop. Tickets may outlive the Admission.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "pdkv/status.h"

namespace pdkv::tcp {

class Admission {
 public:
  Admission(uint32_t max_inbound, uint32_t max_per_peer);

  // A slot for a newly accepted connection, or null (and *open the count) when
  // max_inbound are open.
  std::shared_ptr<void> accept(uint32_t* open);
  // A slot for a connection authenticated as `peer`, or ResourceExhausted naming the
  // peer and the limit when it already holds max_per_peer.
  Result<std::shared_ptr<void>> admit(const std::string& peer);

  uint32_t max_inbound() const { return max_inbound_; }
  uint32_t max_per_peer() const { return max_per_peer_; }

 private:
  struct Counts {
    std::mutex mu;
    uint32_t inbound = 0;
    std::map<std::string, uint32_t> per_peer;  // only names with a connection open
  };
  const uint32_t max_inbound_;
  const uint32_t max_per_peer_;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
};

}  // namespace pdkv::tcp
