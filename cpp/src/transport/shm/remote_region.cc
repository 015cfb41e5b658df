#include "transport/shm/remote_region.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cerrno>
#include <chrono>
#include <cstdio>

#include "util/socket.h"

namespace pdkv::shm {
namespace {

std::string hex_addr(uint64_t a) {
  char buf[24];
  snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

// Checks the confirmation against the metadata, then maps the memfd or checks that
// cross-memory attach works. Only the confirmed address and length are used.
Result<std::shared_ptr<RemoteRegion>> attach(const std::shared_ptr<ShmConn>& c, const Peer& peer, const RegionDesc& d,
                                             RegionAnswer ans) {
  util::ScopedFd fd(ans.fd);
  const RegionInfo& ri = ans.info;
  auto show = [](uint64_t addr, uint64_t len, bool shareable) {
    return "[" + hex_addr(addr) + ", +" + std::to_string(len) + ")" + (shareable ? " shared" : " private");
  };
  // Agent.alloc memory (shareable in the metadata) is shared whole; engine memory may
  // have a shared window of whole pages, which the metadata does not carry.
  const bool whole = ri.shareable && ri.shared_offset == 0 && ri.shared_len == ri.len;
  if (ri.addr != d.addr || ri.len != d.len || (d.shareable && !whole) || ri.kind != d.kind)
    return OutOfRange("peer '" + peer.md.name + "' confirms region " + std::to_string(d.id) + " as " +
                      show(ri.addr, ri.len, whole) + " but its metadata says " + show(d.addr, d.len, d.shareable) +
                      "; fetch its metadata again");
  auto r = std::make_shared<RemoteRegion>();
  r->id = d.id;
  r->len = ri.len;
  r->remote_addr = ri.addr;
  r->conn = c;
  if (ri.shareable) {
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < ri.shared_len)
      return ProtocolError("peer's region " + std::to_string(d.id) + " is smaller than it confirms");
    void* p = ::mmap(nullptr, ri.shared_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) return Internal("mmap of the peer's region failed: " + util::errno_str(errno));
    r->base = static_cast<char*>(p);
    r->shared_offset = ri.shared_offset;
    r->shared_len = ri.shared_len;
    if (whole) return r;
  }
  // Cross-memory attach (for the bytes outside the shared window): check once that
  // the kernel lets us reach the peer.
  const uint64_t probe_at = ri.shared_offset > 0 || !ri.shareable ? ri.addr : ri.addr + ri.len - 1;
  char probe;
  iovec l{&probe, 1}, rm{reinterpret_cast<void*>(probe_at), 1};
  if (c->peer_exited())
    return ConnectionError("peer '" + peer.md.name + "': its process " + std::to_string(c->peer_pid()) + " exited");
  if (::process_vm_readv(c->peer_pid(), &l, 1, &rm, 1, 0) != 1) {
    const int err = errno;
    std::string why = "region " + std::to_string(d.id) + " of peer '" + peer.md.name + "' is not shared memory" +
                      (ri.shareable ? " outside its whole pages" : "") + " and cross-memory attach to pid " +
                      std::to_string(c->peer_pid()) + " is not permitted (" + util::errno_str(err) +
                      "); let pdkv allocate the pool (Agent.alloc), allow ptrace (kernel.yama.ptrace_scope=0 or "
                      "CAP_SYS_PTRACE), or use the tcp transport";
    if (!ri.shareable) return NotSupported(why);
    r->cma_denied = std::move(why);  // the shared window still works
  }
  return r;
}

}  // namespace

// Region requests given up on (answers still owed) that one connection remembers.
constexpr size_t kMaxAbandonedRegionReqs = 64;

std::string deregistered(const std::string& peer, uint64_t id) {
  return "peer '" + peer + "' deregistered region " + std::to_string(id) + "; fetch its metadata again";
}

Result<std::shared_ptr<RemoteRegion>> confirm_region(const std::shared_ptr<ShmConn>& c, const Peer& peer, uint64_t id,
                                                     Clock::time_point until) {
  const auto asked_at = Clock::now();
  auto one_request = c->take_region_request_slot(until);
  if (!one_request.taken())
    return TimeoutError("region " + std::to_string(id) + " of peer '" + peer.md.name +
                        "' was not confirmed before the transfer's deadline: another transfer's request for a "
                        "region of this peer was still waiting for the answer");
  {
    auto s = c->lock();
    auto it = s->regions.find(id);
    if (it != s->regions.end()) return it->second;
    if (s->revoked_ids.count(id)) return NotFound(deregistered(peer.md.name, id));
  }
  const RegionDesc* d = peer.md.find_region(id);
  if (!d) return NotFound("peer '" + peer.md.name + "' exports no region " + std::to_string(id));
  RegionAnswer ans;
  {
    {
      auto s = c->lock();
      if (s->dead) return s->dead_reason;
      s->pending_req = id;
    }
    Status sent = c->send_frame(Ctl::kRegionReq, id, {});
    auto s = c->lock();
    const bool got = sent.ok() && s.wait_until(until, [&] { return s->dead || s->answers.count(id); });
    s->pending_req = 0;
    auto it = s->answers.find(id);
    if (it != s->answers.end()) {
      ans = std::move(it->second);
      s->answers.erase(it);
    }
    if (s->dead) {
      if (ans.fd >= 0) ::close(ans.fd);
      return s->dead_reason;
    }
    if (!sent.ok()) return sent;
    if (!got) {
      // Its answer may still come. Past a bound, a late answer is not expected any more
      // and closes the connection as an unasked one.
      if (s->abandoned_reqs.size() < kMaxAbandonedRegionReqs) s->abandoned_reqs.push_back(id);
      return TimeoutError("peer '" + peer.md.name + "' did not confirm region " + std::to_string(id) + " within " +
                          std::to_string(std::chrono::duration<double>(Clock::now() - asked_at).count()) +
                          " s (the transfer's deadline, or the connect timeout for a transfer without one)");
    }
  }
  if (!ans.st.ok()) return ans.st.with_context("region " + std::to_string(id) + " of peer '" + peer.md.name + "'");
  PDKV_ASSIGN_OR_RETURN(auto r, attach(c, peer, *d, std::move(ans)));
  auto s = c->lock();
  if (s->revoked_ids.count(id)) return NotFound(deregistered(peer.md.name, id));  // revoked while we attached
  return s->regions.emplace(id, r).first->second;
}

void ack_revoke_when_idle(const std::shared_ptr<RemoteRegion>& r) {
  if (r->revoked && r->inflight.load() == 0 && !r->ack_sent.exchange(true)) {
    if (auto c = r->conn.lock()) (void)c->send_frame(Ctl::kRevokeAck, r->id, {});
  }
}

}  // namespace pdkv::shm
