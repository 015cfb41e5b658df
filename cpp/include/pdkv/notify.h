// pdkv/notify.h: the queue of notifications an agent has received.
//
// A notification is an opaque byte string a peer attached to a transfer; it is
// queued only after every byte of that transfer has landed in this process.
// Consumers take notifications without busy-waiting: block with a timeout, or
// watch `fd()` (an eventfd that is readable exactly while the queue is non-empty)
// from an event loop.
//
// Thread safety: all methods are safe from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace pdkv {

struct Notification {
  std::string peer;  // name of the agent that sent it
  std::string data;  // opaque payload
};

class NotifQueue {
 public:
  NotifQueue();
  ~NotifQueue();
  NotifQueue(const NotifQueue&) = delete;
  NotifQueue& operator=(const NotifQueue&) = delete;

  void push(Notification n);
  // Removes and returns up to `max` queued notifications (0 = all), oldest first.
  std::vector<Notification> take(size_t max = 0);
  // Like take(), but first blocks up to timeout_s (< 0: forever) for one to arrive.
  std::vector<Notification> wait(double timeout_s, size_t max = 0);
  // Wakes every wait() (used at shutdown).
  void close();
  int fd() const { return efd_; }
  size_t size() const;

 private:
  std::vector<Notification> take_locked(size_t max);
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Notification> q_;
  bool closed_ = false;
  int efd_ = -1;
};

}  // namespace pdkv
