#include "transport/tcp/conn.h"

#include <unistd.h>

#include <algorithm>

#include "transport/tcp/progress.h"

namespace pdkv::tcp {

TcpConn::~TcpConn() {
  if (fd >= 0) ::close(fd);
}

bool TcpConn::track(PendingPart part, uint64_t xfer_id) {
  std::lock_guard<std::mutex> lk(pmu);
  if (dead) return false;
  const auto d = part.post->xfer->deadline();
  if (d < earliest_deadline) earliest_deadline = d;
  pending.emplace(pending_key(xfer_id, part.batch), std::move(part));
  if (owner) owner->npending.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

bool TcpConn::take_pending(uint64_t xfer, uint32_t batch, PendingPart* out) {
  {
    std::lock_guard<std::mutex> lk(pmu);
    auto it = pending.find(pending_key(xfer, batch));
    if (it == pending.end()) return false;
    *out = std::move(it->second);
    pending.erase(it);
  }
  if (owner) owner->npending.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

bool TcpConn::find_pending_read(uint64_t xfer, uint32_t batch, PendingPart* out) {
  std::lock_guard<std::mutex> lk(pmu);
  auto it = pending.find(pending_key(xfer, batch));
  if (it == pending.end() || it->second.dst == nullptr) return false;
  *out = it->second;
  return true;
}

uint64_t TcpConn::expired_transfer(Clock::time_point now) {
  std::lock_guard<std::mutex> lk(pmu);
  if (earliest_deadline > now) return 0;
  Clock::time_point earliest = Clock::time_point::max();
  uint64_t culprit = 0;
  for (auto& [k, part] : pending) {
    auto d = part.post->xfer->deadline();
    if (d <= now && culprit == 0) culprit = part.post->xfer->id();
    earliest = std::min(earliest, d);
  }
  earliest_deadline = earliest;
  return culprit;
}

bool TcpConn::is_dead() {
  std::lock_guard<std::mutex> lk(smu);
  return dead;
}

void TcpConn::set_kill_reason(Status why) {
  std::lock_guard<std::mutex> lk(smu);
  kill_reason_ = std::move(why);
}

Status TcpConn::kill_reason() {
  std::lock_guard<std::mutex> lk(smu);
  return kill_reason_;
}

bool TcpConn::retire(std::unordered_map<uint64_t, PendingPart>* pend, std::deque<std::unique_ptr<OutMsg>>* out) {
  {
    std::lock_guard<std::mutex> lk1(pmu);
    std::lock_guard<std::mutex> lk2(smu);
    if (dead) return false;
    dead = true;
    pend->swap(pending);
    out->swap(sq);
    sq_cost = 0;
  }
  if (owner) owner->npending.fetch_sub(static_cast<int64_t>(pend->size()), std::memory_order_acq_rel);
  return true;
}

std::vector<PendingPart> TcpConn::drop_unsent(uint64_t id) {
  std::vector<PendingPart> dropped;
  {
    std::lock_guard<std::mutex> lk1(pmu);
    std::lock_guard<std::mutex> lk2(smu);
    if (dead) return dropped;
    for (auto it = sq.begin(); it != sq.end();) {
      OutMsg& m = **it;
      if (m.hdr.xfer_id == id && m.sent == 0 &&
          (m.hdr.type == static_cast<uint16_t>(FrameType::kWrite) ||
           m.hdr.type == static_cast<uint16_t>(FrameType::kReadReq))) {
        auto pit = pending.find(pending_key(id, m.hdr.batch));
        if (pit != pending.end()) {
          dropped.push_back(std::move(pit->second));
          pending.erase(pit);
        }
        sq_cost -= m.cost();
        it = sq.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (owner) owner->npending.fetch_sub(static_cast<int64_t>(dropped.size()), std::memory_order_acq_rel);
  return dropped;
}

}  // namespace pdkv::tcp
