// spi::TransferControl: the transport side of a Transfer (pdkv/spi/transfer_control.h).
// Parts, bytes, the first error, cancellation, the terminal callbacks and the pins a
// transfer holds until it is terminal.
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pdkv/spi/region_table.h"
#include "pdkv/spi/transfer_control.h"
#include "pdkv/transfer.h"

namespace pdkv {
namespace {

std::shared_ptr<Transfer> make_transfer(uint64_t bytes) {
  return std::make_shared<Transfer>(1, OpKind::kWrite, "peer", "mock", bytes, Clock::time_point::max(), 0);
}

TEST(TransferControl, TerminalOnlyOnceEveryPartResolved) {
  auto x = make_transfer(30);
  spi::TransferControl c(x);
  c.set_parts(2);
  EXPECT_FALSE(c.resolve_part(10, Status::Ok()));
  EXPECT_EQ(x->state(), XferState::kPending);
  EXPECT_EQ(x->bytes_done(), 10u);
  EXPECT_TRUE(c.resolve_part(20, Status::Ok()));
  EXPECT_EQ(x->state(), XferState::kDone);
  EXPECT_EQ(x->bytes_done(), 30u);
  EXPECT_TRUE(x->error().ok());
}

TEST(TransferControl, FirstErrorWinsAndFails) {
  auto x = make_transfer(8);
  spi::TransferControl c(*x);
  c.set_parts(2);
  c.resolve_part(0, ConnectionError("first"));
  c.resolve_part(0, TimeoutError("second"));
  EXPECT_EQ(x->state(), XferState::kFailed);
  EXPECT_EQ(x->error().code(), StatusCode::kConnectionError);
  EXPECT_EQ(x->error().message(), "first");
}

TEST(TransferControl, CancelRunsTheHookAndCancelledPartsCancel) {
  auto x = make_transfer(8);
  spi::TransferControl c(x);
  int hooked = 0;
  c.set_parts(1);
  c.set_cancel_hook([&] { ++hooked; });
  EXPECT_FALSE(c.cancel_requested());
  x->cancel();
  EXPECT_TRUE(c.cancel_requested());
  EXPECT_EQ(hooked, 1);
  c.resolve_part(0, Cancelled("dropped"));
  EXPECT_EQ(x->state(), XferState::kCancelled);
  EXPECT_EQ(x->error().code(), StatusCode::kCancelled);
}

TEST(TransferControl, FailNowAndOnTerminal) {
  auto x = make_transfer(8);
  spi::TransferControl c(x);
  std::vector<std::string> seen;
  c.on_terminal([&] { seen.push_back("before"); });
  EXPECT_TRUE(seen.empty());
  c.fail_now(StalePeer("restarted"));
  EXPECT_EQ(x->state(), XferState::kFailed);
  EXPECT_EQ(x->error().code(), StatusCode::kStalePeer);
  c.on_terminal([&] { seen.push_back("after"); });  // already terminal: runs at once
  EXPECT_EQ(seen, (std::vector<std::string>{"before", "after"}));
}

TEST(TransferControl, PinsHeldUntilTerminal) {
  RegionTable table;
  std::vector<char> mem(256);
  auto d = table.add(reinterpret_cast<uint64_t>(mem.data()), mem.size(), MemKind::kHost, -1, true);
  ASSERT_TRUE(d.ok());
  auto pin = table.pin(d->id, 0, 16, false, ~0u, nullptr);
  ASSERT_TRUE(pin.ok());
  auto x = make_transfer(16);
  spi::TransferControl c(x);
  std::vector<RegionPin> pins;
  pins.push_back(std::move(*pin));
  c.hold_pins(std::move(pins));
  c.set_parts(1);
  auto entry = table.take(d->id);
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ((*entry)->inflight.load(), 1);  // the transfer still pins the region
  c.resolve_part(16, Status::Ok());
  EXPECT_EQ((*entry)->inflight.load(), 0);  // released once terminal
  RegionTable::wait_unpinned(*entry);       // returns at once
}

}  // namespace
}  // namespace pdkv
