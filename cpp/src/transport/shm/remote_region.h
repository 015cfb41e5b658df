// The initiator's side of region confirmation and revocation.
//
// Direct access means the target cannot check each write, so the initiator never
// trusts the metadata blob for bounds: before first use it asks the target, over
// the authenticated socket, what region `id` is now (RegionReq), and uses only the
// answer (a mismatch with the blob is an error). The answer is mapped (a memfd
// passed with it) or checked once for cross-memory attach, and cached on the
// connection until the target revokes it. A revoked region is acknowledged
// (RevokeAck) once no copy uses it any more.
//
// Thread safety: confirm_region takes c's region-request lock (one request in
// flight per connection) and its shared-state lock; ack_revoke_when_idle may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "pdkv/status.h"
#include "pdkv/spi/transport.h"
#include "transport/shm/conn.h"

namespace pdkv::shm {

// The message of a NotFound for a region the peer deregistered.
std::string deregistered(const std::string& peer, uint64_t id);

// Region `id` of `peer` as the peer confirms it now on c, waiting until `until`
// for the answer (cached per connection until revoked).
Result<std::shared_ptr<RemoteRegion>> confirm_region(const std::shared_ptr<ShmConn>& c, const Peer& peer, uint64_t id,
                                                     Clock::time_point until);

// Sends the RevokeAck of r once it is revoked and no copy uses it (once).
void ack_revoke_when_idle(const std::shared_ptr<RemoteRegion>& r);

}  // namespace pdkv::shm
