// Two-level runs on tcp's wire (kFlagStrided2, docs/wire.md): the run walkers of
// transport/tcp/scatter.h resume at every byte boundary of small two-level shapes
// (both nesting orders: repetitions after each other, and repetitions interleaved in
// the inner gaps), against the pieces listed by brute force; make_run folds what
// touches; the receiver's checks (wire.h check_strided2_extents, check_header) take
// well-formed descriptors and name every violation.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "transport/tcp/wire.h"
#include "transport/tcp/scatter.h"

namespace pdkv::tcp {
namespace {

constexpr char kGuard = '\x5a';

// Offsets of every piece of a two-level shape, repetition by repetition (the order
// the payload carries them), computed without the code under test.
std::vector<uint64_t> piece_offsets(uint64_t count, uint64_t stride, uint64_t count2, uint64_t stride2) {
  std::vector<uint64_t> out;
  for (uint64_t j = 0; j < count2; ++j)
    for (uint64_t i = 0; i < count; ++i) out.push_back(j * stride2 + i * stride);
  return out;
}

std::vector<char> random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> out(n);
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

struct Shape {
  uint64_t len, count, stride, count2, stride2;
};

// Small shapes of both nesting orders, with folds and odd lengths.
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {
      {3, 4, 5, 3, 32},    // repetitions after each other (stride2 >= inner span)
      {4, 3, 16, 3, 5},    // repetitions in the inner gaps (stride >= outer span: NHD <-> HND)
      {2, 1, 0, 5, 3},     // one piece per repetition: a one-level run
      {5, 2, 5, 3, 17},    // inner pieces touch: one 10-byte piece per repetition
      {1, 7, 2, 2, 1},     // interleaved single bytes: pieces 0,2,..,12 then 1,3,..,13
      {6, 2, 9, 1, 0},     // one repetition
  };
  return s;
}

// A pool holding one two-level run at offset 8, guard bytes everywhere else.
struct Pool {
  Shape sh;
  std::vector<char> mem;
  PieceRun run;
  std::vector<uint64_t> offs;
  Pool(const Shape& s) : sh(s) {
    offs = piece_offsets(s.count, s.stride, s.count2, s.stride2);
    uint64_t end = 0;
    for (uint64_t o : offs) end = std::max(end, o + s.len);
    mem.assign(end + 16, kGuard);
    run = make_run(mem.data() + 8, s.len, s.count, s.stride, s.count2, s.stride2);
  }
  uint64_t bytes() const { return offs.size() * sh.len; }
  std::vector<char> joined() const {
    std::vector<char> out;
    for (uint64_t o : offs) out.insert(out.end(), mem.begin() + 8 + o, mem.begin() + 8 + o + sh.len);
    return out;
  }
  bool guards_intact() const {
    std::vector<bool> in(mem.size(), false);
    for (uint64_t o : offs)
      for (uint64_t k = 0; k < sh.len; ++k) in[8 + o + k] = true;
    for (size_t k = 0; k < mem.size(); ++k)
      if (!in[k] && mem[k] != kGuard) return false;
    return true;
  }
};

TEST(TcpTwoLevel, ScatterResumesAtEveryByteBoundary) {
  for (const Shape& s : shapes()) {
    SCOPED_TRACE(std::to_string(s.len) + "x" + std::to_string(s.count) + "@" + std::to_string(s.stride) + " x" +
                 std::to_string(s.count2) + "@" + std::to_string(s.stride2));
    const uint64_t total = Pool(s).bytes();
    const auto src = random_bytes(total, static_cast<uint32_t>(total));
    for (uint64_t cut = 0; cut <= total; ++cut) {       // first chunk ends at every byte
      for (uint64_t chunk : {uint64_t(1), uint64_t(3), total}) {  // then the rest in chunks of this size
        Pool p(s);
        RunCursor cur;
        scatter_to_runs(&p.run, 1, cur, src.data(), cut);
        for (uint64_t at = cut; at < total; at += chunk)
          scatter_to_runs(&p.run, 1, cur, src.data() + at, std::min(chunk, total - at));
        ASSERT_EQ(cur.idx, 1u) << cut;
        ASSERT_EQ(p.joined(), src) << cut;
        ASSERT_TRUE(p.guards_intact()) << cut;
      }
    }
  }
}

TEST(TcpTwoLevel, GatherResumesAtEveryByteBoundary) {
  for (const Shape& s : shapes()) {
    Pool p(s);
    const auto want = random_bytes(p.bytes(), 7);
    {
      RunCursor cur;
      scatter_to_runs(&p.run, 1, cur, want.data(), want.size());
    }
    for (uint64_t cap = 1; cap <= p.bytes() + 1; ++cap) {
      std::vector<char> got, buf(cap);
      RunCursor cur;
      for (;;) {
        const size_t n = gather_from_runs(&p.run, 1, cur, buf.data(), cap);
        got.insert(got.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
        if (n < cap) break;
      }
      ASSERT_EQ(got, want) << cap;
      ASSERT_EQ(gather_from_runs(&p.run, 1, cur, buf.data(), cap), 0u);
    }
  }
}

TEST(TcpTwoLevel, SeveralRunsOneAfterAnotherAndListing) {
  // Every shape in its own pool, walked as one list in chunks of 5 bytes.
  std::vector<Pool> pools;
  for (const Shape& s : shapes()) pools.emplace_back(s);
  std::vector<PieceRun> runs;
  uint64_t total = 0;
  for (Pool& p : pools) {
    p.run = make_run(p.mem.data() + 8, p.sh.len, p.sh.count, p.sh.stride, p.sh.count2, p.sh.stride2);
    runs.push_back(p.run);
    total += p.bytes();
  }
  const auto src = random_bytes(total, 5);
  RunCursor cur;
  for (uint64_t at = 0; at < total; at += 5)
    scatter_to_runs(runs.data(), runs.size(), cur, src.data() + at, std::min<uint64_t>(5, total - at));
  EXPECT_EQ(cur.idx, runs.size());
  std::vector<char> all;
  for (const Pool& p : pools) {
    const auto j = p.joined();
    all.insert(all.end(), j.begin(), j.end());
    EXPECT_TRUE(p.guards_intact());
  }
  EXPECT_EQ(all, src);
  // The listing gives the same pieces' bytes in the same order.
  std::vector<iovec> iov;
  append_iovecs(runs.data(), runs.size(), iov);
  std::vector<char> listed;
  for (const iovec& v : iov)
    listed.insert(listed.end(), static_cast<char*>(v.iov_base), static_cast<char*>(v.iov_base) + v.iov_len);
  EXPECT_EQ(listed, src);
  uint64_t extents = 0;
  for (const PieceRun& r : runs) extents += r.extents();
  EXPECT_EQ(iov.size(), extents);
}

TEST(TcpTwoLevel, MakeRunFoldsWhatTouches) {
  char* b = reinterpret_cast<char*>(uintptr_t(4096));
  PieceRun r = make_run(b, 5, 2, 5, 3, 17);  // inner pieces touch: 10-byte pieces, 3 of them
  EXPECT_EQ(r.len, 10u);
  EXPECT_EQ(r.count, 3u);
  EXPECT_EQ(r.stride, 17u);
  EXPECT_EQ(r.count2, 1u);
  r = make_run(b, 4, 1, 0, 6, 4);  // repetitions touch too: one plain extent
  EXPECT_EQ(r.len, 24u);
  EXPECT_EQ(r.count, 1u);
  EXPECT_EQ(r.count2, 1u);
  EXPECT_EQ(r.extents(), 1u);
  r = make_run(b, 4, 3, 16, 3, 5);  // stays two-level
  EXPECT_EQ(r.count, 3u);
  EXPECT_EQ(r.count2, 3u);
  EXPECT_EQ(r.pieces(), 9u);
  EXPECT_EQ(r.bytes(), 36u);
  EXPECT_EQ(r.extents(), 9u);
}

FrameHeader write_hdr(uint64_t payload, uint32_t count) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(FrameType::kWrite);
  h.flags = kFlagStrided2;
  h.count = count;
  h.payload = payload;
  return h;
}

Status check_one(const WireStrided2Extent& e, uint64_t payload) {
  auto r = check_strided2_extents(&e, 1, write_hdr(payload, 1));
  return r.ok() ? Status::Ok() : r.status();
}

TEST(TcpTwoLevelFrame, WellFormedDescriptorsPass) {
  const WireStrided2Extent ext[] = {
      {1, 0, 4, 3, 16, 3, 5},       // interleaved
      {1, 100, 3, 4, 5, 3, 32},     // after each other
      {1, 900, 8, 1, 0, 1, 0},      // a plain extent in the two-level form
      {1, 1000, 2, 1, 0, 5, 3},     // one piece per repetition
  };
  auto r = check_strided2_extents(ext, 4, write_hdr(36 + 36 + 8 + 10, 4));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, 36u + 36 + 8 + 10);
  EXPECT_EQ(strided2_span(ext[0]), 2u * 16 + 2 * 5 + 4);
}

TEST(TcpTwoLevelFrame, EveryViolationIsNamed) {
  struct Case {
    WireStrided2Extent e;
    uint64_t payload;
    const char* message;
  };
  const uint64_t big = uint64_t(1) << 40;
  const Case cases[] = {
      {{1, 0, 0, 2, 8, 2, 64}, 0, "length 0"},
      {{1, 0, 4, 0, 8, 2, 64}, 0, "count 0"},
      {{1, 0, 4, 2, 8, 0, 64}, 0, "count2 0"},
      {{1, 0, 4, 4, 8, 2, 16}, 32, "overlap"},          // repetition 1 lands on piece 2 of repetition 0
      {{1, 0, 8, 2, 4, 2, 64}, 32, "overlap"},          // inner pieces overlap
      {{1, 0, 4, 2, 64, 3, 2}, 24, "overlap"},          // repetitions 2 bytes apart, pieces 4 bytes
      {{1, 0, 1, 2, 1, 1 << 17, uint64_t(1) << 50}, 1 << 18, "overflows"},  // (count2 - 1) * stride2 wraps u64
      {{1, 0, 1, 1 << 10, 1, 1 << 9, 1 << 10}, 1 << 19, "pieces exceed"},
      {{1, 0, 1, big, 1, big, 1}, 0, "pieces exceed"},  // count x count2 wraps u64
      {{1, 0, 4, 2, 8, 2, 64}, 15, "add up to 16"},    // payload mismatch
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    Status st = check_one(c.e, c.payload);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kProtocolError);
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st.message();
  }
}

TEST(TcpTwoLevelFrame, HeaderTakesFlag32AloneOnDataFrames) {
  const ConnState in{ConnRole::kInbound, ConnPhase::kOpen};
  FrameHeader h = write_hdr(16, 1);
  EXPECT_TRUE(check_header(h, in, FrameLimits{}).ok());
  EXPECT_EQ(desc_bytes(h), sizeof(WireStrided2Extent));
  EXPECT_EQ(control_bytes(h), 56u);
  h.flags = kFlagStrided | kFlagStrided2;
  Status st = check_header(h, in, FrameLimits{});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("both strided flags"), std::string::npos) << st.message();
  h.flags = kFlagStrided2;
  h.type = static_cast<uint16_t>(FrameType::kReadReq);
  h.payload = 0;
  EXPECT_TRUE(check_header(h, in, FrameLimits{}).ok());
  h.type = static_cast<uint16_t>(FrameType::kNotify);
  h.count = 0;
  EXPECT_FALSE(check_header(h, in, FrameLimits{}).ok());  // unknown flag on a notification
}

}  // namespace
}  // namespace pdkv::tcp
