#include "transport/tcp/conn.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "transport/tcp/compress.h"
#include "transport/tcp/progress.h"
#include "util/socket.h"

namespace pdkv::tcp {

void RxState::abandon() {
  if (pipe) pipe->abandon();
  std::vector<uint8_t>().swap(zbuf);  // a half-received compressed payload
  zgrow = false;
  staged = false;
  pins.clear();
  zdst.clear();
  runs = nullptr;
  runs_own.clear();
  gens.reset();
  reject = Status::Ok();
  read_part = PendingPart{};
}

// ---------------------------------------------------------------- identity

std::shared_ptr<TcpConn> TcpConn::dialled(int fd, ProgressThread* owner, std::string desc, std::string peer_name,
                                          std::weak_ptr<PeerConns> pc, uint32_t slot) {
  return std::shared_ptr<TcpConn>(new TcpConn(fd, true, owner, std::move(desc), "", std::move(peer_name),
                                              std::move(pc), slot, Clock::time_point::max()));
}

std::shared_ptr<TcpConn> TcpConn::accepted(int fd, ProgressThread* owner, std::string desc, std::string source,
                                           Clock::time_point hello_deadline) {
  return std::shared_ptr<TcpConn>(
      new TcpConn(fd, false, owner, std::move(desc), std::move(source), "", {}, 0, hello_deadline));
}

TcpConn::TcpConn(int fd, bool outbound, ProgressThread* owner, std::string desc, std::string source,
                 std::string peer_name, std::weak_ptr<PeerConns> pc, uint32_t slot, Clock::time_point deadline)
    : outbound_(outbound),
      owner_(owner),
      base_desc_(std::move(desc)),
      source_(std::move(source)),
      pc_(std::move(pc)),
      slot_(slot),
      peer_name_(std::move(peer_name)),
      authed_(outbound),  // a dialled connection finished its handshake before this
      fd_(fd),
      deadline_(deadline.time_since_epoch().count()) {}

TcpConn::~TcpConn() {
  const int fd = fd_.load();
  if (fd >= 0) ::close(fd);
}

std::string TcpConn::desc() const {
  if (outbound_ || !authed()) return base_desc_;
  return "peer '" + peer_name_ + "' (" + base_desc_ + ")";
}

const std::string& TcpConn::peer_name() const {
  static const std::string unknown;
  return authed() ? peer_name_ : unknown;
}

void TcpConn::authenticate(std::string name) {
  if (authed()) return;
  peer_name_ = std::move(name);
  authed_.store(true, std::memory_order_release);
  if (owner_) owner_->slow_end();  // the handshake deadline no longer applies
}

// ---------------------------------------------------------------- receive side

void TcpConn::note_received(uint64_t got) {
  // A half-read frame (header, control or payload) must keep moving: the owner's
  // deadline scan closes the connection after frame_timeout_s without a byte.
  const bool mid = rx_.mid_frame();
  if (got > 0 || !mid) rx_progress_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
  if (owner_) owner_->watch(rx_mid_, mid);
}

void TcpConn::start_draining(Clock::duration linger) {
  const int fd = fd_.load();
  if (!owner_ || fd < 0) return;
  ::shutdown(fd, SHUT_WR);
  deadline_.store((Clock::now() + linger).time_since_epoch().count(), std::memory_order_release);
  draining_.store(true, std::memory_order_release);
  owner_->slow_begin();  // until drained
}

void TcpConn::close_socket() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) ::close(fd);
  if (draining_.exchange(false) && owner_) owner_->slow_end();
  std::vector<std::shared_ptr<void>> gone;
  {
    std::lock_guard<std::mutex> lk(tickets_mu_);
    gone.swap(tickets_);
  }
}

void TcpConn::hold(std::shared_ptr<void> ticket) {
  std::lock_guard<std::mutex> lk(tickets_mu_);
  if (fd() >= 0) tickets_.push_back(std::move(ticket));  // (closed meanwhile: released here)
}

Status TcpConn::frame_stalled(Clock::time_point now, Clock::duration limit, double limit_s) {
  if (rx_mid_.load(std::memory_order_acquire)) {
    const Clock::time_point last{Clock::duration(rx_progress_.load(std::memory_order_acquire))};
    if (now - last >= limit)
      return TimeoutError(desc() + " stopped sending in the middle of a frame (no byte for " +
                          std::to_string(limit_s) + " s)");
  }
  if (tx_blocked_.load(std::memory_order_acquire) && output_stalled(now, limit)) {
    return TimeoutError(desc() + " stopped reading: queued frames did not move for " + std::to_string(limit_s) +
                        " s");
  }
  return Status::Ok();
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
  if (owner_) owner_->npending.fetch_add(1, std::memory_order_acq_rel);
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
  if (owner_) owner_->npending.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

bool TcpConn::find_pending_read(uint64_t xfer, uint32_t batch, PendingPart* out) {
  std::lock_guard<std::mutex> lk(pmu_);
  auto it = pending_.find(pending_key(xfer, batch));
  if (it == pending_.end() || (it->second.dst == nullptr && it->second.runs == nullptr)) return false;
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
  if (owner_) owner_->set_interest(*this, !driven_ && !reading_paused(), want_out_);
}

void TcpConn::decode_started() {
  std::lock_guard<std::mutex> lk(smu_);
  if (++decodes_ < kDecodeAhead || decode_paused_.load()) return;
  decode_paused_ = true;
  if (!dead_ && fd() >= 0) update_interest_locked();
}

void TcpConn::decode_done() {
  std::lock_guard<std::mutex> lk(smu_);
  --decodes_;
  if (!decode_paused_.load() || decodes_ >= kDecodeAhead) return;
  decode_paused_ = false;  // read again (level-triggered epoll reports what waited)
  if (!dead_ && fd() >= 0) update_interest_locked();
}

TcpConn::SendResult TcpConn::send(std::unique_ptr<OutMsg> m) {
  std::lock_guard<std::mutex> lk(smu_);
  if (dead_) return SendResult::kDead;
  if (sq_.empty()) {
    int err = 0;
    const int r = send_some(fd(), *m, &err);
    if (r == 1) return SendResult::kSent;
    if (r < 0) {
      kill_reason_ = ConnectionError("sending to " + desc() + " failed: " + util::errno_str(err));
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
    if (owner_) owner_->watch(tx_blocked_, true);
    changed = true;
  }
  // Back-pressure: a peer that sends requests but does not read the answers stops
  // being read; its requests wait in its own socket buffers, not in our memory.
  if (!outbound_ && !rx_paused_.load() && (sq_cost_ > kMaxQueuedCost || sq_.size() > kMaxQueuedFrames)) {
    rx_paused_ = true;
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
    const int r = send_some(fd(), *sq_.front(), &err);
    if (r == 0) {
      blocked = true;  // EPOLLOUT stays armed
      break;
    }
    if (r < 0) {
      kill_reason_ = ConnectionError("sending to " + desc() + " failed: " + util::errno_str(err));
      kill_requested_ = true;
      break;
    }
    sq_cost_ -= sq_.front()->cost();
    sq_.pop_front();  // sent: pins (read responses) are released here
  }
  bool changed = false;
  if (rx_paused_.load() && sq_cost_ <= kMaxQueuedCost / 2 && sq_.size() <= kMaxQueuedFrames / 2) {
    rx_paused_ = false;  // back-pressure over: read requests again
    changed = true;
  }
  if (!blocked && want_out_) {
    want_out_ = false;
    if (owner_) owner_->watch(tx_blocked_, false);
    changed = true;
  }
  if (changed) update_interest_locked();
  return !blocked && kill_requested_;
}

void TcpConn::send_if_idle(OutMsg& m) {
  std::lock_guard<std::mutex> lk(smu_);
  if (dead_ || !sq_.empty()) return;
  int err = 0;
  send_some(fd(), m, &err);
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
  if (!dead_ && fd() >= 0) update_interest_locked();
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
  if (owner_) {
    owner_->npending.fetch_sub(static_cast<int64_t>(pend->size()), std::memory_order_acq_rel);
    owner_->watch(tx_blocked_, false);
    owner_->watch(rx_mid_, false);
    if (!authed() && !outbound_) owner_->slow_end();  // the handshake is over
  }
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
  if (owner_) owner_->npending.fetch_sub(static_cast<int64_t>(dropped.size()), std::memory_order_acq_rel);
  return dropped;
}

void TcpConn::leave_slot() {
  auto pc = pc_.lock();
  if (!pc) return;
  std::lock_guard<std::mutex> lk(pc->mu);
  if (slot_ < pc->conns.size() && pc->conns[slot_].get() == this) pc->conns[slot_].reset();
}

}  // namespace pdkv::tcp
