// Bounds an authenticated peer cannot exceed (issue 26): the notification queue
// refuses before it accepts, and the tcp admission counts free their slots.
#include <gtest/gtest.h>

#include <string>

#include "pdkv/notify.h"
#include "transport/tcp/admission.h"

namespace pdkv {
namespace {

TEST(NotifQueue, RefusesByCountBeforeAccepting) {
  NotifQueue q;
  q.set_limits(2, 0);
  ASSERT_TRUE(q.push({"p", "a"}).ok());
  ASSERT_TRUE(q.push({"p", "b"}).ok());
  Status full = q.push({"p", "c"});
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("max_queued_notifs 2"), std::string::npos);
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(q.refused(), 1u);
  EXPECT_EQ(q.take(1).at(0).data, "a");  // nothing accepted was dropped, in order
  EXPECT_TRUE(q.push({"p", "c"}).ok());
  auto rest = q.take();
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].data, "b");
  EXPECT_EQ(rest[1].data, "c");
}

TEST(NotifQueue, RefusesByBytesButAnEmptyQueueTakesAnyOne) {
  NotifQueue q;
  q.set_limits(0, 10);
  ASSERT_TRUE(q.push({"p", std::string(100, 'x')}).ok());  // larger than the bound, queue empty
  EXPECT_EQ(q.bytes(), 101u);
  EXPECT_EQ(q.push({"p", "y"}).code(), StatusCode::kResourceExhausted);
  q.take();
  EXPECT_EQ(q.bytes(), 0u);
  ASSERT_TRUE(q.push({"p", "12345678"}).ok());  // 9 bytes
  EXPECT_EQ(q.push({"p", "1"}).code(), StatusCode::kResourceExhausted);  // 9 + 2 > 10
  EXPECT_TRUE(q.push({"", "1"}).ok());  // 9 + 1 = 10
}

TEST(TcpAdmission, PerPeerAndTotalSlotsAreFreedWithTheirTickets) {
  tcp::Admission a(2, 1);
  uint32_t open = 0;
  auto t1 = a.accept(&open);
  auto t2 = a.accept(&open);
  ASSERT_TRUE(t1 && t2);
  EXPECT_FALSE(a.accept(&open));
  EXPECT_EQ(open, 2u);
  t1.reset();
  EXPECT_TRUE(a.accept(&open));

  auto p1 = a.admit("alice");
  ASSERT_TRUE(p1.ok());
  auto p2 = a.admit("alice");
  ASSERT_FALSE(p2.ok());
  EXPECT_EQ(p2.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(p2.status().message().find("'alice'"), std::string::npos);
  EXPECT_NE(p2.status().message().find("max_inbound_per_peer"), std::string::npos);
  EXPECT_TRUE(a.admit("bob").ok());  // (its ticket is dropped at once: the slot is free again)
  (*p1).reset();
  EXPECT_TRUE(a.admit("alice").ok());
}

}  // namespace
}  // namespace pdkv
