// pdkv/spi/transfer_control.h (SPI, for transport authors, the core and the Python
// bindings): the completing side of a Transfer. Users hold a Transfer (pdkv/transfer.h)
// and can only observe, wait and cancel; whoever moves its bytes declares its parts
// and resolves them through this accessor:
//
//   spi::TransferControl(xfer).set_parts(2);
//   spi::TransferControl(xfer).resolve_part(bytes, Status::Ok());
//
// A TransferControl is a borrowed view: it holds a reference, not ownership, so keep
// the Transfer (its shared_ptr) alive while using it. Thread safety: as Transfer's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/spi/region_table.h"

namespace pdkv::spi {

class TransferControl {
 public:
  // Lets a waiting thread make progress itself (read its own ack) instead of waiting
  // for a progress thread to wake it; see set_driver().
  using Driver = Transfer::Driver;

  explicit TransferControl(Transfer& t) : t_(t) {}
  explicit TransferControl(const std::shared_ptr<Transfer>& t) : t_(*t) {}

  // Declares how many parts will resolve. Call once, before any part can resolve.
  void set_parts(uint32_t n) { t_.set_parts(n); }
  // Resolves one part: OK with its byte count, or an error (kCancelled for dropped
  // parts). Returns true if this made the transfer terminal.
  bool resolve_part(uint64_t bytes, const Status& st) { return t_.resolve_part(bytes, st); }
  // Fails the transfer at once when no parts were started.
  void fail_now(const Status& st) { t_.fail_now(st); }
  // Whether the user called cancel(): parts not yet started should be dropped
  // (resolved with kCancelled).
  bool cancel_requested() const { return t_.cancel_requested(); }
  // Called (once, from the cancelling thread) when the user cancels.
  void set_cancel_hook(std::function<void()> hook) { t_.set_cancel_hook(std::move(hook)); }
  // Optional: called by wait() with the wait's deadline and spin budget; returns when
  // the transfer is terminal, the deadline passed, or it could not drive (another
  // thread is). Cleared once terminal.
  void set_driver(Driver d) { t_.set_driver(std::move(d)); }
  // Keeps the regions the transfer uses alive until it is terminal.
  void hold_pins(std::vector<RegionPin> pins) { t_.hold_pins(std::move(pins)); }
  // Runs `fn` once, when the transfer is terminal: at once in this thread if it
  // already is, else in the thread that completes it (usually a progress thread), after
  // state() is terminal. `fn` must be quick and must not block or take the GIL (the
  // Python binding uses it to wake an event loop through an eventfd).
  void on_terminal(std::function<void()> fn) { t_.on_terminal(std::move(fn)); }
  // Records how the bytes travel (Transfer::compression, wire_bytes). `codec` must be
  // a string literal (codec_kind_name()).
  void set_compression(const char* codec) { t_.compression_.store(codec, std::memory_order_release); }
  void add_wire_bytes(uint64_t n) { t_.wire_bytes_.fetch_add(n, std::memory_order_relaxed); }

 private:
  Transfer& t_;
};

}  // namespace pdkv::spi
