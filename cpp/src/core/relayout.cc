#include "core/relayout.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "util/bench_switches.h"
#include "util/piece_copy.h"

namespace pdkv {
namespace {

using planner::RowRange;
using planner::walk_segment_runs;

// Staging pays a host copy of every byte; it is worth it only when the direct plan
// would hand the transport many more, smaller extents.
constexpr uint64_t kMinGain = 4;           // direct extents per staged extent
constexpr uint64_t kMinDirectExtents = 4096;  // below this the direct plan is cheap anyway

// False under the benchmark switch BenchSwitch::kNoStaging=1 (read once per process;
// docs/benchmarks.md): every plan direct, to compare the two in one build.
bool staging_allowed() {
  static const bool on = !util::bench_switch_is(util::BenchSwitch::kNoStaging, "1");
  return on;
}

// True under the benchmark switch BenchSwitch::kStagingByPieces=1 (read once per
// process; docs/benchmarks.md): a strided transport's direct plan is counted with one
// extent per local piece of each run whose local pieces are apart
// (planner::strided_segment_cost), the choice made before tcp walked such runs lazily
// (transport/tcp/scatter.h), to compare both plans in one build.
bool count_pieces() {
  static const bool on = util::bench_switch_is(util::BenchSwitch::kStagingByPieces, "1");
  return on;
}

// The runs a transport that takes strided runs is handed for one (layer, part) pair
// once neighbours are coalesced: what its prepare and its descriptors cost (it walks
// each run's pieces while copying, never listing them).
uint64_t strided_run_count(uint64_t LT, const KVSegment& L, const std::vector<uint32_t>& lids, uint64_t RT,
                           const KVSegment& R, const std::vector<uint32_t>& rids, uint64_t row, const RowRange& rr) {
  std::vector<planner::StridedExtent> runs;
  planner::walk_segment_strided(LT, L, 0, lids, RT, R, 0, rids, row, rr,
                                [&](uint64_t lo, uint64_t ro, uint64_t len, uint64_t n, uint64_t ls, uint64_t rs) {
                                  planner::push_strided(runs, planner::StridedExtent{0, lo, 0, ro, len, n, ls, rs});
                                });
  return runs.size();
}

// Rows of a push as the staging side sees them: local -> staging, staging -> remote.
RowRange to_staging(const RowRange& r) { return RowRange{r.num_tokens, r.num_heads, r.local_head_offset, 0}; }
RowRange from_staging(const RowRange& r) { return RowRange{r.num_tokens, r.num_heads, 0, r.remote_head_offset}; }

std::vector<uint32_t> first_ids(uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

}  // namespace

Result<std::shared_ptr<StagingBuffer>> StagingBuffer::allocate(uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return ResourceExhausted("cannot map a " + std::to_string(bytes) + "-byte staging buffer: " + std::strerror(errno));
  return std::shared_ptr<StagingBuffer>(new StagingBuffer(static_cast<uint8_t*>(p), bytes));
}

StagingBuffer::~StagingBuffer() { munmap(data_, size_); }

Result<std::optional<StagedPlan>> plan_staged(const KVLayout& local, const std::vector<uint32_t>& lids,
                                                    const KVLayout& remote, const std::vector<uint32_t>& rids,
                                                    const PlanOptions& opts, bool strided) {
  PDKV_ASSIGN_OR_RETURN(planner::PlanScope scope, planner::plan_scope(local, lids, remote, rids, opts));
  const auto count = !strided ? planner::count_segment_runs
                    : count_pieces() ? planner::strided_segment_cost
                                     : strided_run_count;
  const KVGeometry& lg = local.geometry();
  const KVGeometry& rg = remote.geometry();
  const KVSegment& L = local.segments()[scope.seg_begin];
  const KVSegment& R = remote.segments()[scope.seg_begin];
  const uint64_t row = lg.row_bytes();
  const uint64_t nseg = scope.seg_end - scope.seg_begin;
  const uint64_t direct = count(lg.block_tokens, L, lids, rg.block_tokens, R, rids, row, scope.rows);
  if (direct * nseg < kMinDirectExtents || !staging_allowed()) return std::optional<StagedPlan>();

  // One dense block per remote block, in the remote's row order, holding the moved heads.
  KVGeometry sg = rg;
  sg.num_layers = static_cast<uint32_t>(nseg / rg.kv_parts);
  sg.kv_heads = scope.rows.num_heads;
  sg.num_blocks = static_cast<uint32_t>((scope.rows.num_tokens + rg.block_tokens - 1) / rg.block_tokens);
  sg.order = R.head_stride <= R.token_stride ? TokenOrder::kNHD : TokenOrder::kHND;
  PDKV_ASSIGN_OR_RETURN(KVLayout staging, KVLayout::contiguous(sg, 0, /*interleaved=*/false));
  const uint64_t staged = count(rg.block_tokens, staging.segments()[0], first_ids(sg.num_blocks), rg.block_tokens, R,
                                rids, row, from_staging(scope.rows));
  if (direct < kMinGain * staged) return std::optional<StagedPlan>();
  StagedPlan plan;
  plan.bytes = KVLayout::contiguous_bytes(sg);
  plan.staging = std::move(staging);
  plan.scope = scope;
  return std::optional<StagedPlan>(std::move(plan));
}

std::vector<Extent> staged_wire_extents(const StagedPlan& plan, uint64_t staging_region, const KVLayout& remote,
                                        const std::vector<uint32_t>& rids) {
  const KVGeometry& sg = plan.staging.geometry();
  const std::vector<uint32_t> sids = first_ids(sg.num_blocks);
  const RowRange rows = from_staging(plan.scope.rows);
  std::vector<Extent> out;
  for (size_t s = plan.scope.seg_begin; s < plan.scope.seg_end; ++s) {
    const KVSegment& S = plan.staging.segments()[s - plan.scope.seg_begin];
    const KVSegment& R = remote.segments()[s];
    const uint64_t rbase = R.region_id == KVSegment::kUnbound ? R.addr : R.region_offset;
    walk_segment_runs(sg.block_tokens, S, S.addr, sids, sg.block_tokens, R, rbase, rids, sg.row_bytes(), rows,
                      [&](uint64_t so, uint64_t ro, uint64_t len) {
                        if (!out.empty()) {
                          Extent& b = out.back();
                          if (b.remote_region == R.region_id && b.local_offset + b.len == so &&
                              b.remote_offset + b.len == ro) {
                            b.len += len;
                            return;
                          }
                        }
                        out.push_back(Extent{staging_region, so, R.region_id, ro, len});
                      });
  }
  return out;
}

std::vector<planner::StridedExtent> staged_wire_runs(const StagedPlan& plan, uint64_t staging_region,
                                                     const KVLayout& remote, const std::vector<uint32_t>& rids) {
  const KVGeometry& sg = plan.staging.geometry();
  const std::vector<uint32_t> sids = first_ids(sg.num_blocks);
  const RowRange rows = from_staging(plan.scope.rows);
  std::vector<planner::StridedExtent> out;
  for (size_t s = plan.scope.seg_begin; s < plan.scope.seg_end; ++s) {
    const KVSegment& S = plan.staging.segments()[s - plan.scope.seg_begin];
    const KVSegment& R = remote.segments()[s];
    const uint64_t rbase = R.region_id == KVSegment::kUnbound ? R.addr : R.region_offset;
    planner::walk_segment_strided(
        sg.block_tokens, S, S.addr, sids, sg.block_tokens, R, rbase, rids, sg.row_bytes(), rows,
        [&](uint64_t so, uint64_t ro, uint64_t len, uint64_t n, uint64_t ss, uint64_t rs) {
          planner::push_strided(out, planner::StridedExtent{staging_region, so, R.region_id, ro, len, n, ss, rs});
        });
  }
  return out;
}

StagedTransfer::StagedTransfer(OpKind op, StagedPlan plan, KVLayout local, std::vector<uint32_t> lids,
                               std::shared_ptr<StagingBuffer> buf)
    : op_(op), plan_(std::move(plan)), local_(std::move(local)), lids_(std::move(lids)), buf_(std::move(buf)) {}

namespace {

// Calls copy(local address, staging address, len) for every run between the local
// rows of `plan` and the staging buffer at `staging`.
template <class Copy>
void for_each_staged_run(const StagedPlan& plan, const KVLayout& local, const std::vector<uint32_t>& lids,
                         uint8_t* staging, Copy&& copy) {
  const KVGeometry& lg = local.geometry();
  const KVGeometry& sg = plan.staging.geometry();
  const std::vector<uint32_t> sids = first_ids(sg.num_blocks);
  const RowRange rows = to_staging(plan.scope.rows);
  const uint64_t base = reinterpret_cast<uint64_t>(staging);
  for (size_t s = plan.scope.seg_begin; s < plan.scope.seg_end; ++s) {
    const KVSegment& L = local.segments()[s];
    const KVSegment& S = plan.staging.segments()[s - plan.scope.seg_begin];
    walk_segment_runs(lg.block_tokens, L, L.addr, lids, sg.block_tokens, S, base + S.addr, sids, lg.row_bytes(), rows,
                      copy);
  }
}

}  // namespace

// Both copies write with streaming stores (util/piece_copy.h): the runs are a few
// hundred bytes at a stride on the local side, and the staging buffer is as large
// as the transfer; neither is read again before the transfer completes (measured
// for the tcp landing scatter: 2-3x the memcpy per piece).
void StagedTransfer::scatter() const {
  for_each_staged_run(plan_, local_, lids_, buf_->data(), [](uint64_t local, uint64_t staged, uint64_t len) {
    util::stream_piece(reinterpret_cast<char*>(local), reinterpret_cast<const char*>(staged), len);
  });
  util::stream_fence();
}

bool StagedTransfer::begin_post(std::chrono::steady_clock::time_point deadline) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto idle = [this] { return !busy_; };
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      cv_.wait(lk, idle);
    } else if (!cv_.wait_until(lk, deadline, idle)) {
      return false;
    }
    busy_ = true;
  }
  if (op_ == OpKind::kWrite)
    for_each_staged_run(plan_, local_, lids_, buf_->data(), [](uint64_t local, uint64_t staged, uint64_t len) {
      util::stream_piece(reinterpret_cast<char*>(staged), reinterpret_cast<const char*>(local), len);
    });
  util::stream_fence();
  return true;
}

void StagedTransfer::finish_post() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = false;
  }
  cv_.notify_all();
}

}  // namespace pdkv
