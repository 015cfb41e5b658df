// Codec round trips (bit-exact lossless, FP8 rounding rules) and hostile frames.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "codec/float_bits.h"
#include "codec/fp8.h"
#include "pdkv/codec.h"

namespace pdkv {
namespace {

std::unique_ptr<Codec> make(CodecKind kind, bool checksum = false, Fp8Grouping g = {}) {
  CodecOptions o;
  o.kind = kind;
  o.checksum = checksum;
  o.fp8 = g;
  auto c = Codec::create(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(c).value() : nullptr;
}

// KV-like bf16: a narrow range of exponents (what makes the high plane compress).
std::vector<uint8_t> kv_like_bf16(size_t elems, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::vector<uint8_t> out(elems * 2);
  for (size_t i = 0; i < elems; ++i) {
    const uint16_t h = codec::float_to_bf16(dist(rng));
    std::memcpy(&out[i * 2], &h, 2);
  }
  return out;
}

std::vector<CodecKind> lossless_kinds() {
  std::vector<CodecKind> ks{CodecKind::kRaw};
  for (CodecKind k : {CodecKind::kZstd, CodecKind::kLz4})
    if (codec_available(k)) ks.push_back(k);
  return ks;
}

TEST(Codec, LosslessRoundTripIsBitExactForOddLengths) {
  const auto kv = kv_like_bf16(5000, 1);
  for (CodecKind k : lossless_kinds()) {
    auto c = make(k, checksum_available());
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32, DType::kU8, DType::kF64}) {
      for (size_t len : {size_t(0), size_t(1), size_t(3), size_t(7), size_t(4099), kv.size()}) {
        std::vector<uint8_t> frame;
        ASSERT_TRUE(c->encode(kv.data(), len, dt, frame).ok());
        ASSERT_LE(frame.size(), c->max_frame_size(len, dt));
        std::vector<uint8_t> back(len + 1, 0xAB);
        size_t written = 0;
        Status st = c->decode(frame.data(), frame.size(), dt, back.data(), len, &written);
        ASSERT_TRUE(st.ok()) << codec_kind_name(k) << " " << st.to_string();
        ASSERT_EQ(written, len);
        EXPECT_EQ(0, std::memcmp(back.data(), kv.data(), len)) << codec_kind_name(k) << " len " << len;
        EXPECT_EQ(back[len], 0xAB);  // nothing written past the destination
      }
    }
  }
}

TEST(Codec, LosslessCompressesKvLikeDataAndNeverExpandsRandomBytes) {
  if (!codec_available(CodecKind::kZstd)) GTEST_SKIP() << "zstd not built";
  auto c = make(CodecKind::kZstd);
  const auto kv = kv_like_bf16(1 << 16, 2);
  std::vector<uint8_t> frame;
  ASSERT_TRUE(c->encode(kv.data(), kv.size(), DType::kBF16, frame).ok());
  EXPECT_LT(frame.size(), kv.size() * 9 / 10);
  std::mt19937 rng(3);
  std::vector<uint8_t> noise(1 << 16);
  for (auto& b : noise) b = uint8_t(rng());
  ASSERT_TRUE(c->encode(noise.data(), noise.size(), DType::kBF16, frame).ok());
  EXPECT_EQ(frame.size(), noise.size() + kCodecHeaderBytes);
  EXPECT_EQ(peek_frame(frame.data(), frame.size())->kind, CodecKind::kRaw);
}

TEST(Codec, E4m3RoundingIsNearestEvenAndSaturating) {
  using codec::e4m3_to_float;
  using codec::float_to_e4m3;
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(-1.0f), 0xB8);
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(float_to_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);     // smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);    // half of it: tie to even (0)
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);    // 1.5 units: tie to even (2)
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);                  // halfway 1 .. 1.125: even (1)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);                  // halfway 1.125 .. 1.25: even (1.25)
  // Every finite code round-trips exactly.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(uint8_t(c))), c) << c;
  }
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
}

TEST(Codec, Fp8RoundTripIsWithinHalfAStepOfEachGroupsScale) {
  const size_t heads = 3, dim = 8, tokens = 20;
  Fp8Grouping g{uint32_t(heads), uint32_t(dim), 16};
  auto c = make(CodecKind::kFp8, checksum_available(), g);
  std::mt19937 rng(4);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(tokens * heads * dim);
  for (size_t i = 0; i < x.size(); ++i) x[i] = dist(rng) * float(1 + (i / dim) % heads * 100);  // heads differ
  std::vector<uint8_t> frame;
  ASSERT_TRUE(c->encode(reinterpret_cast<uint8_t*>(x.data()), x.size() * 4, DType::kF32, frame).ok());
  for (DType dst : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<uint8_t> out(x.size() * dtype_size(dst));
    size_t written = 0;
    ASSERT_TRUE(c->decode(frame.data(), frame.size(), dst, out.data(), out.size(), &written).ok());
    ASSERT_EQ(written, out.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float y;
      if (dst == DType::kF32) std::memcpy(&y, &out[i * 4], 4);
      else {
        uint16_t h;
        std::memcpy(&h, &out[i * 2], 2);
        y = dst == DType::kBF16 ? codec::bf16_to_float(h) : codec::fp16_to_float(h);
      }
      const float head_scale = float(1 + (i / dim) % heads * 100);
      // e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the output rounding;
      // small values are bounded by the group's subnormal step (amax / 448 * 2^-9).
      EXPECT_NEAR(y, x[i], std::fabs(x[i]) * 0.07f + head_scale * 5.0f / 448.0f / 512.0f * 8.0f) << i;
    }
  }
}

TEST(Codec, Fp8NonFiniteValues) {
  auto c = make(CodecKind::kFp8, false, Fp8Grouping{1, 4, 1});
  const float x[4] = {NAN, INFINITY, -INFINITY, 2.0f};
  std::vector<uint8_t> frame;
  ASSERT_TRUE(c->encode(reinterpret_cast<const uint8_t*>(x), sizeof x, DType::kF32, frame).ok());
  float y[4];
  size_t written = 0;
  ASSERT_TRUE(c->decode(frame.data(), frame.size(), DType::kF32, reinterpret_cast<uint8_t*>(y), sizeof y, &written).ok());
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_FLOAT_EQ(y[1], 2.0f);  // +Inf saturates to the group's max (448 * scale = amax of finite values)
  EXPECT_FLOAT_EQ(y[2], -2.0f);
  EXPECT_FLOAT_EQ(y[3], 2.0f);
}

TEST(Codec, Fp8RejectsPartialRowsAndIntegerInput) {
  auto c = make(CodecKind::kFp8, false, Fp8Grouping{2, 4, 1});
  std::vector<uint8_t> src(64), frame;
  EXPECT_EQ(c->encode(src.data(), 6 * 4, DType::kF32, frame).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->encode(src.data(), 8, DType::kI32, frame).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->encode(src.data(), 3, DType::kF16, frame).code(), StatusCode::kInvalidArgument);
}

class CodecFrames : public ::testing::Test {
 protected:
  void SetUp() override {
    kind_ = codec_available(CodecKind::kZstd) ? CodecKind::kZstd : CodecKind::kRaw;
    c_ = make(kind_, checksum_available());
    data_ = kv_like_bf16(4096, 5);
    ASSERT_TRUE(c_->encode(data_.data(), data_.size(), DType::kBF16, frame_).ok());
    out_.resize(data_.size());
  }
  Status decode(const std::vector<uint8_t>& f) {
    size_t w = 0;
    return c_->decode(f.data(), f.size(), DType::kBF16, out_.data(), out_.size(), &w);
  }
  CodecKind kind_;
  std::unique_ptr<Codec> c_;
  std::vector<uint8_t> data_, frame_, out_;
};

TEST_F(CodecFrames, EveryTruncationIsAProtocolError) {
  for (size_t n = 0; n < frame_.size(); n += (n < 64 ? 1 : 97)) {
    std::vector<uint8_t> f(frame_.begin(), frame_.begin() + long(n));
    EXPECT_EQ(decode(f).code(), StatusCode::kProtocolError) << n;
  }
}

TEST_F(CodecFrames, HeaderFieldsAreChecked) {
  auto with = [&](size_t off, uint8_t v) {
    auto f = frame_;
    f[off] = v;
    return decode(f);
  };
  EXPECT_EQ(with(0, 'X').code(), StatusCode::kProtocolError);      // magic
  EXPECT_EQ(with(4, 9).code(), StatusCode::kVersionMismatch);      // version
  EXPECT_EQ(with(5, 77).code(), StatusCode::kProtocolError);       // codec
  EXPECT_EQ(with(6, 200).code(), StatusCode::kProtocolError);      // dtype
  EXPECT_EQ(with(7, 0x80).code(), StatusCode::kProtocolError);     // flags
  EXPECT_EQ(with(15, 0x7F).code(), StatusCode::kProtocolError);    // raw_len huge
  EXPECT_EQ(with(23, 0x7F).code(), StatusCode::kProtocolError);    // payload_len huge
  EXPECT_EQ(with(36, 1).code(), StatusCode::kProtocolError);       // reserved
  std::vector<uint8_t> small(10);
  size_t w = 0;
  EXPECT_EQ(c_->decode(frame_.data(), frame_.size(), DType::kBF16, small.data(), small.size(), &w).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(c_->decode(frame_.data(), frame_.size(), DType::kF16, out_.data(), out_.size(), &w).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(CodecFrames, FlippedPayloadBitIsDetected) {
  if (!checksum_available()) GTEST_SKIP() << "xxHash not built";
  for (size_t off : {kCodecHeaderBytes, frame_.size() / 2, frame_.size() - 1}) {
    auto f = frame_;
    f[off] ^= 0x10;
    const StatusCode code = decode(f).code();
    // A flipped compressed bit either breaks the zstd stream (ProtocolError) or decodes
    // to other bytes (DataCorrupted); it never passes.
    EXPECT_TRUE(code == StatusCode::kDataCorrupted || code == StatusCode::kProtocolError) << off;
  }
  auto f = frame_;
  f[40] ^= 1;  // the checksum itself
  EXPECT_EQ(decode(f).code(), StatusCode::kDataCorrupted);
}

TEST(Codec, MissingLibraryIsNotSupported) {
  for (CodecKind k : {CodecKind::kZstd, CodecKind::kLz4}) {
    CodecOptions o;
    o.kind = k;
    auto c = Codec::create(o);
    EXPECT_EQ(c.ok(), codec_available(k));
    if (!c.ok()) {
      EXPECT_EQ(c.status().code(), StatusCode::kNotSupported);
    }
  }
  EXPECT_EQ(parse_codec_kind("brotli").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_codec_kind("fp8").value(), CodecKind::kFp8);
}

}  // namespace
}  // namespace pdkv
