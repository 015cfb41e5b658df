// libFuzzer target: the shm control-frame decoder (transport/shm/wire.h).
// Input: byte 0 picks the reading side (CtlSide), the rest is a stream of frames
// (24-byte header + aux) decoded as the transport would, stopping at the first error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "transport/shm/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdkv::shm;
  if (size < 1) return 0;
  CtlSide side = static_cast<CtlSide>(data[0] % 5);
  std::string_view in(reinterpret_cast<const char*>(data + 1), size - 1);
  while (in.size() >= sizeof(CtlHdr)) {
    CtlHdr h;
    std::memcpy(&h, in.data(), sizeof h);
    in.remove_prefix(sizeof h);
    if (!check_ctl_header(h, side, 1u << 20).ok()) return 0;  // the transport closes here
    if (in.size() < h.aux_len) return 0;
    std::string_view aux = in.substr(0, h.aux_len);
    in.remove_prefix(h.aux_len);
    if (!validate_ctl_frame(h, aux, side, 1u << 20).ok()) return 0;
    // The handshake's steps: hello -> proof -> open (target); challenge -> hello-ack -> open.
    if (side == CtlSide::kTargetPreHello) side = CtlSide::kTargetProof;
    else if (side == CtlSide::kTargetProof) side = CtlSide::kTarget;
    else if (side == CtlSide::kInitiatorHello && h.type != static_cast<uint16_t>(Ctl::kChallenge))
      side = CtlSide::kInitiator;
  }
  return 0;
}
