// auto compression's link measurement (transport/tcp/compress.h, LinkChooser): the
// link rate is the bytes delivered over the time the link was busy, so transfers in
// flight together (a layer-wise stream's batches, concurrent requests) do not each
// count the others' bytes as their own time (found: a stream on a 0.0125 GB/s link
// logged 0.004 GB/s, which made compression look better than it is).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

#include "transport/tcp/compress.h"

namespace pdkv::tcp {
namespace {

constexpr uint64_t kMiB = 1 << 20;

Clock::time_point at(double s) {
  return Clock::time_point{} + std::chrono::hours(1) +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

TEST(LinkChooser, OneTransferAtATimeIsPostToDelivery) {
  LinkChooser c("peer");
  c.plain_delivered(4 * kMiB, at(0), at(2));
  EXPECT_NEAR(c.link_bps(), 2.0 * kMiB, 1.0);
}

TEST(LinkChooser, TransfersInFlightTogetherShareTheLink) {
  // Four 1 MiB batches posted at once on a 1 MiB/s link arrive at 1, 2, 3, 4 s: each
  // took 1-4 s from its post, yet the link carried 1 MiB/s all along.
  LinkChooser c("peer");
  for (int k = 1; k <= 4; ++k) c.plain_delivered(kMiB, at(0), at(k));
  EXPECT_NEAR(c.link_bps(), 1.0 * kMiB, 1.0);
}

TEST(LinkChooser, IdleTimeBetweenTransfersIsNotLinkTime) {
  LinkChooser c("peer");
  c.plain_delivered(kMiB, at(0), at(1));
  c.plain_delivered(kMiB, at(10), at(11));  // posted after 9 s of idle link
  EXPECT_NEAR(c.link_bps(), 1.0 * kMiB, 1.0);
}

TEST(LinkChooser, SmallOverlappingBatchesAddUpToASample) {
  // A stream's 256 KiB batches posted back to back on a 1 MiB/s link.
  LinkChooser c("peer");
  for (int k = 1; k <= 8; ++k) c.plain_delivered(kMiB / 4, at(0.25 * (k - 1) - 0.1), at(0.25 * k));
  EXPECT_NEAR(c.link_bps(), 1.0 * kMiB, kMiB * 0.02);
}

TEST(LinkChooser, ASmallTransferAloneIsNotAMeasurement) {
  LinkChooser c("peer");
  c.plain_delivered(64 << 10, at(0), at(1));  // latency-bound: says nothing of the link
  EXPECT_EQ(c.link_bps(), 0.0);
}

TEST(LinkChooser, OutOfOrderDeliveriesCountTheBusyTimeOnce) {
  LinkChooser c("peer");
  c.plain_delivered(kMiB, at(0), at(1));  // of two posted at 0, the later-posted arrives first
  c.plain_delivered(kMiB, at(0), at(2));
  EXPECT_NEAR(c.link_bps(), 1.0 * kMiB, 1.0);
}

}  // namespace
}  // namespace pdkv::tcp
