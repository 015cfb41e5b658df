#include "transport/tcp/conn.h"

#include <unistd.h>

#include <algorithm>

#include "transport/tcp/progress.h"
#include "util/socket.h"

namespace pdkv::tcp {

void RxState::abandon() {
  if (pipe) pipe->abandon();
  staged = false;
  pins.clear();
  gens.reset();
  reject = Status::Ok();
  read_part = PendingPart{};
}

TcpConn::~TcpConn() {
  if (fd >= 0) ::close(fd);
}

// ---------------------------------------------------------------- pending parts

size_t TcpConn::pending_count() {
  std::lock_guard<std::mutex> lk(pmu_);
  return pending_.size();
}

bool TcpConn::track(PendingPart part, uint64_t xfer_id) {
  std::lock_guard<std::mutex> lk(pmu_);
  if (dead_) return false;
  const auto d = part.post->xfer->deadline();
  if (d < earliest_deadline_) earliest_deadline_ = d;
  pending_.emplace(pending_key(xfer_id, part.batch), std::move(part));
  if (owner) owner->npending.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

bool TcpConn::take_pending(uint64_t xfer, uint32_t batch, PendingPart* out) {
  {
    std::lock_guard<std::mutex> lk(pmu_);
    auto it = pending_.find(pending_key(xfer, batch));
    if (it == pending_.end()) return false;
    *out = std::move(it->second);
    pending_.erase(it);
  }
  if (owner) owner->npending.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

bool TcpConn::find_pending_read(uint64_t xfer, uint32_t batch, PendingPart* out) {
  std::lock_guard<std::mutex> lk(pmu_);
  auto it = pending_.find(pending_key(xfer, batch));
  if (it == pending_.end() || it->second.dst == nullptr) return false;
  *out = it->second;
  return true;
}

uint64_t TcpConn::expired_transfer(Clock::time_point now) {
  std::lock_guard<std::mutex> lk(pmu_);
  if (earliest_deadline_ > now) return 0;
  Clock::time_point earliest = Clock::time_point::max();
  uint64_t culprit = 0;
  for (auto& [k, part] : pending_) {
    auto d = part.post->xfer->deadline();
    if (d <= now && culprit == 0) culprit = part.post->xfer->id();
    earliest = std::min(earliest, d);
  }
  earliest_deadline_ = earliest;
  return culprit;
}

// ---------------------------------------------------------------- send side

void TcpConn::update_interest_locked() {
  if (owner) owner->set_interest(*this, !driven_ && !rx_paused.load(std::memory_order_acquire), want_out_);
}

TcpConn::SendResult TcpConn::send(std::unique_ptr<OutMsg> m) {
  std::lock_guard<std::mutex> lk(smu_);
  if (dead_) return SendResult::kDead;
  if (sq_.empty()) {
    int err = 0;
    const int r = send_some(fd, *m, &err);
    if (r == 1) return SendResult::kSent;
    if (r < 0) {
      kill_reason_ = ConnectionError("sending to " + desc + " failed: " + util::errno_str(err));
      kill_requested_ = true;
      sq_cost_ += m->cost();
      sq_.push_back(std::move(m));
      return SendResult::kFailed;
    }
  }
  sq_cost_ += m->cost();
  sq_.push_back(std::move(m));
  bool changed = false;
  if (!want_out_) {
    want_out_ = true;
    tx_progress_ = Clock::now();
    if (owner) owner->watch(tx_blocked, true);
    changed = true;
  }
  // Back-pressure: a peer that sends requests but does not read the answers stops
  // being read; its requests wait in its own socket buffers, not in our memory.
  if (!outbound && !rx_paused.load() && (sq_cost_ > kMaxQueuedCost || sq_.size() > kMaxQueuedFrames)) {
    rx_paused = true;
    changed = true;
  }
  if (changed) update_interest_locked();
  return SendResult::kQueued;
}

bool TcpConn::flush() {
  std::lock_guard<std::mutex> lk(smu_);
  if (dead_) return false;
  tx_progress_ = Clock::now();  // writable: the peer is reading
  bool blocked = false;
  while (!sq_.empty()) {
    int err = 0;
    const int r = send_some(fd, *sq_.front(), &err);
    if (r == 0) {
      blocked = true;  // EPOLLOUT stays armed
      break;
    }
    if (r < 0) {
      kill_reason_ = ConnectionError("sending to " + desc + " failed: " + util::errno_str(err));
      kill_requested_ = true;
      break;
    }
    sq_cost_ -= sq_.front()->cost();
    sq_.pop_front();  // sent: pins (read responses) are released here
  }
  bool changed = false;
  if (rx_paused.load() && sq_cost_ <= kMaxQueuedCost / 2 && sq_.size() <= kMaxQueuedFrames / 2) {
    rx_paused = false;  // back-pressure over: read requests again
    changed = true;
  }
  if (!blocked && want_out_) {
    want_out_ = false;
    if (owner) owner->watch(tx_blocked, false);
    changed = true;
  }
  if (changed) update_interest_locked();
  return !blocked && kill_requested_;
}

void TcpConn::send_if_idle(OutMsg& m) {
  std::lock_guard<std::mutex> lk(smu_);
  if (dead_ || !sq_.empty()) return;
  int err = 0;
  send_some(fd, m, &err);
}

bool TcpConn::output_stalled(Clock::time_point now, Clock::duration limit) {
  std::lock_guard<std::mutex> lk(smu_);
  return want_out_ && now - tx_progress_ >= limit;
}

bool TcpConn::set_driven(bool on) {
  std::lock_guard<std::mutex> lk(smu_);
  if (on) {
    if (dead_) return false;
    driven_ = true;
    update_interest_locked();
    return true;
  }
  driven_ = false;
  if (!dead_ && fd >= 0) update_interest_locked();
  return true;
}

size_t TcpConn::queued_frames() {
  std::lock_guard<std::mutex> lk(smu_);
  return sq_.size();
}

bool TcpConn::is_dead() {
  std::lock_guard<std::mutex> lk(smu_);
  return dead_;
}

void TcpConn::set_kill_reason(Status why) {
  std::lock_guard<std::mutex> lk(smu_);
  kill_reason_ = std::move(why);
}

Status TcpConn::kill_reason() {
  std::lock_guard<std::mutex> lk(smu_);
  return kill_reason_;
}

// ---------------------------------------------------------------- both

bool TcpConn::retire(std::unordered_map<uint64_t, PendingPart>* pend, std::deque<std::unique_ptr<OutMsg>>* out) {
  {
    std::lock_guard<std::mutex> lk1(pmu_);
    std::lock_guard<std::mutex> lk2(smu_);
    if (dead_) return false;
    dead_ = true;
    pend->swap(pending_);
    out->swap(sq_);
    sq_cost_ = 0;
  }
  if (owner) owner->npending.fetch_sub(static_cast<int64_t>(pend->size()), std::memory_order_acq_rel);
  return true;
}

std::vector<PendingPart> TcpConn::drop_unsent(uint64_t id) {
  std::vector<PendingPart> dropped;
  {
    std::lock_guard<std::mutex> lk1(pmu_);
    std::lock_guard<std::mutex> lk2(smu_);
    if (dead_) return dropped;
    for (auto it = sq_.begin(); it != sq_.end();) {
      OutMsg& m = **it;
      if (m.hdr.xfer_id == id && m.sent == 0 &&
          (m.hdr.type == static_cast<uint16_t>(FrameType::kWrite) ||
           m.hdr.type == static_cast<uint16_t>(FrameType::kReadReq))) {
        auto pit = pending_.find(pending_key(id, m.hdr.batch));
        if (pit != pending_.end()) {
          dropped.push_back(std::move(pit->second));
          pending_.erase(pit);
        }
        sq_cost_ -= m.cost();
        it = sq_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (owner) owner->npending.fetch_sub(static_cast<int64_t>(dropped.size()), std::memory_order_acq_rel);
  return dropped;
}

}  // namespace pdkv::tcp
