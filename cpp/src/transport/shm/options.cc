// ShmOptions::validate (pdkv/options/shm.h).
#include "pdkv/options/shm.h"

#include <string>

#include "util/option_check.h"

namespace pdkv {

namespace {
constexpr uint32_t kMaxCopyThreads = 64;
constexpr size_t kMaxAllowedPeerUids = 64;
}  // namespace

Status ShmOptions::validate() const {
  PDKV_RETURN_IF_ERROR(util::check_in_range<uint32_t>("shm.copy_threads", copy_threads, 1, kMaxCopyThreads));
  if (allowed_peer_uids.size() > kMaxAllowedPeerUids)
    return InvalidArgument("shm.allowed_peer_uids lists " + std::to_string(allowed_peer_uids.size()) +
                           " uids; at most " + std::to_string(kMaxAllowedPeerUids));
  return util::check_seconds("shm.connect_timeout_s", connect_timeout_s, 86400);
}

}  // namespace pdkv
