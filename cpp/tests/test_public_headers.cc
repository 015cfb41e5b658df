// The user-facing C++ API: a translation unit that includes every public header and
// nothing from pdkv/spi/ (PublicHeaders.IncludeNoSpi, check_public_headers.cmake,
// checks that no public header pulls one in). Here: what users can and cannot do with
// the types those headers give them.
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <gtest/gtest.h>

#include "pdkv/agent.h"
#include "pdkv/config.h"
#include "pdkv/kv_layout.h"
#include "pdkv/metadata.h"
#include "pdkv/notify.h"
#include "pdkv/options/shm.h"
#include "pdkv/options/tcp.h"
#include "pdkv/region.h"
#include "pdkv/status.h"
#include "pdkv/transfer.h"
#include "pdkv/types.h"

namespace pdkv {
namespace {

// Each detector is true when a user can call that member (SFINAE respects access).
template <class T, class = void> struct CanWait : std::false_type {};
template <class T> struct CanWait<T, std::void_t<decltype(std::declval<const T&>().wait(1.0))>> : std::true_type {};
template <class T, class = void> struct CanCancel : std::false_type {};
template <class T> struct CanCancel<T, std::void_t<decltype(std::declval<T&>().cancel())>> : std::true_type {};
template <class T, class = void> struct CanSetParts : std::false_type {};
template <class T> struct CanSetParts<T, std::void_t<decltype(std::declval<T&>().set_parts(1u))>> : std::true_type {};
template <class T, class = void> struct CanResolvePart : std::false_type {};
template <class T>
struct CanResolvePart<T, std::void_t<decltype(std::declval<T&>().resolve_part(0, Status::Ok()))>> : std::true_type {};
template <class T, class = void> struct CanFailNow : std::false_type {};
template <class T> struct CanFailNow<T, std::void_t<decltype(std::declval<T&>().fail_now(Status::Ok()))>> : std::true_type {};
template <class T, class = void> struct CanSetCancelHook : std::false_type {};
template <class T>
struct CanSetCancelHook<T, std::void_t<decltype(std::declval<T&>().set_cancel_hook(nullptr))>> : std::true_type {};
template <class T, class = void> struct CanSetDriver : std::false_type {};
template <class T> struct CanSetDriver<T, std::void_t<decltype(std::declval<T&>().set_driver(nullptr))>> : std::true_type {};
template <class T, class = void> struct CanOnTerminal : std::false_type {};
template <class T> struct CanOnTerminal<T, std::void_t<decltype(std::declval<T&>().on_terminal(nullptr))>> : std::true_type {};
template <class T, class = void> struct CanAskCancelRequested : std::false_type {};
template <class T>
struct CanAskCancelRequested<T, std::void_t<decltype(std::declval<const T&>().cancel_requested())>> : std::true_type {};

// Users observe, wait and cancel...
static_assert(CanWait<Transfer>::value && CanCancel<Transfer>::value, "the detectors must see public members");
// ...and never complete a transfer: that is the transport's side (spi::TransferControl).
static_assert(!CanSetParts<Transfer>::value, "Transfer::set_parts is for transports (spi/transfer_control.h)");
static_assert(!CanResolvePart<Transfer>::value, "Transfer::resolve_part is for transports");
static_assert(!CanFailNow<Transfer>::value, "Transfer::fail_now is for transports");
static_assert(!CanSetCancelHook<Transfer>::value, "Transfer::set_cancel_hook is for transports");
static_assert(!CanSetDriver<Transfer>::value, "Transfer::set_driver is for transports");
static_assert(!CanOnTerminal<Transfer>::value, "Transfer::on_terminal is for transports and the bindings");
static_assert(!CanAskCancelRequested<Transfer>::value, "Transfer::cancel_requested is for transports");

// Agent is a pImpl: its state and its AgentHooks implementation live in agent.cc.
static_assert(sizeof(Agent) == sizeof(void*), "Agent holds only its Impl pointer");

TEST(PublicHeaders, UserSeesTransferStateWithoutTheTransportSide) {
  auto x = std::make_shared<Transfer>(7, OpKind::kRead, "peer-a", "tcp", 64, Clock::time_point::max(), 0);
  EXPECT_EQ(x->id(), 7u);
  EXPECT_EQ(x->op(), OpKind::kRead);
  EXPECT_EQ(x->peer(), "peer-a");
  EXPECT_EQ(x->transport(), "tcp");
  EXPECT_EQ(x->bytes_total(), 64u);
  EXPECT_EQ(x->bytes_done(), 0u);
  EXPECT_EQ(x->state(), XferState::kPending);
  EXPECT_FALSE(x->terminal());
  EXPECT_TRUE(x->error().ok());
  EXPECT_EQ(x->wait(0.0), XferState::kPending);
}

TEST(PublicHeaders, AgentWorksThroughItsPublicApiAlone) {
  AgentConfig cfg;
  cfg.name = "public-headers";
  cfg.transports = {"tcp"};
  auto a = Agent::create(cfg);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  Agent& agent = **a;
  EXPECT_EQ(agent.name(), "public-headers");
  EXPECT_FALSE(agent.secret().empty());
  EXPECT_EQ(agent.secret().size(), 32u);  // a random 128-bit secret, hex
  EXPECT_NE(agent.instance_id(), 0u);
  EXPECT_EQ(agent.transports(), std::vector<std::string>{"tcp"});
  std::vector<char> mem(4096);
  auto r = agent.register_memory(reinterpret_cast<uint64_t>(mem.data()), mem.size(), MemKind::kHost, -1, true);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(agent.regions().size(), 1u);
  auto md = decode_metadata(agent.metadata());
  ASSERT_TRUE(md.ok()) << md.status().to_string();
  EXPECT_EQ(md->name, "public-headers");
  EXPECT_EQ(md->regions.size(), 1u);
  EXPECT_EQ(agent.peer("nobody").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(agent.deregister_memory(r->id).ok());
  EXPECT_TRUE(agent.regions().empty());
}

}  // namespace
}  // namespace pdkv
