// pdkv/transfer.h (public, for users): the state of one posted transfer.
//
// A Transfer is created by Agent::post and completed by a transport's progress
// thread. It is split into "parts" (batches, per connection); it becomes terminal
// only when every part has resolved, so once state() is terminal pdkv will never
// touch the transfer's memory again and the buffers may be reused or freed.
//
// Lifetime rule (as in Mooncake's ScatterTransferOperation): a wait() timeout does
// not cancel the transfer. Keep the memory registered and alive until state() is
// terminal; deregistration blocks until then anyway.
//
// Transports complete a transfer through spi::TransferControl (pdkv/spi/transfer_control.h),
// which reaches the private operations below; users only observe, wait and cancel.
//
// Thread safety: every method is safe from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/types.h"

namespace pdkv {

class RegionPin;  // pdkv/spi/region_table.h
namespace spi {
class TransferControl;
}  // namespace spi

using Clock = std::chrono::steady_clock;

// Whether a transfer's payload is compressed on the wire (docs/compression.md). The
// agent's default is its transport's option (TcpOptions::compress); one transfer may
// override it (XferOptions::compress). Only tcp compresses, host memory only; other
// transports move the bytes exactly, which every mode allows.
enum class CompressMode : uint8_t {
  kOff = 0,       // plain frames (the default; the wire is exactly as before)
  kLossless = 1,  // byte planes + the lossless codec (bit-exact)
  kFp8 = 2,       // FP8 e4m3 + per-group scales (lossy, opt-in)
  kAuto = 3,      // per peer and direction, from the measured link and codec throughput (see policy)
};
std::string_view compress_mode_name(CompressMode m);
// "off", "lossless", "fp8", "auto"; InvalidArgument naming `what` and the value otherwise.
Result<CompressMode> parse_compress_mode(std::string_view s, std::string_view what = "tcp.compress.mode");

class Transfer {
 public:
  Transfer(uint64_t id, OpKind op, std::string peer, std::string transport, uint64_t bytes_total,
           Clock::time_point deadline, uint32_t wait_spin_us);
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  uint64_t id() const { return id_; }
  OpKind op() const { return op_; }
  const std::string& peer() const { return peer_; }
  const std::string& transport() const { return transport_; }
  XferState state() const { return state_.load(std::memory_order_acquire); }
  bool terminal() const { return state() != XferState::kPending; }
  uint64_t bytes_total() const { return bytes_total_; }
  // Bytes confirmed landed so far (monotonic; equals bytes_total when kDone).
  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_relaxed); }
  // OK unless state() is kFailed or kCancelled.
  Status error() const;
  Clock::time_point deadline() const { return deadline_; }
  // Seconds from post to completion (0 while pending).
  double elapsed_s() const;
  // When it was posted (completion: started_at() + elapsed_s(), once terminal).
  Clock::time_point started_at() const { return start_; }
  // How the bytes travelled (set by the transport): the codec that compressed a
  // write or a read's responses ("zstd", "lz4", "fp8"; "" when they travelled as
  // they are), and the payload bytes on the wire for it: sent for a write, received
  // for a read (compressed size; bytes_total when plain; 0 for transports that do
  // not count).
  std::string_view compression() const { return compression_.load(std::memory_order_acquire); }
  uint64_t wire_bytes() const { return wire_bytes_.load(std::memory_order_relaxed); }

  // Blocks until terminal or `timeout_s` passes (< 0: no limit); returns state().
  // Spins briefly first (wait_spin_us) to catch fast completions without a wakeup.
  XferState wait(double timeout_s) const;
  // Requests cancellation: parts not yet started are dropped; parts already on the
  // wire finish. Terminal state is kCancelled unless everything had already been sent.
  void cancel();

 private:
  // The transport side: completing parts, cancel hooks, drivers, pins, terminal
  // callbacks. Documented where transports reach it, pdkv/spi/transfer_control.h.
  friend class spi::TransferControl;
  using Driver = std::function<void(Transfer&, Clock::time_point deadline, uint32_t spin_us)>;

  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }
  void on_terminal(std::function<void()> fn);
  void set_parts(uint32_t n);
  bool resolve_part(uint64_t bytes, const Status& st);
  void set_cancel_hook(std::function<void()> hook);
  void set_driver(Driver d);
  void hold_pins(std::vector<RegionPin> pins);
  void fail_now(const Status& st);
  void finish();

  const uint64_t id_;
  const OpKind op_;
  const std::string peer_;
  const std::string transport_;
  const uint64_t bytes_total_;
  const Clock::time_point start_;
  const Clock::time_point deadline_;
  const uint32_t wait_spin_us_;
  std::atomic<XferState> state_{XferState::kPending};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint32_t> parts_left_{0};
  std::atomic<bool> cancel_requested_{false};
  std::atomic<int64_t> end_ns_{0};
  std::atomic<const char*> compression_{""};  // a string literal
  std::atomic<uint64_t> wire_bytes_{0};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  Status error_;              // first error, guarded by mu_
  bool saw_cancel_ = false;   // guarded by mu_
  // Held through shared_ptr so that copying one under mu_ never copies (or destroys)
  // a Python callable, which would need the GIL while holding mu_.
  std::shared_ptr<const std::function<void()>> cancel_hook_;  // guarded by mu_
  std::shared_ptr<const Driver> driver_;                      // guarded by mu_
  std::vector<RegionPin> pins_;  // released when terminal
  std::vector<std::function<void()>> on_terminal_;  // guarded by mu_; run once by finish()
};

}  // namespace pdkv
