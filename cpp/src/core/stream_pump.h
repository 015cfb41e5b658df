// stream_pump.h (core-internal): how Agent::open_stream opens a streaming write
// (open_streaming_write, stream.cc), and the one thread per agent that moves streaming writes
// (pdkv/stream.h) forward when nobody else is calling them: it posts the next batch
// when an earlier one completes, sends the notification once every layer landed, and
// fails a stream whose deadline passed. Transfer completion callbacks must be quick and
// must not post (pdkv/spi/transfer_control.h), so they only queue the stream here.
//
// It also guards the agent's lifetime for streams: a stream calls its agent only
// through use_agent(), and the agent's destructor detaches (detach_agent()) after
// waiting for calls in progress, so a stream that outlives its agent fails instead of
// touching freed memory.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <optional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "pdkv/agent.h"
#include "pdkv/kv_layout.h"
#include "pdkv/status.h"
#include "pdkv/stream.h"
#include "pdkv/transfer.h"

namespace pdkv {

class Agent;

// What the pump drives (StreamCore, stream.cc).
class PumpedStream {
 public:
  virtual ~PumpedStream() = default;
  // Advances the stream: reaps finished batches, posts ready layers, sends the
  // notification, enforces the deadline. Safe to call concurrently with anything.
  virtual void service() = 0;
  // Fails the stream with `why` (a no-op once it finished).
  virtual void fail(const Status& why) = 0;
  virtual Clock::time_point deadline() const = 0;
};

class StreamPump final : public std::enable_shared_from_this<StreamPump> {
 public:
  explicit StreamPump(Agent* agent) : agent_(agent) {}
  ~StreamPump();
  StreamPump(const StreamPump&) = delete;
  StreamPump& operator=(const StreamPump&) = delete;

  // A shared hold on the agent: agent() is null once it was detached.
  class AgentUse {
   public:
    Agent* agent() const { return agent_; }

   private:
    friend class StreamPump;
    AgentUse(std::shared_lock<std::shared_mutex> lk, Agent* a) : lk_(std::move(lk)), agent_(a) {}
    std::shared_lock<std::shared_mutex> lk_;
    Agent* agent_;
  };
  AgentUse use_agent();

  // Watches a new stream's deadline (and fails it when the agent goes away).
  void watch(const std::shared_ptr<PumpedStream>& s);
  // Queues s->service() on the pump thread; runs it here once the pump has stopped.
  void wake(std::shared_ptr<PumpedStream> s);

  // The agent's destructor, before its transports shut down: fails every open stream
  // with `why`, waits for calls into the agent in progress, then detaches the agent.
  void detach_agent(const Status& why);
  // The agent's destructor, after its transports shut down (every batch is terminal):
  // runs the queued services and ends the thread.
  void join();

 private:
  void start_locked();
  void run();

  std::shared_mutex agent_mu_;
  Agent* agent_;  // guarded by agent_mu_

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<PumpedStream>> queue_;  // guarded by mu_
  std::vector<std::weak_ptr<PumpedStream>> watched_;  // guarded by mu_
  bool stopping_ = false;                             // guarded by mu_
  bool exited_ = false;  // the thread ended (or never will run); guarded by mu_
  std::thread thread_;
};

// What Agent::open_stream was given.
struct StreamSpec {
  std::string peer;
  Blocks local;
  Blocks remote;
  PlanOptions plan;
  XferOptions xfer;
  std::string notif;
  double timeout_s = -1;  // < 0: the agent's default; 0: none
  StreamOptions opts;
};

// Validates `spec` (preparing its first layer) and opens the stream; `xfer_id` names
// its Transfer. Agent::open_stream's body.
Result<std::shared_ptr<StreamingWrite>> open_streaming_write(Agent& agent, const std::shared_ptr<StreamPump>& pump,
                                                             uint64_t xfer_id, StreamSpec spec);

}  // namespace pdkv
