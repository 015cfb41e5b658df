// AgentConfig::validate (pdkv/config.h).
#include "pdkv/config.h"

#include <cmath>

#include "util/option_check.h"

namespace pdkv {

namespace {
constexpr size_t kMaxSecretBytes = 1024;
constexpr size_t kMaxAcceptedSecrets = 7;
}  // namespace

Status AgentConfig::validate() const {
  if (secret.size() > kMaxSecretBytes)
    return InvalidArgument("agent secret is longer than " + std::to_string(kMaxSecretBytes) + " bytes (" +
                           std::to_string(secret.size()) + ")");
  if (accepted_secrets.size() > kMaxAcceptedSecrets)
    return InvalidArgument("at most " + std::to_string(kMaxAcceptedSecrets) + " accepted_secrets besides the secret (" +
                           std::to_string(accepted_secrets.size()) + " given)");
  for (size_t i = 0; i < accepted_secrets.size(); ++i)
    if (accepted_secrets[i].empty() || accepted_secrets[i].size() > kMaxSecretBytes)
      return InvalidArgument("accepted_secrets[" + std::to_string(i) + "] must be 1.." +
                             std::to_string(kMaxSecretBytes) + " bytes (" + std::to_string(accepted_secrets[i].size()) +
                             ")");
  if (transports.empty()) return InvalidArgument("an agent needs at least one transport (transports is empty)");
  if (!std::isfinite(default_timeout_s) || default_timeout_s < 0)
    return InvalidArgument("default_timeout_s must be a finite number of seconds >= 0 (0: none), got " +
                           util::format_number(default_timeout_s));
  if (max_notif_bytes == 0) return InvalidArgument("max_notif_bytes must be >= 1, got 0");
  if (max_queued_notifs == 0) return InvalidArgument("max_queued_notifs must be >= 1, got 0");
  if (max_queued_notif_bytes == 0) return InvalidArgument("max_queued_notif_bytes must be >= 1, got 0");
  for (const TransportOptions* o : options.all()) PDKV_RETURN_IF_ERROR(o->validate());
  return Status::Ok();
}

}  // namespace pdkv
