#include "core/relayout.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace pdkv {
namespace {

using planner::RowRange;
using planner::walk_segment_runs;

// Staging pays a host copy of every byte; it is worth it only when the direct plan
// would hand the transport many more, smaller extents.
constexpr uint64_t kMinGain = 4;           // direct extents per staged extent
constexpr uint64_t kMinDirectExtents = 4096;  // below this the direct plan is cheap anyway

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

Result<StagedPlan> make_staged_plan(const planner::PlanScope& scope, const KVGeometry& rg, const KVSegment& R,
                                    bool over_read) {
  const RowRange& rows = scope.rows;
  KVGeometry sg = rg;
  sg.num_layers = static_cast<uint32_t>((scope.seg_end - scope.seg_begin) / rg.kv_parts);
  sg.kv_heads = over_read ? rg.kv_heads : rows.num_heads;
  sg.num_blocks = static_cast<uint32_t>((rows.num_tokens + rg.block_tokens - 1) / rg.block_tokens);
  sg.order = R.head_stride <= R.token_stride ? TokenOrder::kNHD : TokenOrder::kHND;
  PDKV_ASSIGN_OR_RETURN(KVLayout staging, KVLayout::contiguous(sg, 0, /*interleaved=*/false));
  StagedPlan plan;
  plan.bytes = KVLayout::contiguous_bytes(sg);
  plan.staging = std::move(staging);
  plan.scope = scope;
  const uint32_t staged_head = over_read ? rows.remote_head_offset : 0;  // of the moved heads, in staging
  // An over-read covers whole remote blocks; otherwise exactly the moved rows.
  const uint64_t wire_tokens = over_read ? uint64_t(sg.num_blocks) * rg.block_tokens : rows.num_tokens;
  plan.wire = over_read ? RowRange{wire_tokens, rg.kv_heads, 0, 0}
                        : RowRange{wire_tokens, rows.num_heads, 0, rows.remote_head_offset};
  plan.copy = RowRange{rows.num_tokens, rows.num_heads, rows.local_head_offset, staged_head};
  return plan;
}

namespace {

uint64_t count_wire_runs(const StagedPlan& plan, const KVGeometry& rg, const KVSegment& R,
                         const std::vector<uint32_t>& rids) {
  const KVGeometry& sg = plan.staging.geometry();
  return planner::count_segment_runs(sg.block_tokens, plan.staging.segments()[0], first_ids(sg.num_blocks),
                                     rg.block_tokens, R, rids, rg.row_bytes(), plan.wire);
}

}  // namespace

Result<std::optional<StagedPlan>> plan_staged(OpKind op, const KVLayout& local, const std::vector<uint32_t>& lids,
                                              const KVLayout& remote, const std::vector<uint32_t>& rids,
                                              const PlanOptions& opts) {
  PDKV_ASSIGN_OR_RETURN(planner::PlanScope scope, planner::plan_scope(local, lids, remote, rids, opts));
  const KVGeometry& lg = local.geometry();
  const KVGeometry& rg = remote.geometry();
  const KVSegment& L = local.segments()[scope.seg_begin];
  const KVSegment& R = remote.segments()[scope.seg_begin];
  const uint64_t nseg = scope.seg_end - scope.seg_begin;
  const uint64_t direct =
      planner::count_segment_runs(lg.block_tokens, L, lids, rg.block_tokens, R, rids, lg.row_bytes(), scope.rows);
  if (direct * nseg < kMinDirectExtents) return std::optional<StagedPlan>();

  PDKV_ASSIGN_OR_RETURN(StagedPlan plan, make_staged_plan(scope, rg, R, /*over_read=*/false));
  uint64_t staged = count_wire_runs(plan, rg, R, rids);
  // A pull may read whole peer blocks (bytes it does not need, never writes) when
  // the moved heads alone would still be fragmented there.
  if (op == OpKind::kRead && rg.kv_heads != scope.rows.num_heads &&
      rg.kv_heads <= uint64_t(kMaxOverRead) * scope.rows.num_heads) {
    PDKV_ASSIGN_OR_RETURN(StagedPlan wide, make_staged_plan(scope, rg, R, /*over_read=*/true));
    const uint64_t wide_runs = count_wire_runs(wide, rg, R, rids);
    if (staged >= kMinGain * wide_runs) {
      plan = std::move(wide);
      staged = wide_runs;
    }
  }
  if (direct < kMinGain * staged) return std::optional<StagedPlan>();
  return std::optional<StagedPlan>(std::move(plan));
}

std::vector<Extent> staged_wire_extents(const StagedPlan& plan, uint64_t staging_region, const KVLayout& remote,
                                        const std::vector<uint32_t>& rids) {
  const KVGeometry& sg = plan.staging.geometry();
  const std::vector<uint32_t> sids = first_ids(sg.num_blocks);
  std::vector<Extent> out;
  for (size_t s = plan.scope.seg_begin; s < plan.scope.seg_end; ++s) {
    const KVSegment& S = plan.staging.segments()[s - plan.scope.seg_begin];
    const KVSegment& R = remote.segments()[s];
    const uint64_t rbase = R.region_id == KVSegment::kUnbound ? R.addr : R.region_offset;
    walk_segment_runs(sg.block_tokens, S, S.addr, sids, sg.block_tokens, R, rbase, rids, sg.row_bytes(), plan.wire,
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

uint64_t StagedPlan::payload_bytes() const {
  return uint64_t(scope.seg_end - scope.seg_begin) * copy.num_tokens * copy.num_heads *
         staging.geometry().row_bytes();
}

StagedTransfer::StagedTransfer(OpKind op, StagedPlan plan, KVLayout local, std::vector<uint32_t> lids,
                               std::shared_ptr<StagingBuffer> buf, uint64_t wire_bytes)
    : op_(op),
      plan_(std::move(plan)),
      local_(std::move(local)),
      lids_(std::move(lids)),
      buf_(std::move(buf)),
      wire_bytes_(wire_bytes) {}

namespace {

// Calls copy(local address, staging address, len) for every run between the local
// rows of `plan` and the staging buffer at `staging`.
template <class Copy>
void for_each_staged_run(const StagedPlan& plan, const KVLayout& local, const std::vector<uint32_t>& lids,
                         uint8_t* staging, Copy&& copy) {
  const KVGeometry& lg = local.geometry();
  const KVGeometry& sg = plan.staging.geometry();
  const std::vector<uint32_t> sids = first_ids(sg.num_blocks);
  const uint64_t base = reinterpret_cast<uint64_t>(staging);
  for (size_t s = plan.scope.seg_begin; s < plan.scope.seg_end; ++s) {
    const KVSegment& L = local.segments()[s];
    const KVSegment& S = plan.staging.segments()[s - plan.scope.seg_begin];
    walk_segment_runs(lg.block_tokens, L, L.addr, lids, sg.block_tokens, S, base + S.addr, sids, lg.row_bytes(), plan.copy,
                      copy);
  }
}

}  // namespace

void StagedTransfer::scatter() const {
  for_each_staged_run(plan_, local_, lids_, buf_->data(), [](uint64_t local, uint64_t staged, uint64_t len) {
    std::memcpy(reinterpret_cast<void*>(local), reinterpret_cast<const void*>(staged), len);
  });
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
      std::memcpy(reinterpret_cast<void*>(staged), reinterpret_cast<const void*>(local), len);
    });
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
