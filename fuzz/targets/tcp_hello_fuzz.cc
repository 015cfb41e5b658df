// libFuzzer target: the handshake bodies (transport/tcp/wire.h): hello, challenge,
// and the proof / hello-ack MAC.
// Invariants: no crash; whatever decodes re-encodes to the same bytes.
#include <cstdint>
#include <string_view>

#include "transport/tcp/wire.h"

using namespace pdkv::tcp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  if (auto h = decode_hello(in); h.ok()) {
    if (encode_hello(*h) != in) __builtin_trap();
  }
  if (auto c = decode_challenge(in); c.ok()) {
    if (encode_challenge(*c) != in) __builtin_trap();
  }
  if (auto m = decode_mac(in, "mac"); m.ok()) {
    if (encode_mac(*m) != in) __builtin_trap();
  }
  return 0;
}
