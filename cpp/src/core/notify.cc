#include "pdkv/notify.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>

namespace pdkv {

NotifQueue::NotifQueue() { efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

NotifQueue::~NotifQueue() {
  if (efd_ >= 0) ::close(efd_);
}

void NotifQueue::set_limits(uint64_t max_count, uint64_t max_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  max_count_ = max_count;
  max_bytes_ = max_bytes;
}

Status NotifQueue::push(Notification n) {
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t size = n.data.size() + n.peer.size();
  const bool full_count = max_count_ != 0 && q_.size() >= max_count_;
  const bool full_bytes = max_bytes_ != 0 && !q_.empty() && bytes_ + size > max_bytes_;
  if (full_count || full_bytes) {
    ++refused_;
    return ResourceExhausted("the notification queue is full (" + std::to_string(q_.size()) + " notifications, " +
                             std::to_string(bytes_) + " bytes not yet taken; limits max_queued_notifs " +
                             std::to_string(max_count_) + ", max_queued_notif_bytes " + std::to_string(max_bytes_) +
                             "): the receiving application is not taking its notifications; refused one of " +
                             std::to_string(n.data.size()) + " bytes");
  }
  bytes_ += size;
  q_.push_back(std::move(n));
  if (q_.size() == 1 && efd_ >= 0) {
    uint64_t one = 1;
    ssize_t r = ::write(efd_, &one, sizeof one);
    (void)r;
  }
  cv_.notify_all();
  return Status::Ok();
}

std::vector<Notification> NotifQueue::take_locked(size_t max) {
  std::vector<Notification> out;
  size_t n = (max == 0 || max > q_.size()) ? q_.size() : max;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    bytes_ -= q_.front().data.size() + q_.front().peer.size();
    out.push_back(std::move(q_.front()));
    q_.pop_front();
  }
  if (q_.empty() && efd_ >= 0) {
    uint64_t v;
    ssize_t r = ::read(efd_, &v, sizeof v);  // reset: readable exactly while non-empty
    (void)r;
  }
  return out;
}

std::vector<Notification> NotifQueue::take(size_t max) {
  std::lock_guard<std::mutex> lk(mu_);
  return take_locked(max);
}

std::vector<Notification> NotifQueue::wait(double timeout_s, size_t max) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] { return !q_.empty() || closed_; };
  if (timeout_s < 0) {
    cv_.wait(lk, ready);
  } else {
    cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
  }
  return take_locked(max);
}

void NotifQueue::close() {
  std::lock_guard<std::mutex> lk(mu_);
  closed_ = true;
  cv_.notify_all();
}

size_t NotifQueue::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return q_.size();
}

uint64_t NotifQueue::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

uint64_t NotifQueue::refused() const {
  std::lock_guard<std::mutex> lk(mu_);
  return refused_;
}

}  // namespace pdkv
