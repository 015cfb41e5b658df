// FP8 (e4m3) quantize / dequantize of device extents, bit-identical to the host codec
// (codec/fp8.cc; the rules are in docs/compression.md "FP8"): one CTA per scale
// group, threads over its elements. Quantize reads the scattered extents of a batch
// and writes scales + codes where the batch's kWriteZ payload has them; dequantize
// reads them back and writes each element into its extent in its dtype. Argument
// layout: fp8_abi.h. Built into a fatbin by CMake (no CUDA runtime dependency).
//
// The arithmetic is IEEE fp32 with round-to-nearest (no fast math, denormals kept).
// Where a GPU and an x86 CPU disagree (the bits of a NaN an operation produces) the
// result is fixed explicitly, so a GPU and a CPU sender put the same bytes on the wire.
#include "fp8_abi.h"

using pdkv::cuda::Fp8FrameDesc;
using pdkv::cuda::Fp8Launch;
using pdkv::cuda::Fp8Piece;

namespace {

constexpr unsigned kF32 = 0, kF16 = 1;  // (2: bfloat16)

__device__ __forceinline__ unsigned bits_of(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float float_of(unsigned u) { return __uint_as_float(u); }

__device__ __forceinline__ float fp16_value(unsigned short h) {
  const unsigned sign = unsigned(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) return float_of(sign | bits_of(float(man) * 5.9604644775390625e-8f));  // man * 2^-24, exact
  if (exp == 31) return float_of(sign | 0x7F800000u | (man << 13));
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ float load(unsigned dtype, const char* p) {
  if (dtype == kF32) return *reinterpret_cast<const float*>(p);
  const unsigned short h = *reinterpret_cast<const unsigned short*>(p);
  return dtype == kF16 ? fp16_value(h) : float_of(unsigned(h) << 16);
}

__device__ __forceinline__ void store(unsigned dtype, char* p, float v) {
  const unsigned x = bits_of(v);
  if (dtype == kF32) {
    *reinterpret_cast<float*>(p) = v;
    return;
  }
  const unsigned ax = x & 0x7FFFFFFFu;
  unsigned short h;
  if (dtype == kF16) {
    const unsigned sign = (x >> 16) & 0x8000u;
    if (ax > 0x7F800000u) h = sign | 0x7E00u;                                   // NaN
    else if (ax >= 0x477FF000u) h = sign | 0x7C00u;                             // rounds to infinity
    else if (ax < 0x38800000u) h = sign | unsigned(__float2int_rn(float_of(ax) * 16777216.0f));  // subnormal
    else h = sign | (((ax + 0xFFFu + ((ax >> 13) & 1u)) >> 13) - (112u << 10));
  } else {  // bfloat16
    h = ax > 0x7F800000u ? ((x >> 16) | 0x0040u) : ((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
  }
  *reinterpret_cast<unsigned short*>(p) = h;
}

// e4m3 code of y (y not NaN: the caller keeps a NaN's sign itself): round to nearest
// even, saturating to +-448.
__device__ __forceinline__ unsigned char to_e4m3(float y) {
  const unsigned x = bits_of(y), sign = (x >> 24) & 0x80u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x43E00000u) return sign | 0x7Eu;                                     // >= 448, infinity too
  if (ax < 0x3C800000u) return sign | unsigned(__float2int_rn(float_of(ax) * 512.0f));  // below 2^-6
  unsigned code = ((ax + 0x7FFFFu + ((ax >> 20) & 1u)) >> 20) - (120u << 3);
  return sign | (code > 0x7Eu ? 0x7Eu : code);
}

// The value of code c times scale, with the NaN an x86 CPU would produce.
__device__ __forceinline__ float dequant(unsigned char c, float scale) {
  const unsigned sign = unsigned(c & 0x80u) << 24, e = (c >> 3) & 0xFu, m = c & 7u;
  if ((c & 0x7Fu) == 0x7Fu) return float_of(sign | 0x7FC00000u);         // the code's own NaN
  const float v = e == 0 ? float_of(sign | bits_of(float(m) * 0.001953125f))  // m * 2^-9
                         : float_of(sign | ((e + 120u) << 23) | (m << 20));
  const float r = __fmul_rn(v, scale);
  if (r == r) return r;
  // A NaN scale comes back quieted; 0 x infinity is the x86 "indefinite" NaN.
  return scale != scale ? float_of(bits_of(scale) | 0x00400000u) : float_of(0xFFC00000u);
}

__device__ const Fp8FrameDesc& frame_of(const Fp8Launch& a, unsigned long long g) {
  const Fp8FrameDesc* f = reinterpret_cast<const Fp8FrameDesc*>(a.frames);
  unsigned lo = 0, hi = a.nframes - 1;  // last frame with first_group <= g
  while (lo < hi) {
    const unsigned mid = (lo + hi + 1) / 2;
    if (f[mid].first_group <= g) lo = mid;
    else hi = mid - 1;
  }
  return f[lo];
}

// Index of the piece holding batch row `row` (the last with first_row <= row).
__device__ unsigned piece_of(const Fp8Launch& a, unsigned long long row) {
  const Fp8Piece* p = reinterpret_cast<const Fp8Piece*>(a.pieces);
  unsigned lo = 0, hi = a.npieces - 1;
  while (lo < hi) {
    const unsigned mid = (lo + hi + 1) / 2;
    if (p[mid].first_row <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Scale group g: its frame, the frame-relative group k, its head and rows [r0, r1).
struct Group {
  const Fp8FrameDesc* f;
  unsigned long long k, r0, r1;
  unsigned head;
};

__device__ Group group_of(const Fp8Launch& a, unsigned long long g) {
  Group x;
  x.f = &frame_of(a, g);
  x.k = g - x.f->first_group;
  x.head = unsigned(x.k % a.heads);
  x.r0 = x.f->first_row + x.k / a.heads * a.rows_per_group;
  const unsigned long long end = x.f->first_row + x.f->rows;
  x.r1 = x.r0 + a.rows_per_group < end ? x.r0 + a.rows_per_group : end;
  return x;
}

// Calls f(element address, index of its code in buf) for this thread's elements of
// group x: element i = threadIdx.x, + blockDim.x, ... of the group's rows in order,
// head_dim at a time. The row, column and piece advance incrementally (no division
// or search per element: rows are consecutive and pieces hold whole rows).
template <typename F>
__device__ void for_each_element(const Fp8Launch& a, const Group& x, F&& f) {
  const Fp8Piece* pieces = reinterpret_cast<const Fp8Piece*>(a.pieces);
  const unsigned esize = a.dtype == kF32 ? 4 : 2;
  const unsigned long long row_elems = (unsigned long long)a.heads * a.head_dim, row_bytes = row_elems * esize;
  const unsigned step_rows = blockDim.x / a.head_dim, step_d = blockDim.x % a.head_dim;
  unsigned long long r = x.r0 + threadIdx.x / a.head_dim;
  unsigned d = threadIdx.x % a.head_dim;
  if (r >= x.r1) return;
  unsigned p = piece_of(a, r);
  for (; r < x.r1;) {
    while (p + 1 < a.npieces && pieces[p + 1].first_row <= r) ++p;
    const unsigned long long col = (unsigned long long)x.head * a.head_dim + d;
    f(reinterpret_cast<char*>(pieces[p].addr + (r - pieces[p].first_row) * row_bytes + col * esize),
      x.f->codes_off + (r - x.f->first_row) * row_elems + col);
    r += step_rows;
    d += step_d;
    if (d >= a.head_dim) {
      d -= a.head_dim;
      ++r;
    }
  }
}

}  // namespace

extern "C" __global__ void pdkv_fp8_quantize(Fp8Launch a) {
  __shared__ unsigned amax_bits;
  __shared__ float inv_shared;
  unsigned char* buf = reinterpret_cast<unsigned char*>(a.buf);
  for (unsigned long long g = blockIdx.x; g < a.total_groups; g += gridDim.x) {
    const Group x = group_of(a, g);
    if (threadIdx.x == 0) amax_bits = 0;
    __syncthreads();
    unsigned local = 0;  // largest finite magnitude, as bits (ordered as the values)
    for_each_element(a, x, [&](const char* e, unsigned long long) {
      const unsigned b = bits_of(load(a.dtype, e)) & 0x7FFFFFFFu;
      if (b < 0x7F800000u && b > local) local = b;
    });
    atomicMax(&amax_bits, local);
    __syncthreads();
    if (threadIdx.x == 0) {
      const float amax = float_of(amax_bits);
      float scale = amax / 448.0f, inv = 448.0f / amax;
      if (!(scale > 0.0f) || (bits_of(inv) & 0x7FFFFFFFu) >= 0x7F800000u) scale = inv = 1.0f;
      const unsigned s = bits_of(scale);
      unsigned char* out = buf + x.f->scales_off + x.k * 4;  // frames are byte-aligned: store bytewise
      for (int j = 0; j < 4; ++j) out[j] = (unsigned char)(s >> (8 * j));
      inv_shared = inv;
    }
    __syncthreads();
    const float inv = inv_shared;
    for_each_element(a, x, [&](const char* e, unsigned long long code_at) {
      const float v = load(a.dtype, e);
      buf[code_at] = v != v ? (unsigned char)(((bits_of(v) >> 24) & 0x80u) | 0x7Fu) : to_e4m3(__fmul_rn(v, inv));
    });
    __syncthreads();  // amax_bits is reset for the next group
  }
}

extern "C" __global__ void pdkv_fp8_dequantize(Fp8Launch a) {
  const unsigned char* buf = reinterpret_cast<const unsigned char*>(a.buf);
  for (unsigned long long g = blockIdx.x; g < a.total_groups; g += gridDim.x) {
    const Group x = group_of(a, g);
    const unsigned char* sp = buf + x.f->scales_off + x.k * 4;
    const float scale = float_of(unsigned(sp[0]) | unsigned(sp[1]) << 8 | unsigned(sp[2]) << 16 | unsigned(sp[3]) << 24);
    for_each_element(a, x, [&](char* e, unsigned long long code_at) { store(a.dtype, e, dequant(buf[code_at], scale)); });
  }
}
