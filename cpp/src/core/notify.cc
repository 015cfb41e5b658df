#include "pdkv/notify.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>

namespace pdkv {

NotifQueue::NotifQueue() { efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

NotifQueue::~NotifQueue() {
  if (efd_ >= 0) ::close(efd_);
}

void NotifQueue::push(Notification n) {
  std::lock_guard<std::mutex> lk(mu_);
  q_.push_back(std::move(n));
  if (q_.size() == 1 && efd_ >= 0) {
    uint64_t one = 1;
    ssize_t r = ::write(efd_, &one, sizeof one);
    (void)r;
  }
  cv_.notify_all();
}

std::vector<Notification> NotifQueue::take_locked(size_t max) {
  std::vector<Notification> out;
  size_t n = (max == 0 || max > q_.size()) ? q_.size() : max;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
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

}  // namespace pdkv
