// Typed options (pdkv/options/*.h, pdkv/config.h): defaults are valid, and every
// out-of-range value is InvalidArgument naming the field and the value.
#include <cmath>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include "pdkv/agent.h"
#include "pdkv/config.h"
#include "pdkv/options/shm.h"
#include "pdkv/options/tcp.h"

namespace pdkv {
namespace {

void expect_invalid(const Status& st, const std::string& field, const std::string& value) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("got " + value), std::string::npos) << st.message();
}

TEST(TcpOptions, DefaultsAreValid) { EXPECT_TRUE(TcpOptions{}.validate().ok()); }

TEST(TcpOptions, BoundsAreInclusive) {
  TcpOptions o;
  o.conns_per_peer = 64;
  o.progress_threads = 64;
  o.batch_extents = 1020;
  o.batch_bytes = 1ull << 30;
  o.stage_chunk_bytes = 4096;
  o.stage_buffers = 2;
  o.frame_timeout_s = 86400;
  o.spin_us = 0;
  o.rcvlowat_bytes = 0;
  EXPECT_TRUE(o.validate().ok()) << o.validate().to_string();
}

TEST(TcpOptions, EachIntegerFieldNamesItselfAndTheValue) {
  struct Case {
    const char* field;
    void (*set)(TcpOptions&);
    const char* value;
  };
  const Case cases[] = {
      {"tcp.conns_per_peer", [](TcpOptions& o) { o.conns_per_peer = 0; }, "0"},
      {"tcp.conns_per_peer", [](TcpOptions& o) { o.conns_per_peer = 65; }, "65"},
      {"tcp.progress_threads", [](TcpOptions& o) { o.progress_threads = 0; }, "0"},
      {"tcp.batch_bytes", [](TcpOptions& o) { o.batch_bytes = 0; }, "0"},
      {"tcp.batch_bytes", [](TcpOptions& o) { o.batch_bytes = (1ull << 30) + 1; }, "1073741825"},
      {"tcp.batch_extents", [](TcpOptions& o) { o.batch_extents = 1021; }, "1021"},
      {"tcp.stage_chunk_bytes", [](TcpOptions& o) { o.stage_chunk_bytes = 4095; }, "4095"},
      {"tcp.stage_buffers", [](TcpOptions& o) { o.stage_buffers = 1; }, "1"},
      {"tcp.stage_buffers", [](TcpOptions& o) { o.stage_buffers = 1025; }, "1025"},
  };
  for (const Case& c : cases) {
    TcpOptions o;
    c.set(o);
    expect_invalid(o.validate(), c.field, c.value);
  }
}

TEST(TcpOptions, TimeoutsMustBeFinitePositiveSeconds) {
  const double bad[] = {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 86400.5};
  const char* shown[] = {"0", "-1", "nan", "inf", "86400.5"};
  for (size_t i = 0; i < std::size(bad); ++i) {
    TcpOptions c, h, f;
    c.connect_timeout_s = bad[i];
    h.handshake_timeout_s = bad[i];
    f.frame_timeout_s = bad[i];
    expect_invalid(c.validate(), "tcp.connect_timeout_s", shown[i]);
    expect_invalid(h.validate(), "tcp.handshake_timeout_s", shown[i]);
    expect_invalid(f.validate(), "tcp.frame_timeout_s", shown[i]);
  }
  TcpOptions fractional;
  fractional.frame_timeout_s = 0.25;
  EXPECT_TRUE(fractional.validate().ok());
}

TEST(TcpOptions, EmptyListenHostIsRejected) {
  TcpOptions o;
  o.listen_host.clear();
  Status st = o.validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tcp.listen_host"), std::string::npos) << st.message();
}

TEST(ShmOptions, CopyThreadsBounds) {
  EXPECT_TRUE(ShmOptions{}.validate().ok());
  ShmOptions o;
  o.inline_bytes = 0;  // every transfer goes to the copy threads: valid
  EXPECT_TRUE(o.validate().ok());
  o.copy_threads = 0;
  expect_invalid(o.validate(), "shm.copy_threads", "0");
  o.copy_threads = 65;
  expect_invalid(o.validate(), "shm.copy_threads", "65");
}

TEST(AgentConfig, ChecksItsOwnFieldsAndEveryTransportsOptions) {
  AgentConfig ok;
  ok.name = "a";
  EXPECT_TRUE(ok.validate().ok());

  AgentConfig c = ok;
  c.default_timeout_s = -1;
  expect_invalid(c.validate(), "default_timeout_s", "-1");
  c = ok;
  c.default_timeout_s = std::nan("");
  expect_invalid(c.validate(), "default_timeout_s", "nan");
  c = ok;
  c.max_notif_bytes = 0;
  expect_invalid(c.validate(), "max_notif_bytes", "0");
  c = ok;
  c.transports.clear();
  EXPECT_EQ(c.validate().code(), StatusCode::kInvalidArgument);
  c = ok;
  c.secret.assign(1025, 's');
  EXPECT_EQ(c.validate().code(), StatusCode::kInvalidArgument);
  // Options of a transport that is not enabled are still checked.
  c = ok;
  c.transports = {"tcp"};
  c.options.edit<ShmOptions>().copy_threads = 0;
  expect_invalid(c.validate(), "shm.copy_threads", "0");
  c = ok;
  c.options.edit<TcpOptions>().conns_per_peer = 0;
  expect_invalid(c.validate(), "tcp.conns_per_peer", "0");
  c = ok;
  c.options.edit<TcpOptions>().gather_below_bytes = (1ull << 30) + 1;
  expect_invalid(c.validate(), "tcp.gather_below_bytes", "1073741825");
  c = ok;
  c.options.edit<ShmOptions>().connect_timeout_s = 0;
  expect_invalid(c.validate(), "shm.connect_timeout_s", "0");
}

TEST(AgentConfig, HoldsOneDeepCopiedOptionsObjectPerTransport) {
  AgentConfig a;
  TcpOptions t;
  t.spin_us = 7;
  a.options.set(t);
  a.options.edit<ShmOptions>().copy_threads = 3;
  TcpOptions t2;
  t2.spin_us = 9;
  a.options.set(t2);  // replaces the tcp options
  ASSERT_EQ(a.options.size(), 2u);
  AgentConfig b = a;  // deep copy
  b.options.edit<TcpOptions>().spin_us = 11;
  EXPECT_EQ(a.options.get<TcpOptions>()->spin_us, 9u);
  EXPECT_EQ(b.options.get<TcpOptions>()->spin_us, 11u);
  EXPECT_EQ(b.options.get<ShmOptions>()->copy_threads, 3u);
  EXPECT_EQ(a.options.find("tcp")->transport(), "tcp");
  EXPECT_EQ(a.options.find("nixl"), nullptr);
  EXPECT_TRUE(b.options.erase("shm"));
  EXPECT_EQ(b.options.get<ShmOptions>(), nullptr);
  EXPECT_TRUE(options_as<TcpOptions>(*a.options.find("tcp")).ok());
  EXPECT_EQ(options_as<ShmOptions>(*a.options.find("tcp")).status().code(), StatusCode::kInvalidArgument);
}

// Options naming a transport that nobody registered.
struct Stray : TransportOptionsOf<Stray> {
  static constexpr std::string_view kTransport = "no-such-transport";
  Status validate() const override { return Status::Ok(); }
};

TEST(AgentConfig, AgentCreateRefusesOptionsOfAnUnknownTransport) {
  AgentConfig c;
  c.name = "opts-stray";
  c.options.set(Stray{});
  auto r = Agent::create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no-such-transport"), std::string::npos) << r.status().message();
}

TEST(AgentConfig, AgentCreateRejectsAnInvalidConfigBeforeStartingTransports) {
  AgentConfig c;
  c.name = "opts-test";
  c.options.edit<TcpOptions>().stage_buffers = 0;
  auto r = Agent::create(c);
  ASSERT_FALSE(r.ok());
  expect_invalid(r.status(), "tcp.stage_buffers", "0");
}

}  // namespace
}  // namespace pdkv
