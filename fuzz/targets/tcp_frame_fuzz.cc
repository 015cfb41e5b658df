// libFuzzer target: a tcp byte stream as a receiver sees it (transport/tcp/wire.h).
//
// Byte 0 picks the connection's role and phase and the notification limit; the rest is
// a stream of frames (header, extents, aux, payload) run through the same checks the
// progress thread, the handshake and the metadata fetch apply, in the same order.
// Invariants: nothing crashes, and whatever passes check_header announces a bounded
// control buffer. A compressed write's payload goes through the receiver's decoder
// (compress.h decode_payload) into destination buffers as large as its extents, under
// ASan: a frame that decodes past them is a crash. A strided or two-level write's
// payload is scattered by the receiver's run walker (scatter.h) into a region of
// kRegionLen bytes, in chunks of a fuzzed size: a descriptor that passed the checks
// and still walks out of the region is a crash, and so is a walk that does not end
// exactly at the payload's end. A compressed write whose extents passed the checks
// decodes to at most kMaxCompressedChunk (repeated extents cannot multiply a bomb).
#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <utility>
#include <cstdint>
#include <cstring>
#include <vector>

#include "transport/tcp/compress.h"
#include "transport/tcp/wire.h"
#include "transport/tcp/scatter.h"

using namespace pdkv::tcp;

namespace {

constexpr uint64_t kRegionLen = 1ull << 20;  // every region of the pretend target
constexpr uint64_t kCtrlBound =
    uint64_t(kMaxExtentsPerFrame) * sizeof(WireStrided2Extent) +
    std::max<uint64_t>(kMaxMetadataBytes, uint64_t(kMaxNotifWireBytes) + kMaxClaimAux);

ConnState pick_state(uint8_t b) {
  switch (b % 5) {
    case 0: return {ConnRole::kInbound, ConnPhase::kHandshake};
    case 1: return {ConnRole::kInbound, ConnPhase::kOpen};
    case 2: return {ConnRole::kOutbound, ConnPhase::kHandshake};
    case 3: return {ConnRole::kOutbound, ConnPhase::kOpen};
    default: return {ConnRole::kOutbound, ConnPhase::kMetaWait};
  }
}

// Scatters the write payload `p` (`n` bytes) into runs over `region` in chunks of
// `chunk` bytes (resuming mid-piece), as the receiver's landing path does.
void walk_runs(const std::vector<PieceRun>& runs, const uint8_t* p, uint64_t n, size_t chunk) {
  RunCursor cur;
  for (uint64_t done = 0; done < n;) {
    const uint64_t step = std::min<uint64_t>(chunk, n - done);
    scatter_to_runs(runs.data(), runs.size(), cur, reinterpret_cast<const char*>(p) + done, step);
    done += step;
  }
  if (cur.idx != runs.size()) __builtin_trap();  // the pieces and the payload disagree
}

// The descriptors of a strided or two-level frame at `c`, checked as the receiver
// checks them and placed into `region`: their byte sum and runs, or nothing when the
// receiver refuses them.
std::optional<std::pair<uint64_t, std::vector<PieceRun>>> strided_runs(const uint8_t* c, const FrameHeader& h,
                                                                        char* region) {
  auto sum = (h.flags & kFlagStrided2) ? check_strided2_extents(reinterpret_cast<const WireStrided2Extent*>(c), h.count, h)
                                       : check_strided_extents(reinterpret_cast<const WireStridedExtent*>(c), h.count, h);
  if (!sum.ok()) return std::nullopt;
  std::vector<PieceRun> runs;
  for (uint32_t i = 0; i < h.count; ++i) {
    const DescView e = desc_at(c, h.flags, i);
    if (!extent_in_region(e.offset, e.span(), kRegionLen)) return std::nullopt;
    runs.push_back(make_run(region + e.offset, e.len, e.count, e.stride, e.count2, e.stride2));
  }
  return std::make_pair(*sum, std::move(runs));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  ConnState state = pick_state(data[0]);
  const FrameLimits lim{(data[0] & 0x80) ? 0xFFFFFFFFu : (1u << 20)};
  size_t pos = 1;
  while (size - pos >= sizeof(FrameHeader)) {
    const FrameHeader h = decode_header(data + pos);
    pos += sizeof(FrameHeader);
    if (!check_header(h, state, lim).ok()) return 0;  // the connection is closed
    const uint64_t ctrl = control_bytes(h);
    if (ctrl > kCtrlBound) __builtin_trap();  // check_header let a huge frame through
    if (size - pos < ctrl) return 0;          // truncated: the receiver waits (deadline)
    const uint8_t* c = data + pos;
    pos += ctrl;
    const std::string_view aux(reinterpret_cast<const char*>(c) + size_t(h.count) * desc_bytes(h), h.aux_len);
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kHello:  // the handshake's steps, as the receiver takes them
        if (!decode_hello(aux).ok()) return 0;
        state.phase = ConnPhase::kProofWait;
        break;
      case FrameType::kProof:
        if (!decode_mac(aux, "proof").ok()) return 0;
        state.phase = ConnPhase::kOpen;
        break;
      case FrameType::kChallenge:
        if (!decode_challenge(aux).ok()) return 0;
        break;
      case FrameType::kHelloAck:
        if (!decode_mac(aux, "hello-ack").ok()) return 0;
        state.phase = ConnPhase::kOpen;
        break;
      case FrameType::kWrite:
      case FrameType::kWriteZ:
      case FrameType::kReadReq: {
        if (h.flags & (kFlagStrided | kFlagStrided2)) {  // strided (flag 8) or two-level (flag 32): checked whole
          static std::vector<char> region(kRegionLen);
          const auto checked = strided_runs(c, h, region.data());
          if (!checked) return 0;
          const uint64_t total = checked->first;
          const std::vector<PieceRun>& runs = checked->second;
          auto parts = split_data_aux(h, aux);
          if (!parts.ok()) return 0;
          if ((h.flags & kFlagGens) && !pdkv::decode_claim(parts->claim).ok()) return 0;
          if ((h.flags & kFlagZReply) && !decode_zspec(parts->zspec).ok()) return 0;  // compressed read's spec
          if (static_cast<FrameType>(h.type) == FrameType::kWrite && size - pos >= h.payload) {
            uint64_t pieces = 0;
            for (const PieceRun& r : runs) pieces += r.bytes();
            if (pieces != total || total != h.payload) __builtin_trap();  // the checks and the runs disagree
            walk_runs(runs, data + pos, h.payload, 1 + (h.xfer_id % 4099));
          }
          break;
        }
        std::vector<WireExtent> ext(h.count);
        std::memcpy(ext.data(), c, ext.size() * sizeof(WireExtent));
        for (const WireExtent& e : ext)
          if (!extent_in_region(e.offset, e.len, kRegionLen)) return 0;
        auto checked = check_extents(ext.data(), h.count, h);
        if (!checked.ok()) return 0;
        // What a compressed write may decode to is bounded before it is decoded (issue 26).
        if (static_cast<FrameType>(h.type) == FrameType::kWriteZ && *checked > kMaxCompressedChunk) __builtin_trap();
        auto parts = split_data_aux(h, aux);  // block generations (flag 4), then the notification
        if (!parts.ok()) return 0;
        if ((h.flags & kFlagGens) && !pdkv::decode_claim(parts->claim).ok()) return 0;
        if ((h.flags & kFlagZReply) && !decode_zspec(parts->zspec).ok()) return 0;  // compressed read's spec
        if (static_cast<FrameType>(h.type) == FrameType::kWriteZ) {
          if (size - pos < h.payload) return 0;  // truncated
          uint64_t total = 0;
          for (const WireExtent& e : ext) total += e.len;
          if (total > (16u << 20)) break;  // a fuzzer-sized destination only
          std::vector<std::vector<uint8_t>> dst(ext.size());
          std::vector<iovec> iov;
          for (size_t i = 0; i < ext.size(); ++i) {
            dst[i].resize(ext[i].len);
            iov.push_back({dst[i].data(), dst[i].size()});
          }
          std::array<std::unique_ptr<pdkv::Codec>, 4> codecs;
          std::vector<uint8_t> scratch;
          (void)decode_payload(data + pos, h.payload, iov.data(), iov.size(), codecs, scratch);
        }
        break;
      }
      case FrameType::kMetaResp:
      case FrameType::kError:
        return 0;  // the exchange ends here
      default:
        break;
    }
    // Payload (write, read response) lands in the destination, not in a buffer.
    pos += static_cast<size_t>(std::min<uint64_t>(h.payload, size - pos));
  }
  return 0;
}
