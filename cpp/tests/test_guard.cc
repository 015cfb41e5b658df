// The tcp listener's authentication back-off keyed on (source address, claimed agent
// name) (transport/tcp/guard.h): a peer with the wrong secret backs off alone, a good
// peer on the same address is not refused, and rotating names does not reopen brute
// force (beyond names_per_source the whole address backs off).
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "transport/tcp/guard.h"

namespace pdkv::tcp {
namespace {

constexpr char kHost[] = "127.0.0.1";
using std::chrono::milliseconds;

TEST(TcpGuardNames, AWrongSecretBacksOffOnlyItsOwnName) {
  AuthBackoff b(0.1, 10.0, 64, 1, 4);
  const auto t0 = GuardClock::now();
  EXPECT_EQ(b.failed(kHost, "prefill-bad", t0), 0.0);  // the free one
  EXPECT_DOUBLE_EQ(b.failed(kHost, "prefill-bad", t0), 0.1);
  EXPECT_DOUBLE_EQ(b.failed(kHost, "prefill-bad", t0), 0.2);
  EXPECT_GT(b.wait_s(kHost, "prefill-bad", t0), 0.19);
  EXPECT_EQ(b.wait_s(kHost, "prefill-good", t0), 0.0);  // same host, another agent: at once
  EXPECT_EQ(b.wait_s("10.0.0.9", "prefill-bad", t0), 0.0);  // the name elsewhere: unaffected
  b.succeeded(kHost, "prefill-good");
  EXPECT_GT(b.wait_s(kHost, "prefill-bad", t0), 0.19);  // a success clears only its own name
  EXPECT_EQ(b.names(kHost), 1u);
  b.succeeded(kHost, "prefill-bad");  // the operator fixed the secret
  EXPECT_EQ(b.wait_s(kHost, "prefill-bad", t0), 0.0);
  EXPECT_EQ(b.size(), 0u);
}

TEST(TcpGuardNames, NamesBeyondTheBoundBackOffTheWholeAddress) {
  AuthBackoff b(0.1, 10.0, 64, 1, 4);
  const auto t0 = GuardClock::now();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.failed(kHost, "guess-" + std::to_string(i), t0), 0.0);
  EXPECT_EQ(b.names(kHost), 4u);
  EXPECT_EQ(b.wait_s(kHost, "anyone", t0), 0.0);
  // A fifth name is not tracked: charged to the address, no free failure there.
  EXPECT_DOUBLE_EQ(b.failed(kHost, "guess-4", t0), 0.1);
  EXPECT_EQ(b.names(kHost), 4u);
  EXPECT_GT(b.wait_s(kHost, "anyone", t0), 0.09);
  EXPECT_DOUBLE_EQ(b.failed(kHost, "guess-5", t0), 0.2);
  b.succeeded(kHost, "good");  // a success elsewhere on the address forgives nothing
  EXPECT_GT(b.wait_s(kHost, "good", t0), 0.19);
  EXPECT_EQ(b.wait_s("10.0.0.9", "good", t0), 0.0);
}

TEST(TcpGuardNames, QuietNamesAreForgottenToMakeRoom) {
  AuthBackoff b(0.1, 1.0, 64, 0, 2);
  const auto t0 = GuardClock::now();
  EXPECT_DOUBLE_EQ(b.failed(kHost, "a", t0), 0.1);
  EXPECT_DOUBLE_EQ(b.failed(kHost, "b", t0), 0.1);
  // Quiet for more than 2 * max_s after their windows: "c" takes a slot of its own.
  const auto later = t0 + std::chrono::seconds(3);
  EXPECT_DOUBLE_EQ(b.failed(kHost, "c", later), 0.1);
  EXPECT_EQ(b.wait_s(kHost, "d", later), 0.0);  // the address as a whole was never charged
  EXPECT_LE(b.names(kHost), 2u);
}

// How many hellos a guesser gets judged (secret compared) in `seconds`, trying every
// millisecond, under one name or a fresh name each time.
int judged(AuthBackoff& b, bool rotate, int seconds) {
  const auto t0 = GuardClock::now();
  int n = 0;
  for (int ms = 0; ms < seconds * 1000; ++ms) {
    const auto now = t0 + milliseconds(ms);
    const std::string name = rotate ? "guess-" + std::to_string(ms) : "guess";
    if (b.wait_s(kHost, name, now) > 0) continue;
    b.failed(kHost, name, now);
    ++n;
  }
  return n;
}

TEST(TcpGuardNames, RotatingNamesGetsAtMostNamesPlusOneTimesTheGuesses) {
  AuthBackoff one(0.1, 10.0, 64, 1, 4), many(0.1, 10.0, 64, 1, 4);
  const int single = judged(one, false, 120);
  const int rotating = judged(many, true, 120);
  EXPECT_GT(single, 5);
  EXPECT_LT(single, 30);  // 0.1, 0.2, ... then one per 10 s
  EXPECT_LE(rotating, 5 * single);
}

TEST(TcpGuardNames, TheTableOfAddressesStaysBounded) {
  AuthBackoff b(0.1, 1.0, 8, 0, 4);
  const auto t0 = GuardClock::now();
  for (int i = 0; i < 1000; ++i) {
    b.failed("10.0.0." + std::to_string(i), "n" + std::to_string(i % 7), t0 + milliseconds(i));
  }
  EXPECT_LE(b.size(), 8u);
  EXPECT_GT(b.wait_s("10.0.0.999", "n5", t0 + milliseconds(999)), 0.0);  // the newest is kept
}

}  // namespace
}  // namespace pdkv::tcp
