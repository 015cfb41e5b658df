// core/relayout.h: heterogeneous transfers staged through a local buffer.
//
// When the two layouts cut a transfer into many small runs (NHD <-> HND, a TP head
// split inside NHD blocks), the initiator keeps a staging buffer laid out in the
// peer's row order (a dense NHD or HND block per remote block, holding only the moved
// heads). The wire carries the staging buffer's blocks as the longest runs the peer's
// layout allows (usually whole blocks); a push first gathers the local rows into it,
// a pull scatters it into the local rows after the last byte landed (host copies).
// The plan (prepare) is then O(blocks), not O(rows), and the transport sees few
// large extents. Host memory only; device memory uses the direct plan.
//
// Thread safety: a StagedTransfer is shared by every post of one prepared transfer;
// begin_post() serialises those posts (one buffer), finish_post() releases it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/plan_runs.h"
#include "pdkv/kv_layout.h"
#include "pdkv/status.h"

namespace pdkv {

// Page-aligned host memory, owned; registered with the agent that made it.
class StagingBuffer {
 public:
  static Result<std::shared_ptr<StagingBuffer>> allocate(uint64_t bytes);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  uint64_t region_id = 0;  // set by the agent once registered

 private:
  StagingBuffer(uint8_t* d, uint64_t n) : data_(d), size_(n) {}
  uint8_t* data_;
  uint64_t size_;
};

// The staging layout of a push and the extents that move it: what prepare computes.
struct StagedPlan {
  KVLayout staging;          // dense, in the remote's row order, at address 0 (offsets into the buffer)
  uint64_t bytes = 0;        // staging buffer size
  planner::PlanScope scope;  // of the local -> remote plan
};

// The staged plan for moving `lids` of `local` to or from `rids` of `remote`, or
// nullopt when staging would not shorten the wire's extent list at least 4-fold (or
// the plan is small, or whole blocks map already). `strided`: the transport takes
// strided runs (spi/transport.h) and walks their pieces while copying, so both plans
// are counted in coalesced runs: a TP head split (pieces apart on one side, in
// order on both) is then one run per (layer, part) and block range and goes direct,
// its gather and scatter overlapping the wire; staging pays only where the two
// sides cut the rows in different orders (NHD <-> HND: one run per head and block).
// Errors: plan_blocks()'.
Result<std::optional<StagedPlan>> plan_staged(const KVLayout& local, const std::vector<uint32_t>& lids,
                                                    const KVLayout& remote, const std::vector<uint32_t>& rids,
                                                    const PlanOptions& opts, bool strided = false);

// Extents between the staging buffer (region `staging_region`, offsets from its
// start) and `remote`'s blocks `rids`: the wire's part of a staged transfer.
std::vector<Extent> staged_wire_extents(const StagedPlan& plan, uint64_t staging_region, const KVLayout& remote,
                                        const std::vector<uint32_t>& rids);
// The same as strided runs (for a transport that takes them): one per remote block
// or fewer.
std::vector<planner::StridedExtent> staged_wire_runs(const StagedPlan& plan, uint64_t staging_region,
                                                     const KVLayout& remote, const std::vector<uint32_t>& rids);

// One prepared staged transfer: a push gathers before each post, a pull scatters
// after each post's last byte.
class StagedTransfer {
 public:
  StagedTransfer(OpKind op, StagedPlan plan, KVLayout local, std::vector<uint32_t> lids,
                 std::shared_ptr<StagingBuffer> buf);

  // Waits (until `deadline`) for no earlier post of this transfer to still use the
  // buffer and returns true (a push has then gathered its rows into it); false when
  // the deadline passed first. Pair a true with finish_post() once that post is done.
  bool begin_post(std::chrono::steady_clock::time_point deadline);
  // A pull: copies the landed staging rows into the local rows.
  void scatter() const;
  void finish_post();

 private:
  const OpKind op_;
  StagedPlan plan_;
  KVLayout local_;  // addresses are this process's
  std::vector<uint32_t> lids_;
  std::shared_ptr<StagingBuffer> buf_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool busy_ = false;
};

}  // namespace pdkv
