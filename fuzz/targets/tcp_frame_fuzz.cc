// libFuzzer target: a tcp byte stream as a receiver sees it (transport/tcp/frame.h).
//
// Byte 0 picks the connection's role and phase and the notification limit; the rest is
// a stream of frames (header, extents, aux, payload) run through the same checks the
// progress thread, the handshake and the metadata fetch apply, in the same order.
// Invariants: nothing crashes, and whatever passes check_header announces a bounded
// control buffer. A compressed write's payload goes through the receiver's decoder
// (compress.h decode_payload) into destination buffers as large as its extents, under
// ASan: a frame that decodes past them is a crash.
#include <algorithm>
#include <array>
#include <memory>
#include <cstdint>
#include <cstring>
#include <vector>

#include "transport/tcp/compress.h"
#include "transport/tcp/frame.h"

using namespace pdkv::tcp;

namespace {

constexpr uint64_t kRegionLen = 1ull << 20;  // every region of the pretend target
constexpr uint64_t kCtrlBound =
    uint64_t(kMaxExtentsPerFrame) * sizeof(WireStridedExtent) +
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
      case FrameType::kHello:
        if (!decode_hello(aux).ok()) return 0;
        state.phase = ConnPhase::kOpen;
        break;
      case FrameType::kHelloAck:
        if (!decode_hello_ack(aux).ok()) return 0;
        state.phase = ConnPhase::kOpen;
        break;
      case FrameType::kWrite:
      case FrameType::kWriteZ:
      case FrameType::kReadReq: {
        if (h.flags & kFlagStrided) {  // strided descriptors (flag 8): checked whole, as the receiver does
          std::vector<WireStridedExtent> sext(h.count);
          std::memcpy(sext.data(), c, sext.size() * sizeof(WireStridedExtent));
          if (!check_strided_extents(sext.data(), h.count, h).ok()) return 0;
          for (const WireStridedExtent& e : sext)
            if (!extent_in_region(e.offset, strided_span(e), kRegionLen)) return 0;
          auto parts = split_data_aux(h, aux);
          if (!parts.ok()) return 0;
          if ((h.flags & kFlagGens) && !pdkv::decode_claim(parts->claim).ok()) return 0;
          if ((h.flags & kFlagZReply) && !decode_zspec(parts->zspec).ok()) return 0;  // compressed read's spec
          break;
        }
        std::vector<WireExtent> ext(h.count);
        std::memcpy(ext.data(), c, ext.size() * sizeof(WireExtent));
        for (const WireExtent& e : ext)
          if (!extent_in_region(e.offset, e.len, kRegionLen)) return 0;
        if (!check_extents(ext.data(), h.count, h).ok()) return 0;
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
