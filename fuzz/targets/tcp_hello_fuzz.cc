// libFuzzer target: the hello and hello-ack bodies (transport/tcp/frame.h).
// Invariants: no crash; whatever decodes re-encodes to the same bytes.
#include <cstdint>
#include <string_view>

#include "transport/tcp/frame.h"

using namespace pdkv::tcp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  if (auto h = decode_hello(in); h.ok()) {
    if (encode_hello(*h) != in) __builtin_trap();
  }
  if (auto a = decode_hello_ack(in); a.ok()) {
    if (encode_hello_ack(*a) != in) __builtin_trap();
  }
  return 0;
}
