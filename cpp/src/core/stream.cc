// The streaming write (pdkv/stream.h): a StreamCore holds the state every thread
// shares; StreamingWrite is the user's handle on it. Every change of state funnels
// through StreamCore::service(), which any thread may run (the caller after a post or
// close, the agent's StreamPump after a batch completed or the deadline passed).
#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>

#include "core/stream_pump.h"
#include "pdkv/agent.h"
#include "pdkv/spi/transfer_control.h"

namespace pdkv {
namespace {

// "3, 5-7": the layers first + i (i < n) for which want(i) holds, as ranges.
template <typename Pred>
std::string layer_ranges(uint32_t first, size_t n, Pred want) {
  std::string out;
  for (size_t i = 0; i < n;) {
    if (!want(i)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j + 1 < n && want(j + 1)) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(first + i);
    if (j > i) out += "-" + std::to_string(first + j);
    i = j + 1;
  }
  return out;
}

Clock::time_point deadline_after(double timeout_s) {
  if (timeout_s == 0) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
}

}  // namespace

class StreamCore final : public PumpedStream, public std::enable_shared_from_this<StreamCore> {
 public:
  StreamCore(StreamSpec spec, std::shared_ptr<StreamPump> pump, uint32_t first, uint32_t count, uint64_t layer_bytes,
             uint64_t instance_id, Clock::time_point deadline, std::shared_ptr<Transfer> xfer,
             std::shared_ptr<PreparedTransfer> first_prep)
      : spec_(std::move(spec)),
        pump_(std::move(pump)),
        first_(first),
        count_(count),
        layer_bytes_(layer_bytes),
        instance_id_(instance_id),
        deadline_(deadline),
        xfer_(std::move(xfer)),
        state_(count, LayerState::kUnposted),
        first_prep_(std::move(first_prep)) {}

  Status post_layers(uint32_t first, uint32_t count);
  Status close(std::optional<std::string> notif);
  void cancel() { fail(Cancelled("stream to '" + spec_.peer + "' was cancelled")); }

  void service() override;
  void fail(const Status& why) override;
  Clock::time_point deadline() const override { return deadline_; }

  const std::shared_ptr<Transfer>& transfer() const { return xfer_; }
  uint32_t first_layer() const { return first_; }
  uint32_t num_layers() const { return count_; }
  uint64_t layer_bytes() const { return layer_bytes_; }
  uint32_t layers_posted() const { return read(posted_); }
  uint32_t layers_landed() const { return read(landed_); }
  uint32_t batches_posted() const { return read(batches_); }
  bool closed() const { return read(closed_); }
  double wire_s() const;
  double tail_s() const;

 private:
  enum class LayerState : uint8_t { kUnposted, kPending, kSending, kLanded, kSettled };
  // Layers [first, first + count) of one batch transfer; `prep` when prepared already.
  struct Run {
    uint32_t first;
    uint32_t count;
    std::shared_ptr<PreparedTransfer> prep;
  };
  struct Batch {
    std::shared_ptr<Transfer> xfer;
    uint32_t first;
    uint32_t count;
  };
  // Parts of the stream's Transfer to resolve once the lock is released (resolving may
  // run its terminal callbacks).
  struct Settle {
    std::vector<std::pair<uint64_t, Status>> parts;
    std::vector<std::shared_ptr<Transfer>> cancel;
  };

  template <typename T>
  T read(const T& field) const {
    std::lock_guard<std::mutex> lk(mu_);
    return field;
  }
  LayerState& layer(uint32_t abs) { return state_[abs - first_]; }
  bool finished_locked() const { return final_settled_; }
  void fail_locked(const Status& why);
  void reap_locked(Settle& s);
  void record_how_it_travelled(const Transfer& batch);
  void record_on_wire(const Transfer& x);
  void settle_failure_locked(Settle& s);
  std::vector<Run> take_ready_locked();
  Result<std::shared_ptr<Transfer>> post_run(Run& run);
  Result<std::shared_ptr<Transfer>> send_notification(const std::string& notif);
  void track(const std::shared_ptr<Transfer>& x);
  double remaining_s() const;
  void apply(Settle& s);

  const StreamSpec spec_;
  const std::shared_ptr<StreamPump> pump_;
  const uint32_t first_;
  const uint32_t count_;
  const uint64_t layer_bytes_;
  const uint64_t instance_id_;
  const Clock::time_point deadline_;
  const std::shared_ptr<Transfer> xfer_;  // the stream's state: count_ layer parts + the notification's

  mutable std::mutex mu_;
  std::vector<LayerState> state_;              // guarded by mu_
  std::vector<Batch> inflight_;                // guarded by mu_
  uint32_t reserved_ = 0;                      // batches being posted outside the lock; guarded by mu_
  std::shared_ptr<PreparedTransfer> first_prep_;  // prepared at open for the first layer alone; guarded
  uint32_t posted_ = 0, landed_ = 0, batches_ = 0;  // guarded by mu_
  Clock::time_point all_posted_at_{};          // when the last layer was posted; guarded by mu_
  Clock::time_point closed_at_{};              // when close() succeeded; guarded by mu_
  std::vector<std::pair<Clock::time_point, Clock::time_point>> on_wire_;  // landed transfers; guarded by mu_
  bool closed_ = false;                        // guarded by mu_
  std::optional<std::string> close_notif_;     // guarded by mu_
  bool notif_started_ = false;                 // sent, or settled without sending; guarded by mu_
  std::shared_ptr<Transfer> notif_xfer_;       // guarded by mu_
  bool final_settled_ = false;                 // guarded by mu_
  Status error_;                               // the stream's failure; guarded by mu_
  bool cancels_sent_ = false;                  // guarded by mu_
};

Status StreamCore::post_layers(uint32_t first, uint32_t count) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_.ok()) return error_;
    if (closed_) return InvalidArgument("post_layers after close(): the stream to '" + spec_.peer + "' is closed");
    if (count == 0) return InvalidArgument("post_layers needs count >= 1");
    if (first < first_ || uint64_t(first) + count > uint64_t(first_) + count_)
      return OutOfRange("layers [" + std::to_string(first) + ", " + std::to_string(uint64_t(first) + count) +
                        ") are outside the stream's layers [" + std::to_string(first_) + ", " +
                        std::to_string(first_ + count_) + ")");
    const std::string twice = layer_ranges(first, count, [&](size_t i) {
      return layer(first + uint32_t(i)) != LayerState::kUnposted;
    });
    if (!twice.empty())
      return InvalidArgument("layers " + twice + " were already posted to the stream to '" + spec_.peer +
                             "' (post every layer exactly once)");
    for (uint32_t l = first; l < first + count; ++l) layer(l) = LayerState::kPending;
    posted_ += count;
    if (posted_ == count_) all_posted_at_ = Clock::now();
  }
  service();
  return Status::Ok();
}

Status StreamCore::close(std::optional<std::string> notif) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_.ok()) return error_;
    if (closed_) return InvalidArgument("the stream to '" + spec_.peer + "' is already closed");
    const std::string missing = layer_ranges(first_, count_, [&](size_t i) {
      return state_[i] == LayerState::kUnposted;
    });
    if (!missing.empty())
      return InvalidArgument("close(): layers " + missing + " of the stream's [" + std::to_string(first_) + ", " +
                             std::to_string(first_ + count_) + ") were never posted");
    closed_ = true;
    closed_at_ = Clock::now();
    close_notif_ = std::move(notif);
  }
  service();
  return Status::Ok();
}

void StreamCore::fail(const Status& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (final_settled_) return;
    fail_locked(why);
  }
  service();
}

void StreamCore::fail_locked(const Status& why) {
  if (error_.ok() && !final_settled_) error_ = why;
}

double StreamCore::remaining_s() const {
  if (deadline_ == Clock::time_point::max()) return 0;  // Agent::post: 0 = no deadline
  return std::chrono::duration<double>(deadline_ - Clock::now()).count();
}

void StreamCore::reap_locked(Settle& s) {
  for (size_t i = 0; i < inflight_.size();) {
    Batch& b = inflight_[i];
    if (!b.xfer->terminal()) {
      ++i;
      continue;
    }
    const bool ok = b.xfer->state() == XferState::kDone;
    Status st = ok ? Status::Ok() : b.xfer->error();
    // A batch this stream cancelled because it failed reports the stream's cause.
    if (!ok && st.code() == StatusCode::kCancelled && !error_.ok()) st = error_;
    for (uint32_t l = b.first; l < b.first + b.count; ++l) {
      layer(l) = ok ? LayerState::kLanded : LayerState::kSettled;
      s.parts.emplace_back(ok ? layer_bytes_ : 0, st);
    }
    if (ok) {
      landed_ += b.count;
      record_how_it_travelled(*b.xfer);
    } else {
      fail_locked(st);
    }
    inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  if (notif_xfer_ && notif_xfer_->terminal() && !final_settled_) {
    Status st = notif_xfer_->state() == XferState::kDone ? Status::Ok() : notif_xfer_->error();
    if (!st.ok() && st.code() == StatusCode::kCancelled && !error_.ok()) st = error_;
    if (!st.ok()) fail_locked(st);
    if (st.ok()) record_on_wire(*notif_xfer_);
    s.parts.emplace_back(0, st);
    final_settled_ = true;
  }
}

// The stream's Transfer reports what its batches did on the wire: the sum of their
// wire bytes, and the codec of the last batch that was compressed ("" while none was;
// with mode "auto" a batch that measures the link goes plain among compressed ones).
void StreamCore::record_how_it_travelled(const Transfer& batch) {
  record_on_wire(batch);
  spi::TransferControl ctl(xfer_);
  ctl.add_wire_bytes(batch.wire_bytes());
  const std::string_view codec = batch.compression();
  if (!codec.empty()) ctl.set_compression(codec.data());  // a string literal (Transfer::compression)
}

void StreamCore::settle_failure_locked(Settle& s) {
  for (auto& st : state_) {
    if (st == LayerState::kUnposted || st == LayerState::kPending) {
      st = LayerState::kSettled;
      s.parts.emplace_back(0, error_);
    }
  }
  if (!notif_started_) {
    notif_started_ = true;
    final_settled_ = true;
    s.parts.emplace_back(0, error_);
  }
  if (!cancels_sent_) {
    cancels_sent_ = true;
    for (auto& b : inflight_) s.cancel.push_back(b.xfer);
    if (notif_xfer_) s.cancel.push_back(notif_xfer_);
  }
}

std::vector<StreamCore::Run> StreamCore::take_ready_locked() {
  std::vector<Run> runs;
  if (inflight_.size() + reserved_ >= spec_.opts.max_inflight_batches) return runs;
  uint32_t pending = 0;
  for (auto st : state_) pending += st == LayerState::kPending;
  if (pending == 0) return runs;
  if (!closed_ && pending * layer_bytes_ < spec_.opts.min_batch_bytes) return runs;
  for (uint32_t i = 0; i < count_;) {
    if (state_[i] != LayerState::kPending) {
      ++i;
      continue;
    }
    uint32_t j = i;
    while (j < count_ && state_[j] == LayerState::kPending) state_[j++] = LayerState::kSending;
    Run r{first_ + i, j - i, nullptr};
    if (r.count == 1 && r.first == first_ && first_prep_) r.prep = std::move(first_prep_);
    runs.push_back(std::move(r));
    i = j;
  }
  reserved_ += uint32_t(runs.size());
  return runs;
}

Result<std::shared_ptr<Transfer>> StreamCore::post_run(Run& run) {
  StreamPump::AgentUse use = pump_->use_agent();
  Agent* agent = use.agent();
  if (!agent) return ConnectionError("the agent of the stream to '" + spec_.peer + "' is shutting down");
  if (!run.prep) {
    PlanOptions plan = spec_.plan;
    plan.first_layer = run.first;
    plan.num_layers = run.count;
    PDKV_ASSIGN_OR_RETURN(run.prep, agent->prepare_blocks(spec_.peer, OpKind::kWrite, spec_.local, spec_.remote, plan,
                                                          spec_.xfer));
  }
  if (run.prep->instance_id != instance_id_)
    return StalePeer("peer '" + spec_.peer + "' was re-added (restarted) since the stream was opened");
  const double left = remaining_s();
  if (deadline_ != Clock::time_point::max() && left <= 0)
    return TimeoutError("the stream to '" + spec_.peer + "' passed its deadline before layers " +
                        std::to_string(run.first) + "-" + std::to_string(run.first + run.count - 1) + " were sent");
  std::string progress;
  if (!spec_.opts.progress_prefix.empty())
    progress = spec_.opts.progress_prefix + std::to_string(run.first) + "-" + std::to_string(run.first + run.count);
  return agent->post(*run.prep, std::move(progress), left);
}

Result<std::shared_ptr<Transfer>> StreamCore::send_notification(const std::string& notif) {
  StreamPump::AgentUse use = pump_->use_agent();
  Agent* agent = use.agent();
  if (!agent) return ConnectionError("the agent of the stream to '" + spec_.peer + "' is shutting down");
  const double left = remaining_s();
  if (deadline_ != Clock::time_point::max() && left <= 0)
    return TimeoutError("the stream to '" + spec_.peer + "' passed its deadline before its notification was sent");
  return agent->send_notification(spec_.peer, notif, left);
}

void StreamCore::track(const std::shared_ptr<Transfer>& x) {
  // Completion callbacks must not post (spi/transfer_control.h): hand over to the pump.
  spi::TransferControl(x).on_terminal([self = shared_from_this()] { self->pump_->wake(self); });
}

void StreamCore::apply(Settle& s) {
  for (auto& [bytes, st] : s.parts) spi::TransferControl(xfer_).resolve_part(bytes, st);
  for (auto& x : s.cancel) x->cancel();
}

void StreamCore::service() {
  for (;;) {
    Settle settle;
    std::vector<Run> runs;
    std::optional<std::string> notif;  // to send now
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!final_settled_ && Clock::now() >= deadline_)
        fail_locked(TimeoutError("the stream to '" + spec_.peer + "' did not finish within its deadline (" +
                                 std::to_string(landed_) + " of " + std::to_string(count_) + " layers landed" +
                                 (closed_ ? "" : "; not closed") + ")"));
      reap_locked(settle);
      if (!error_.ok()) {
        settle_failure_locked(settle);
      } else {
        runs = take_ready_locked();
        if (runs.empty() && closed_ && landed_ == count_ && !notif_started_) {
          notif_started_ = true;
          notif = close_notif_ ? *close_notif_ : spec_.notif;
          if (notif->empty()) {  // nothing to send: done
            final_settled_ = true;
            settle.parts.emplace_back(0, Status::Ok());
            notif.reset();
          }
        }
      }
    }
    apply(settle);
    if (runs.empty() && !notif) return;
    std::vector<std::shared_ptr<Transfer>> posted;
    for (Run& run : runs) {
      Result<std::shared_ptr<Transfer>> x = post_run(run);
      std::lock_guard<std::mutex> lk(mu_);
      --reserved_;
      if (!x.ok()) {
        for (uint32_t l = run.first; l < run.first + run.count; ++l) layer(l) = LayerState::kPending;
        fail_locked(x.status());
        continue;
      }
      ++batches_;
      inflight_.push_back(Batch{*x, run.first, run.count});
      posted.push_back(*x);
      if (cancels_sent_) (*x)->cancel();  // failed meanwhile: its callback still reaps it
    }
    if (notif) {
      Result<std::shared_ptr<Transfer>> x = send_notification(*notif);
      std::lock_guard<std::mutex> lk(mu_);
      if (!x.ok()) {
        notif_started_ = false;  // settled with the failure by the next round
        fail_locked(x.status());
      } else {
        notif_xfer_ = *x;
        posted.push_back(*x);
        if (cancels_sent_) notif_xfer_->cancel();
      }
    }
    // Callbacks only once the transfers are listed, so that one already terminal is reaped.
    for (auto& x : posted) track(x);
    // Another round: a post that failed at once, or batches that already completed.
  }
}

void StreamCore::record_on_wire(const Transfer& x) {
  const auto d = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(x.elapsed_s()));
  on_wire_.emplace_back(x.started_at(), x.started_at() + d);
}

double StreamCore::wire_s() const {
  std::vector<std::pair<Clock::time_point, Clock::time_point>> v = read(on_wire_);
  std::sort(v.begin(), v.end());
  Clock::duration busy{0};
  Clock::time_point covered{};  // the union so far ends here
  for (const auto& [from, to] : v) {
    const Clock::time_point a = std::max(from, covered);
    if (to > a) busy += to - a;
    covered = std::max(covered, to);
  }
  return std::chrono::duration<double>(busy).count();
}

double StreamCore::tail_s() const {
  Clock::time_point last;
  {
    std::lock_guard<std::mutex> lk(mu_);
    last = std::max(all_posted_at_, closed_at_);  // the producer's last call
  }
  if (xfer_->state() != XferState::kDone || last == Clock::time_point{}) return 0;
  const auto end = xfer_->started_at() +
                   std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(xfer_->elapsed_s()));
  return std::max(0.0, std::chrono::duration<double>(end - last).count());
}

// ---- StreamingWrite ----

StreamingWrite::StreamingWrite(std::shared_ptr<StreamCore> core) : core_(std::move(core)) {}
StreamingWrite::~StreamingWrite() {
  if (core_ && !core_->closed()) core_->cancel();
}
Status StreamingWrite::post_layers(uint32_t first, uint32_t count) { return core_->post_layers(first, count); }
Status StreamingWrite::close() { return core_->close(std::nullopt); }
Status StreamingWrite::close(std::string notif) { return core_->close(std::move(notif)); }
void StreamingWrite::cancel() { core_->cancel(); }
const std::shared_ptr<Transfer>& StreamingWrite::transfer() const { return core_->transfer(); }
uint32_t StreamingWrite::first_layer() const { return core_->first_layer(); }
uint32_t StreamingWrite::num_layers() const { return core_->num_layers(); }
uint64_t StreamingWrite::layer_bytes() const { return core_->layer_bytes(); }
uint32_t StreamingWrite::layers_posted() const { return core_->layers_posted(); }
uint32_t StreamingWrite::layers_landed() const { return core_->layers_landed(); }
uint32_t StreamingWrite::batches_posted() const { return core_->batches_posted(); }
double StreamingWrite::wire_s() const { return core_->wire_s(); }
double StreamingWrite::tail_s() const { return core_->tail_s(); }
bool StreamingWrite::closed() const { return core_->closed(); }

// ---- opening ----

Status StreamOptions::validate() const {
  if (max_inflight_batches == 0) return InvalidArgument("StreamOptions.max_inflight_batches must be >= 1, got 0");
  return Status::Ok();
}

Result<std::shared_ptr<StreamingWrite>> open_streaming_write(Agent& agent, const std::shared_ptr<StreamPump>& pump,
                                                             uint64_t xfer_id, StreamSpec spec) {
  const AgentConfig& cfg = agent.config();
  PDKV_RETURN_IF_ERROR(spec.opts.validate());
  if (!std::isfinite(spec.timeout_s)) return InvalidArgument("stream timeout must be finite");
  if (spec.notif.size() > cfg.max_notif_bytes)
    return InvalidArgument("notification is " + std::to_string(spec.notif.size()) + " bytes (limit " +
                           std::to_string(cfg.max_notif_bytes) + ")");
  if (spec.opts.progress_prefix.size() + 24 > cfg.max_notif_bytes)
    return InvalidArgument("progress_prefix is " + std::to_string(spec.opts.progress_prefix.size()) +
                           " bytes: with its layer range it would exceed the notification limit (" +
                           std::to_string(cfg.max_notif_bytes) + " bytes)");
  PDKV_ASSIGN_OR_RETURN(KVLayout local, agent.layout(spec.local.layout));
  const uint32_t layers = local.geometry().num_layers;
  const uint32_t first = spec.plan.first_layer;
  if (first >= layers || uint64_t(first) + spec.plan.num_layers > layers)
    return OutOfRange("layers [" + std::to_string(first) + ", " +
                      std::to_string(uint64_t(first) + std::max(spec.plan.num_layers, 1u)) + ") exceed the " +
                      std::to_string(layers) + " layers of layout '" + spec.local.layout + "'");
  const uint32_t count = spec.plan.num_layers ? spec.plan.num_layers : layers - first;
  // Preparing the first layer checks everything a write checks (peer, layouts, block ids,
  // generations, transport, bounds) before the caller computes anything; every layer
  // moves the same number of bytes.
  PlanOptions one = spec.plan;
  one.num_layers = 1;
  PDKV_ASSIGN_OR_RETURN(auto prep,
                        agent.prepare_blocks(spec.peer, OpKind::kWrite, spec.local, spec.remote, one, spec.xfer));
  const double timeout_s = spec.timeout_s < 0 ? cfg.default_timeout_s : spec.timeout_s;
  const Clock::time_point deadline = deadline_after(timeout_s);
  auto xfer = std::make_shared<Transfer>(xfer_id, OpKind::kWrite, spec.peer, prep->transport, prep->bytes * count,
                                         deadline, cfg.wait_spin_us);
  spi::TransferControl(xfer).set_parts(count + 1);  // one per layer, one for the notification
  const uint64_t layer_bytes = prep->bytes;
  const uint64_t instance = prep->instance_id;
  auto core = std::make_shared<StreamCore>(std::move(spec), pump, first, count, layer_bytes, instance, deadline, xfer,
                                           std::move(prep));
  spi::TransferControl(xfer).set_cancel_hook([weak = std::weak_ptr<StreamCore>(core)] {
    if (auto c = weak.lock()) c->cancel();
  });
  pump->watch(core);
  return std::make_shared<StreamingWrite>(std::move(core));
}

}  // namespace pdkv
