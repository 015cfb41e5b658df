#include "core/stream_pump.h"
#include "util/thread_name.h"

#include <algorithm>

namespace pdkv {

StreamPump::~StreamPump() { join(); }

StreamPump::AgentUse StreamPump::use_agent() {
  std::shared_lock<std::shared_mutex> lk(agent_mu_);
  Agent* a = agent_;
  return AgentUse(std::move(lk), a);
}

void StreamPump::start_locked() {
  if (!thread_.joinable() && !exited_) thread_ = std::thread([this] { run(); });
}

void StreamPump::watch(const std::shared_ptr<PumpedStream>& s) {
  std::lock_guard<std::mutex> lk(mu_);
  // Forget streams that are gone, so the list stays as long as the open streams.
  watched_.erase(std::remove_if(watched_.begin(), watched_.end(), [](auto& w) { return w.expired(); }),
                 watched_.end());
  watched_.push_back(s);
  start_locked();
  cv_.notify_one();  // a nearer deadline
}

void StreamPump::wake(std::shared_ptr<PumpedStream> s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!exited_) {
      queue_.push_back(std::move(s));
      start_locked();
      cv_.notify_one();
      return;
    }
  }
  s->service();  // stopped: the agent is gone, so service() only settles the stream's state
}

void StreamPump::detach_agent(const Status& why) {
  std::vector<std::shared_ptr<PumpedStream>> open;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& w : watched_)
      if (auto s = w.lock()) open.push_back(std::move(s));
  }
  for (auto& s : open) s->fail(why);
  std::unique_lock<std::shared_mutex> lk(agent_mu_);  // waits for calls into the agent in progress
  agent_ = nullptr;
}

void StreamPump::join() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    if (!thread_.joinable()) exited_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void StreamPump::run() {
  util::name_this_thread("pdkv-stream");
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (!queue_.empty()) {
      auto s = std::move(queue_.front());
      queue_.pop_front();
      lk.unlock();
      s->service();
      s.reset();
      lk.lock();
      continue;
    }
    if (stopping_) {
      exited_ = true;  // later wakes run service() in their own thread
      return;
    }
    // Sleep until the nearest deadline of a watched stream, or new work.
    auto next = Clock::time_point::max();
    const auto now = Clock::now();
    std::vector<std::shared_ptr<PumpedStream>> expired;
    for (auto& w : watched_) {
      auto s = w.lock();
      if (!s) continue;
      const auto d = s->deadline();
      if (d <= now) {
        expired.push_back(std::move(s));
      } else {
        next = std::min(next, d);
      }
    }
    if (!expired.empty()) {
      watched_.erase(std::remove_if(watched_.begin(), watched_.end(),
                                    [&](auto& w) {
                                      auto s = w.lock();
                                      return !s || std::find(expired.begin(), expired.end(), s) != expired.end();
                                    }),
                     watched_.end());
      lk.unlock();
      for (auto& s : expired) s->service();  // fails it with Timeout unless it finished
      expired.clear();
      lk.lock();
      continue;
    }
    if (next == Clock::time_point::max()) {
      cv_.wait(lk);
    } else {
      cv_.wait_until(lk, next);
    }
  }
}

}  // namespace pdkv
