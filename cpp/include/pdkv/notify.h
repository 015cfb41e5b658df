// pdkv/notify.h: the queue of notifications an agent has received.
//
// A notification is an opaque byte string a peer attached to a transfer; it is
// queued only after every byte of that transfer has landed in this process.
// Consumers take notifications without busy-waiting: block with a timeout, or
// watch `fd()` (an eventfd that is readable exactly while the queue is non-empty)
// from an event loop.
//
// The queue is bounded in count and bytes (AgentConfig::max_queued_notifs,
// max_queued_notif_bytes): push() refuses, before accepting, a notification that
// does not fit, so the transport that received it fails the sender's transfer with
// that error instead of acknowledging it. A notification push() accepted is never
// dropped.
//
// Thread safety: all methods are safe from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "pdkv/status.h"

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

  // The bounds (0: no bound on that measure). A queue holding `max_count`
  // notifications, or holding any whose bytes (payload + sender name) plus the new
  // one's exceed `max_bytes`, refuses the next push. An empty queue takes any one.
  void set_limits(uint64_t max_count, uint64_t max_bytes);
  // Queues `n`, or refuses it (ResourceExhausted naming the limit, `n` not queued)
  // when the queue is full.
  Status push(Notification n);
  // Removes and returns up to `max` queued notifications (0 = all), oldest first.
  std::vector<Notification> take(size_t max = 0);
  // Like take(), but first blocks up to timeout_s (< 0: forever) for one to arrive.
  std::vector<Notification> wait(double timeout_s, size_t max = 0);
  // Wakes every wait() (used at shutdown).
  void close();
  int fd() const { return efd_; }
  size_t size() const;
  // Bytes queued (payloads + sender names), and notifications refused so far.
  uint64_t bytes() const;
  uint64_t refused() const;

 private:
  std::vector<Notification> take_locked(size_t max);
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Notification> q_;
  uint64_t bytes_ = 0;      // payload + sender name bytes of q_
  uint64_t max_count_ = 0;  // 0: unbounded
  uint64_t max_bytes_ = 0;
  uint64_t refused_ = 0;
  bool closed_ = false;
  int efd_ = -1;
};

}  // namespace pdkv
