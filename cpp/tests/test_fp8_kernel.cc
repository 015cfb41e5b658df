// The FP8 CUDA kernels' source (cpp/src/cuda/fp8_codec.cu), compiled as host C++ and
// run as a one-thread grid, against the host codec: the kernels' rounding, scale,
// NaN, frame-layout and piece-lookup logic checked bit for bit without a GPU (the
// machines that build pdkv have none). What this cannot check, a GPU's own float
// semantics and the CTA-wide reduction, bench/gpu_check.sh checks on one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/fp8_device.h"
#include "pdkv/codec.h"

#include "cuda/host_shim.h"  // the kernels as a one-thread grid on the host
#include "cuda/fp8_codec.cu"

namespace pdkv {
namespace {

using cuda::Fp8Launch;
using cuda::Fp8Plan;

constexpr Fp8Grouping kG{3, 40, 5};  // heads, head_dim, rows_per_group: odd on purpose

size_t esize(DType d) { return d == DType::kF32 ? 4 : 2; }

// Bytes of `n` elements of dtype d: KV-like values with every special case.
std::vector<uint8_t> values(DType d, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> mag(-14.f, 6.f);
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.f, -0.f, 1e-40f, -3e-39f, 65504.f, 70000.f, 448.f,
                            -500.f, 0x1p-10f, 1e30f, 6e-8f};
  std::vector<uint8_t> out(n * esize(d));
  for (size_t i = 0; i < n; ++i) {
    float x = normal(rng) * std::exp2(mag(rng));
    if (rng() % 23 == 0) x = specials[rng() % (sizeof specials / sizeof *specials)];
    if (i < size_t(kG.heads) * kG.head_dim * kG.rows_per_group) x = 0.f;  // an all-zero group
    uint32_t b;
    std::memcpy(&b, &x, 4);
    if (d == DType::kF32) {
      std::memcpy(&out[i * 4], &x, 4);
    } else if (d == DType::kBF16) {
      const uint16_t h = uint16_t(b >> 16);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      const _Float16 h = static_cast<_Float16>(x);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

Fp8Launch launch_of(const Fp8Plan& p, uint8_t* buf, DType d) {
  Fp8Launch a{};
  a.pieces = reinterpret_cast<uint64_t>(p.pieces.data());
  a.frames = reinterpret_cast<uint64_t>(p.frames.data());
  a.buf = reinterpret_cast<uint64_t>(buf);
  a.total_groups = p.total_groups;
  a.npieces = uint32_t(p.pieces.size());
  a.nframes = uint32_t(p.frames.size());
  a.heads = kG.heads;
  a.head_dim = kG.head_dim;
  a.rows_per_group = kG.rows_per_group;
  a.dtype = uint32_t(d);
  return a;
}

class Fp8Kernel : public ::testing::TestWithParam<std::tuple<DType, bool>> {};

TEST_P(Fp8Kernel, QuantizeAndDequantizeMatchTheHostCodecBitForBit) {
  const auto [dtype, one_frame] = GetParam();
  const size_t row = size_t(kG.heads) * kG.head_dim * esize(dtype);
  // Scattered extents of odd row counts (partial last groups), out of order in memory.
  const size_t rows[] = {7, 1, 12, 23, 5, 3};
  std::vector<uint8_t> pool = values(dtype, 80 * row / esize(dtype), 1);
  const size_t starts[] = {40, 2, 60, 10, 33, 75};
  std::vector<iovec> ext;
  std::vector<uint8_t> batch;  // the extents back to back, as a host sender reads them
  for (size_t i = 0; i < 6; ++i) {
    ext.push_back({pool.data() + starts[i] * row, rows[i] * row});
    batch.insert(batch.end(), pool.begin() + starts[i] * row, pool.begin() + (starts[i] + rows[i]) * row);
  }
  auto plan = cuda::plan_fp8_batch(ext.data(), ext.size(), one_frame, dtype, kG);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  std::vector<uint8_t> payload(plan->payload_bytes);
  pdkv_fp8_quantize(launch_of(*plan, payload.data(), dtype));

  CodecOptions co;
  co.kind = CodecKind::kFp8;
  co.fp8 = kG;
  auto codec = Codec::create(co);
  ASSERT_TRUE(codec.ok());
  std::vector<uint8_t> frame;
  size_t src_off = 0;
  for (size_t f = 0; f < plan->frames.size(); ++f) {
    const uint64_t raw = plan->raw_len[f];
    ASSERT_TRUE((*codec)->encode(batch.data() + src_off, raw, dtype, frame).ok());
    const uint64_t at = plan->frame_offset[f];
    const uint64_t body = frame.size() - kCodecHeaderBytes;
    ASSERT_LE(at + kCodecHeaderBytes + body, payload.size());
    EXPECT_EQ(0, std::memcmp(payload.data() + at + kCodecHeaderBytes, frame.data() + kCodecHeaderBytes, body))
        << "scales + codes of frame " << f;
    // The host codec's header, so the host decoder can read the kernel's frame.
    std::memcpy(payload.data() + at, frame.data(), kCodecHeaderBytes);
    src_off += raw;
  }
  ASSERT_EQ(src_off, batch.size());

  // Dequantize into other extents (same shapes, other places) and compare with the host decode.
  std::vector<uint8_t> out_pool(pool.size(), 0xAB);
  std::vector<iovec> dst;
  const size_t dst_starts[] = {0, 8, 9, 21, 44, 49};
  for (size_t i = 0; i < 6; ++i) dst.push_back({out_pool.data() + dst_starts[i] * row, rows[i] * row});
  std::vector<cuda::Fp8FrameAt> frames;
  for (size_t f = 0; f < plan->frames.size(); ++f) {
    auto info = peek_frame(payload.data() + plan->frame_offset[f], payload.size() - plan->frame_offset[f]);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    frames.push_back({plan->frame_offset[f], *info});
  }
  auto dplan = cuda::plan_fp8_frames(frames, dst.data(), dst.size());
  ASSERT_TRUE(dplan.ok()) << dplan.status().to_string();
  pdkv_fp8_dequantize(launch_of(*dplan, payload.data(), dtype));
  auto landed = [&] {
    std::vector<uint8_t> got;
    for (const iovec& d : dst) got.insert(got.end(), (uint8_t*)d.iov_base, (uint8_t*)d.iov_base + d.iov_len);
    return got;
  };
  const std::vector<uint8_t> one_thread = landed();
  // The same as wider grids (dequantize has no barrier, so each (block, thread) can run
  // in turn): threads fewer and more than head_dim, blocks fewer than groups.
  for (unsigned threads : {7u, 64u, 128u}) {
    std::fill(out_pool.begin(), out_pool.end(), 0xCD);
    blockDim.x = threads;
    gridDim.x = 3;
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; ++blockIdx.x)
      for (threadIdx.x = 0; threadIdx.x < threads; ++threadIdx.x) pdkv_fp8_dequantize(launch_of(*dplan, payload.data(), dtype));
    blockIdx.x = threadIdx.x = 0;
    blockDim.x = gridDim.x = 1;
    EXPECT_EQ(landed(), one_thread) << threads << " threads x 3 blocks";
  }
  std::vector<uint8_t> want(batch.size());
  size_t off = 0, written = 0;
  for (const auto& f : frames) {
    ASSERT_TRUE((*codec)->decode(payload.data() + f.offset, f.info.frame_len, dtype, want.data() + off,
                                 want.size() - off, &written).ok());
    off += written;
  }
  EXPECT_EQ(one_thread, want);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8Kernel,
                         ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16, DType::kF32),
                                            ::testing::Bool()));

TEST(Fp8KernelDequantize, ForeignScalesGiveTheHostsBits) {
  // A sender may put any scale on the wire: NaN, infinities, zero, a subnormal.
  const float scales[] = {NAN, -NAN, INFINITY, -INFINITY, 0.f, 1e-42f, 3.0f};
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (float s : scales) {
      const uint64_t elems = uint64_t(kG.heads) * kG.head_dim * kG.rows_per_group;
      std::vector<uint8_t> frame(kCodecHeaderBytes + kG.heads * 4 + elems);
      FrameInfo info;
      info.kind = CodecKind::kFp8;
      info.dtype = dtype;
      info.raw_len = elems * esize(dtype);
      info.payload_len = frame.size() - kCodecHeaderBytes;
      info.fp8 = kG;
      CodecOptions co;
      co.kind = CodecKind::kFp8;
      co.fp8 = kG;
      auto codec = Codec::create(co);
      ASSERT_TRUE(codec.ok());
      // Header via an encode of zeros (the same fields), then the scales and every code.
      std::vector<uint8_t> zeros(info.raw_len), tmp;
      ASSERT_TRUE((*codec)->encode(zeros.data(), zeros.size(), dtype, tmp).ok());
      ASSERT_EQ(tmp.size(), frame.size());
      std::memcpy(frame.data(), tmp.data(), kCodecHeaderBytes);
      for (uint32_t h = 0; h < kG.heads; ++h) std::memcpy(&frame[kCodecHeaderBytes + 4 * h], &s, 4);
      // Every code; but not a NaN code under a NaN scale: which of two NaN operands x86
      // returns follows the operand order, which the host compiler may swap.
      for (uint64_t i = 0; i < elems; ++i) {
        uint8_t c = uint8_t(i * 37 + 11);
        if (std::isnan(s) && (c & 0x7F) == 0x7F) c = 0x7E;
        frame[kCodecHeaderBytes + kG.heads * 4 + i] = c;
      }
      std::vector<uint8_t> want(info.raw_len), got(info.raw_len);
      size_t written = 0;
      ASSERT_TRUE((*codec)->decode(frame.data(), frame.size(), dtype, want.data(), want.size(), &written).ok());
      iovec dst{got.data(), got.size()};
      auto fi = peek_frame(frame.data(), frame.size());
      ASSERT_TRUE(fi.ok());
      auto plan = cuda::plan_fp8_frames({{0, *fi}}, &dst, 1);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      pdkv_fp8_dequantize(launch_of(*plan, frame.data(), dtype));
      EXPECT_EQ(got, want) << "dtype " << int(dtype) << " scale " << s;
    }
  }
}

TEST(Fp8Plan, RefusesExtentsTheKernelsCannotAddress) {
  std::vector<uint8_t> buf(4096);
  iovec partial{buf.data(), 3 * 40 * 2 + 2};  // not whole rows
  EXPECT_EQ(cuda::plan_fp8_batch(&partial, 1, false, DType::kBF16, kG).status().code(), StatusCode::kInvalidArgument);
  iovec odd{buf.data() + 1, 3 * 40 * 2};  // not aligned to its element
  EXPECT_EQ(cuda::plan_fp8_batch(&odd, 1, false, DType::kBF16, kG).status().code(), StatusCode::kInvalidArgument);
  iovec whole{buf.data(), 3 * 40 * 2 * 4};
  EXPECT_EQ(cuda::plan_fp8_batch(&whole, 1, false, DType::kI8, kG).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdkv
