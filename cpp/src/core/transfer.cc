#include "pdkv/transfer.h"

#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transfer_control.h"
#include "util/bench_switches.h"

#include <thread>

namespace pdkv {
namespace {

// One step of Transfer::wait's spin: a few CPU pause hints, not a yield. Under the
// kernel's EEVDF scheduler every sched_yield pushes the caller's deadline back, so a
// waiter that yields in a loop loses its core to any busy task beside it for as long
// as those pushes add up (docs/vllm.md: vLLM's workers starved that way); pausing
// keeps the waiter's place for the (wall-clock bounded) spin. BenchSwitch::kWaitYield=1
// restores the yield to compare in one build.
bool wait_spin_yields() {
  static const bool yields = util::bench_switch_is(util::BenchSwitch::kWaitYield, "1");
  return yields;
}

inline void spin_step() {
  if (wait_spin_yields()) {
    std::this_thread::yield();
    return;
  }
  for (int i = 0; i < 16; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  }
}

}  // namespace

Transfer::Transfer(uint64_t id, OpKind op, std::string peer, std::string transport, uint64_t bytes_total,
                   Clock::time_point deadline, uint32_t wait_spin_us)
    : id_(id),
      op_(op),
      peer_(std::move(peer)),
      transport_(std::move(transport)),
      bytes_total_(bytes_total),
      start_(Clock::now()),
      deadline_(deadline),
      wait_spin_us_(wait_spin_us) {}

Transfer::~Transfer() = default;

void Transfer::hold_pins(std::vector<RegionPin> pins) { pins_ = std::move(pins); }

Status Transfer::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

double Transfer::elapsed_s() const {
  return static_cast<double>(end_ns_.load(std::memory_order_acquire)) * 1e-9;
}

XferState Transfer::wait(double timeout_s) const {
  XferState s = state();
  if (s != XferState::kPending) return s;
  const auto t0 = Clock::now();
  const auto until = timeout_s < 0 ? Clock::time_point::max()
                                   : t0 + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(timeout_s));
  std::shared_ptr<const Driver> drive;
  {
    std::lock_guard<std::mutex> lk(mu_);
    drive = driver_;
  }
  if (drive) {
    (*drive)(const_cast<Transfer&>(*this), until, wait_spin_us_);
    s = state();
    if (s != XferState::kPending || Clock::now() >= until) return s;
  }
  if (wait_spin_us_ > 0) {
    const auto spin_end = t0 + std::chrono::microseconds(wait_spin_us_);
    while (Clock::now() < spin_end) {
      s = state();
      if (s != XferState::kPending) return s;
      spin_step();
    }
  }
  std::unique_lock<std::mutex> lk(mu_);
  auto done = [&] { return state() != XferState::kPending; };
  if (timeout_s < 0) {
    cv_.wait(lk, done);
  } else {
    cv_.wait_until(lk, until, done);
  }
  return state();
}

void Transfer::set_driver(Driver d) {
  auto next = d ? std::make_shared<const Driver>(std::move(d)) : nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  if (state() == XferState::kPending) driver_.swap(next);
}

void Transfer::cancel() {
  if (terminal()) return;
  cancel_requested_.store(true, std::memory_order_release);
  std::shared_ptr<const std::function<void()>> hook;
  {
    std::lock_guard<std::mutex> lk(mu_);
    hook = cancel_hook_;
  }
  if (hook) (*hook)();
}

void Transfer::on_terminal(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state() == XferState::kPending) {  // finish() stores the state under mu_: no lost wakeup
      on_terminal_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Transfer::set_parts(uint32_t n) {
  parts_left_.store(n, std::memory_order_release);
  if (n == 0) finish();
}

void Transfer::set_cancel_hook(std::function<void()> hook) {
  auto next = hook ? std::make_shared<const std::function<void()>>(std::move(hook)) : nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  cancel_hook_.swap(next);
}

bool Transfer::resolve_part(uint64_t bytes, const Status& st) {
  if (st.ok()) {
    bytes_done_.fetch_add(bytes, std::memory_order_relaxed);
  } else {
    std::lock_guard<std::mutex> lk(mu_);
    if (st.code() == StatusCode::kCancelled) {
      saw_cancel_ = true;
    } else if (error_.ok()) {
      error_ = st;
    }
  }
  if (parts_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    finish();
    return true;
  }
  return false;
}

void Transfer::fail_now(const Status& st) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.ok()) error_ = st;
  }
  finish();
}

void Transfer::finish() {
  // The hooks are destroyed after mu_ is released: a hook implemented in Python must
  // take the GIL to be destroyed, and a thread holding the GIL may be waiting for mu_.
  std::shared_ptr<const std::function<void()>> cancel_hook;
  std::shared_ptr<const Driver> driver;
  std::vector<std::function<void()>> on_terminal;
  {
    std::lock_guard<std::mutex> lk(mu_);
    XferState s = XferState::kDone;
    if (!error_.ok()) {
      s = XferState::kFailed;
    } else if (saw_cancel_) {
      s = XferState::kCancelled;
      error_ = Cancelled("transfer " + std::to_string(id_) + " to '" + peer_ + "' was cancelled");
    }
    cancel_hook.swap(cancel_hook_);
    driver.swap(driver_);
    end_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count(),
                  std::memory_order_release);
    state_.store(s, std::memory_order_release);
    cv_.notify_all();
    on_terminal.swap(on_terminal_);
  }
  for (auto& fn : on_terminal) fn();
  // Unpin only after the state is terminal: a deregistration waiting on these pins
  // then always observes a finished transfer. (A caller that waits for the transfer
  // and then deregisters may block for the few instructions until this runs.)
  std::vector<RegionPin> pins = std::move(pins_);
  pins.clear();
}

}  // namespace pdkv
