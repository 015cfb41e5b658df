// libFuzzer target: the cuda_ipc control-frame decoder (transport/cuda_ipc/wire.h).
// Input: byte 0 picks the reading side, the rest is a stream of frames.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "transport/cuda_ipc/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdkv::cuda_ipc;
  if (size < 1) return 0;
  CtlSide side = static_cast<CtlSide>(data[0] % 5);
  std::string_view in(reinterpret_cast<const char*>(data + 1), size - 1);
  while (in.size() >= sizeof(CtlHdr)) {
    CtlHdr h;
    std::memcpy(&h, in.data(), sizeof h);
    in.remove_prefix(sizeof h);
    if (!check_ctl_header(h, side).ok()) return 0;
    if (in.size() < h.aux_len) return 0;
    std::string_view aux = in.substr(0, h.aux_len);
    in.remove_prefix(h.aux_len);
    if (!validate_ctl_frame(h, aux, side).ok()) return 0;
    // The handshake's steps: hello -> proof -> open (exporter); challenge -> hello-ack -> open.
    if (side == CtlSide::kExporterPreHello) side = CtlSide::kExporterProof;
    else if (side == CtlSide::kExporterProof) side = CtlSide::kExporter;
    else if (side == CtlSide::kImporterHello && h.type != static_cast<uint16_t>(Ctl::kChallenge))
      side = CtlSide::kImporter;
  }
  return 0;
}
