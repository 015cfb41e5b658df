// pdkv/spi/generations.h (SPI, for the core and transport authors; users use
// Agent::generations / bump_generations): block generations, the owner's proof that a block reference
// is still current.
//
// Every block of every layout an agent exports has a 32-bit generation (starting at
// 1, never 0). The owner bumps it when it frees or reuses the block. Whoever is
// handed a block id to write into (or read from) is handed its generation too and
// sends it with the transfer as a GenClaim; the target checks the claim before any
// byte lands (write) or is sent (read) and fails the transfer with StaleBlock on a
// mismatch. The check and the use cannot race with a bump: check_and_pin() pins the
// blocks under the same lock as the check, and bump() first bumps (new checks
// fail), then waits until every pin of those blocks is released, so when bump()
// returns nothing accepted under an old generation still touches the blocks.
//
// Thread safety: GenerationTable is safe from any thread. GenPin is a move-only
// token; destroy it from any thread (never while holding a lock bump() waits under).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "pdkv/status.h"

namespace pdkv {

// Most blocks one transfer may claim (bounds the claim on the wire: 8 bytes each).
constexpr uint32_t kMaxClaimBlocks = 1u << 18;
// Largest encoded claim: name (u32 length + at most 128 bytes), count, entries.
constexpr uint32_t kMaxClaimBytes = 4 + 128 + 4 + 8 * kMaxClaimBlocks;

// What an initiator claims about the target's blocks: block blocks[i] of the
// target's layout `layout` still has generation gens[i]. Duplicate blocks are
// allowed (a read may copy one block into several places).
struct GenClaim {
  std::string layout;
  std::vector<uint32_t> blocks;
  std::vector<uint32_t> gens;
  bool empty() const { return blocks.empty(); }
};

// Shape checks (sizes agree, 1..kMaxClaimBlocks entries, no generation 0, valid name).
Status validate_claim(const GenClaim& c);
// Wire form (docs/wire.md "Block generations"): u32 name length, name, u32 count,
// count x (u32 block, u32 generation), little-endian.
std::string encode_claim(const GenClaim& c);
// Decodes and validates; the count is checked against the input size before allocating.
Result<GenClaim> decode_claim(std::string_view in);

namespace detail {
struct LayoutGens;
}

// Blocks pinned by check_and_pin(); released when destroyed.
class GenPin {
 public:
  GenPin() = default;
  GenPin(std::shared_ptr<detail::LayoutGens> l, std::vector<uint32_t> blocks)
      : l_(std::move(l)), blocks_(std::move(blocks)) {}
  GenPin(GenPin&& o) noexcept = default;
  GenPin& operator=(GenPin&& o) noexcept {
    if (this != &o) { reset(); l_ = std::move(o.l_); blocks_ = std::move(o.blocks_); }
    return *this;
  }
  GenPin(const GenPin&) = delete;
  GenPin& operator=(const GenPin&) = delete;
  ~GenPin() { reset(); }
  void reset();
  bool held() const { return l_ != nullptr; }

 private:
  std::shared_ptr<detail::LayoutGens> l_;
  std::vector<uint32_t> blocks_;
};

class GenerationTable {
 public:
  // Starts generations for a new layout of `num_blocks` blocks: at 1, or, when a
  // layout of that name existed before, above every generation it ever had (so a
  // claim against the old layout can never match the new one).
  Status add_layout(const std::string& name, uint32_t num_blocks);
  // Forgets a layout (pins already taken stay valid until released).
  void remove_layout(const std::string& name);
  // Current generations of `ids` (OutOfRange for an id beyond the layout).
  Result<std::vector<uint32_t>> get(const std::string& layout, const std::vector<uint32_t>& ids) const;
  // Increments the generations of `ids` (distinct) and returns the new values, then
  // waits until no transfer accepted under an older generation still uses them.
  // timeout_s < 0: no limit. On Timeout the new generations are in force already
  // (new claims fail) but an accepted transfer may still touch the blocks.
  Result<std::vector<uint32_t>> bump(const std::string& layout, const std::vector<uint32_t>& ids, double timeout_s);
  // Checks every entry of `claim`; on success pins the blocks (bump waits for the
  // pin). Errors: NotFound (no such layout), OutOfRange (block id), StaleBlock.
  Result<GenPin> check_and_pin(const GenClaim& claim);
  // A new fd of the layout's published generation table (a sealed memfd of
  // num_blocks little-endian u32s, updated with release stores by bump(), all 0 once
  // the layout is removed), for same-host readers that validate optimistically
  // (docs/wire-shm.md "Shared generation tables"). NotFound, or NotSupported when the
  // table could not be made.
  Result<int> dup_shared_fd(const std::string& layout, uint32_t* num_blocks) const;

 private:
  static void share(detail::LayoutGens& l);
  Result<std::shared_ptr<detail::LayoutGens>> find(const std::string& layout) const;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<detail::LayoutGens>> layouts_;
  std::map<std::string, uint32_t> retired_;  // highest generation of removed layouts
};

}  // namespace pdkv
