#include "transport/tcp/admission.h"

namespace pdkv::tcp {

Admission::Admission(uint32_t max_inbound, uint32_t max_per_peer)
    : max_inbound_(max_inbound), max_per_peer_(max_per_peer) {}

std::shared_ptr<void> Admission::accept(uint32_t* open) {
  std::lock_guard<std::mutex> lk(counts_->mu);
  *open = counts_->inbound;
  if (counts_->inbound >= max_inbound_) return nullptr;
  ++counts_->inbound;
  auto counts = counts_;
  return std::shared_ptr<void>(counts.get(), [counts](void*) {  // (non-null: a ticket tests true)
    std::lock_guard<std::mutex> lk(counts->mu);
    --counts->inbound;
  });
}

Result<std::shared_ptr<void>> Admission::admit(const std::string& peer) {
  std::lock_guard<std::mutex> lk(counts_->mu);
  uint32_t& n = counts_->per_peer[peer];
  if (n >= max_per_peer_) {
    if (n == 0) counts_->per_peer.erase(peer);
    return ResourceExhausted("agent '" + peer + "' already has " + std::to_string(max_per_peer_) +
                             " connections open to this agent (TcpOptions.max_inbound_per_peer); refusing another");
  }
  ++n;
  auto counts = counts_;
  return std::shared_ptr<void>(counts.get(), [counts, peer](void*) {
    std::lock_guard<std::mutex> lk(counts->mu);
    auto it = counts->per_peer.find(peer);
    if (it != counts->per_peer.end() && --it->second == 0) counts->per_peer.erase(it);
  });
}

}  // namespace pdkv::tcp
