// The strided piece copy of a heterogeneous shm transfer (util/piece_copy.h) with each
// store width, against memcpy of the same bytes as whole destination runs (what the
// homogeneous transfer does), alternating round by round in one process. Timed in
// thread CPU time so other sessions on a shared VM skew it less than wall time.
//
// Default shape: a TP2 -> TP4 push at llama-3-70b / 8b geometry: runs of 16 pieces of
// 512 bytes read at a 1 KiB stride (the 2 of 4 heads moved), written as one 8 KiB
// destination run, 8192 runs (64 MiB) in random order on both sides.
//
//   g++ -O2 -std=c++17 -Icpp/src bench/piece_copy_bench.cc -o /tmp/piece_copy_bench
//   /tmp/piece_copy_bench [runs piece src_stride dst_stride pieces rounds]
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "util/piece_copy.h"

using pdkv::util::PieceStores;

namespace {

double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

char* pages(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::abort();
  std::memset(p, 1, n);
  return static_cast<char*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, size_t dflt) { return argc > i ? std::strtoull(argv[i], nullptr, 10) : dflt; };
  const size_t runs = arg(1, 8192), piece = arg(2, 512), sstride = arg(3, 1024), dstride = arg(4, 512),
               pieces = arg(5, 16), rounds = arg(6, 6);
  const size_t src_run = sstride * pieces, dst_run = dstride * pieces, bytes = piece * pieces;
  char* src = pages(runs * src_run);
  char* hsrc = pages(runs * bytes);
  char* dst = pages(2 * runs * std::max(dst_run, bytes));
  std::mt19937 rng(1);
  std::vector<size_t> s(runs), h(runs), d(2 * runs);
  for (size_t i = 0; i < runs; ++i) s[i] = h[i] = i;
  for (size_t i = 0; i < 2 * runs; ++i) d[i] = i;
  std::shuffle(s.begin(), s.end(), rng);
  std::shuffle(h.begin(), h.end(), rng);
  std::shuffle(d.begin(), d.end(), rng);
  const size_t dunit = std::max(dst_run, bytes);
  auto homogeneous = [&] {
    for (size_t u = 0; u < runs; ++u) std::memcpy(dst + d[runs + u] * dunit, hsrc + h[u] * bytes, bytes);
  };
  auto strided = [&](PieceStores how) {
    for (size_t u = 0; u < runs; ++u)
      pdkv::util::copy_strided_with(how, dst + d[u] * dunit, dstride, src + s[u] * src_run, sstride, piece, pieces);
  };
  std::vector<std::pair<const char*, PieceStores>> kinds = {{"memcpy per piece", PieceStores::kMemcpy},
                                                            {"16-byte streaming", PieceStores::kSse}};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) kinds.push_back({"32-byte streaming", PieceStores::kAvx2});
  if (__builtin_cpu_supports("avx512f")) kinds.push_back({"64-byte streaming", PieceStores::kAvx512});
  std::vector<double> t(kinds.size(), 0.0), th(kinds.size(), 0.0);
  homogeneous();
  for (auto& k : kinds) strided(k.second);
  for (size_t r = 0; r < rounds; ++r)
    for (size_t k = 0; k < kinds.size(); ++k) {
      double t0 = cpu_s();
      homogeneous();
      th[k] += cpu_s() - t0;
      t0 = cpu_s();
      strided(kinds[k].second);
      t[k] += cpu_s() - t0;
    }
  const double moved = static_cast<double>(runs * bytes * rounds);
  std::printf("%zu runs of %zu x %zu B (src stride %zu, dst stride %zu), %zu rounds, thread CPU time\n", runs,
              pieces, piece, sstride, dstride, rounds);
  for (size_t k = 0; k < kinds.size(); ++k)
    std::printf("%-18s %6.2f GB/s  memcpy of whole runs %6.2f GB/s  ratio %.2fx\n", kinds[k].first,
                moved / t[k] / 1e9, moved / th[k] / 1e9, th[k] / t[k]);
  return 0;
}
