// Binds pdkv/spi/auth.h (py_auth.cc): the two halves of the handshake, for a transport
// written in Python (nixl) and for tests that speak a wire protocol by hand.
#pragma once

#include <pybind11/pybind11.h>

namespace pdkv {

void bind_auth(pybind11::module_& m);

}  // namespace pdkv
