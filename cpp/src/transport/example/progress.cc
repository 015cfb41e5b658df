// The inproc copy thread: takes one queued post at a time and copies its extents into
// (write) or out of (read) the target agent's memory, then delivers the notification
// and resolves the transfer's one part.
//
// What a target must check is checked here, against the target's state now, not the
// metadata the initiator prepared from: the target is alive (and the same instance),
// the initiator holds a secret the target accepts, and every extent lies inside a
// region the target exports now (RegionTable::pin; the pin also makes the target's
// deregistration of that region wait until the copy is done).
//
// Thread safety: copy_loop runs on the transport's own thread; run() holds the target's
// LiveAgent::mu for the whole copy, which is what its shutdown waits for.
#include <cstring>

#include "pdkv/spi/transfer_control.h"
#include "transport/example/inproc_transport.h"
#include "util/thread_name.h"

namespace pdkv::inproc {

void InprocTransport::copy_loop() {
  util::name_this_thread("pdkv-inproc");
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left (shutdown fails what is queued)
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    spi::TransferControl ctl(job.xfer);
    Status st;
    if (ctl.cancel_requested()) {
      st = Cancelled("cancelled before its copy started");
    } else if (Clock::now() >= job.xfer->deadline()) {
      st = TimeoutError("inproc: the transfer's deadline passed before its copy started");
    } else {
      st = run(job);
    }
    ctl.resolve_part(st.ok() ? job.prep->bytes : 0, st);
  }
}

Status InprocTransport::run(const Job& job) {
  const InprocPrepared& p = *job.prep;
  const std::string gone = "peer '" + p.peer + "' is gone (its agent closed)";
  std::shared_ptr<LiveAgent> target = find_live(p.instance);
  if (!target) return ConnectionError(gone);
  std::lock_guard<std::mutex> lk(target->mu);
  if (!target->live) return ConnectionError(gone);
  AgentHooks& th = *target->hooks;

  // The secret: the key of the one we hold for the peer must be one the peer accepts.
  // (A transport with a wire proves it with auth::InitiatorHandshake/TargetHandshake
  // instead, never sending the secret or its key.)
  bool accepted = false;
  for (const auto& k : th.accepted_keys()) accepted = accepted || k.bytes == p.key.bytes;
  if (!accepted) return AuthFailed("peer '" + p.peer + "' does not accept the secret given for it");

  const bool write = p.op == OpKind::kWrite;
  for (size_t i = 0; i < p.extents.size(); ++i) {
    const ResolvedExtent& e = p.extents[i];
    uint64_t remote = 0;
    auto pin = th.region_table().pin(e.remote_region, e.remote_offset, e.len, /*inbound=*/true,
                                     mem_kind_bit(MemKind::kHost), &remote);
    if (!pin.ok()) return pin.status().with_context("inproc extent " + std::to_string(i) + " at peer '" + p.peer + "'");
    void* dst = reinterpret_cast<void*>(write ? remote : e.local_addr);
    const void* src = reinterpret_cast<const void*>(write ? e.local_addr : remote);
    std::memmove(dst, src, e.len);
  }
  // After every byte landed: the notification (refused when the target's queue is
  // full, which fails this transfer instead of losing it).
  if (!job.notif.empty()) return th.deliver_notification(Notification{hooks_->agent_name(), job.notif});
  return Status::Ok();
}

}  // namespace pdkv::inproc
